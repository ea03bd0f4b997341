//! Contract tests of the SDK calls tine refuses: the Go SDK's egress proxy
//! calls (`/proxy/v1`, Slicer Proxy: tine runs no proxy) and its chunked
//! copy (`SupportsChunkedCopy`, `CpToVMChunked`: finished by Slicer's own
//! guest agent). Each gets a 4xx whose `{error, code}` body says why, so
//! the SDK's error names the reason instead of a bare "no route".

use axum::http::{Method, StatusCode};

use super::{Sdk, SdkError};

#[tokio::test]
async fn proxy_calls_are_refused_naming_why() {
    let sdk = Sdk::new();
    // Every request of the Go SDK's proxy methods, as it sends them.
    let client = serde_json::json!({"name": "ci"});
    let secret = serde_json::json!({"name": "gh", "kind": "bearer", "value": "t"});
    let allow = serde_json::json!({"client": "ci", "host": "api.github.com", "secret": "gh"});
    let revoke = serde_json::json!({"client": "ci", "host": "api.github.com"});
    for (method, path, body) in [
        // CreateProxyClient / ListProxyClients / DeleteProxyClient.
        (Method::POST, "/proxy/v1/clients", Some(client)),
        (Method::GET, "/proxy/v1/clients", None),
        (Method::DELETE, "/proxy/v1/clients/ci", None),
        // CreateProxySecret / ListProxySecrets / DeleteProxySecret.
        (Method::POST, "/proxy/v1/secrets", Some(secret)),
        (Method::GET, "/proxy/v1/secrets", None),
        (Method::DELETE, "/proxy/v1/secrets/gh", None),
        // AddProxyAllow / RemoveProxyAllow / RemoveProxyAllowByTuple.
        (Method::POST, "/proxy/v1/allows", Some(allow)),
        (Method::DELETE, "/proxy/v1/allows/ci/api.github.com", None),
        (Method::POST, "/proxy/v1/allows/revoke", Some(revoke)),
        // ListProxyRules.
        (Method::GET, "/proxy/v1/clients/ci", None),
    ] {
        let a = match body {
            Some(b) => sdk.json(method.clone(), path, b).await,
            None => sdk.send(method.clone(), path, None).await,
        };
        assert_eq!(a.status, StatusCode::NOT_FOUND, "{method} {path}");
        assert_eq!(a.content_type, "application/json");
        let e: SdkError = a.decode();
        assert_eq!(e.code, "not_found");
        assert!(
            e.error.contains("egress proxy API is not part of tine")
                && e.error.contains(path)
                && e.error.contains("allow/drop"),
            "{method} {path}: {}",
            e.error
        );
    }
    // Any other path still names the missing route.
    let a = sdk.get("/nope").await;
    assert!(a.decode::<SdkError>().error.contains("no route GET /nope"));
}

#[tokio::test]
async fn chunked_copy_is_refused_naming_cp() {
    let sdk = Sdk::new();
    let h = sdk.create(serde_json::json!({})).await.hostname;
    // SupportsChunkedCopy and CpToVMChunked first run Slicer's agent
    // (`upload check`) with ExecBuffered; a non-200 is their error, and
    // CpToVMChunked stops before it sends a chunk. Its `finalise` and
    // `abort` calls get the same answer.
    let agent = "cmd=%2Fusr%2Flocal%2Fbin%2Fslicer-agent&stdio=base64";
    for args in [
        "args=upload&args=check",
        "args=upload&args=finalise&args=--manifest&args=%2Ftmp%2Fm.json&args=--uid&args=0&args=--gid&args=0",
        "args=upload&args=abort&args=--manifest&args=%2Ftmp%2Fm.json&args=--uid&args=0&args=--gid&args=0",
    ] {
        let uri = format!("/vm/{h}/exec?{agent}&{args}&uid=0&gid=0&buffered=true");
        let a = sdk.send(Method::POST, &uri, None).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{args}: {}", a.text());
        let e: SdkError = a.decode();
        assert!(
            e.error.contains("chunked copy") && e.error.contains("CpToVM"),
            "{args}: {}",
            e.error
        );
    }
    // Nothing was run in the guest for them.
    assert!(!sdk.fake.seen(&h).iter().any(|s| matches!(
        s,
        crate::launcher::fake::Seen::Agent(tine_proto::agent::Request::Exec(_))
    )));
}
