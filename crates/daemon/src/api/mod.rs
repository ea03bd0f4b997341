//! The REST API (docs/api.md, docs/openapi.yaml): routes onto [`Daemon`]
//! methods, errors as `{error, code}`, the bearer token on TCP.

mod commits;
mod guest;
mod vms;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::{Json, Router};
use serde::de::DeserializeOwned;

use crate::core::Daemon;
use crate::error::{ApiError, ApiResult};

/// The OpenAPI description kept in the repository and served as is.
pub const OPENAPI_YAML: &str = include_str!("../../../../docs/openapi.yaml");

/// Default `timeout` of waits for the agent.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);

/// Shared state of the handlers.
pub type AppState = Arc<Daemon>;

/// Builds the router and the list of `(METHOD, path)` it serves (the
/// OpenAPI test compares the two).
pub struct Routes {
    router: Router<AppState>,
    /// Every route, as `(method, path)` with `{param}` placeholders.
    pub list: Vec<(Method, String)>,
}

impl Routes {
    fn new() -> Self {
        Routes {
            router: Router::new(),
            list: Vec::new(),
        }
    }

    fn add<H, T>(mut self, method: Method, path: &str, handler: H) -> Self
    where
        H: axum::handler::Handler<T, AppState>,
        T: 'static,
    {
        let filter = MethodFilter::try_from(method.clone()).unwrap_or(MethodFilter::GET);
        self.router = self.router.route(path, on(filter, handler));
        self.list.push((method, path.to_owned()));
        self
    }
}

/// Every route of the API.
pub fn routes() -> Routes {
    use Method as M;
    Routes::new()
        .add(M::GET, "/healthz", healthz)
        .add(M::GET, "/info", vms::info)
        .add(M::GET, "/openapi.yaml", openapi)
        .add(M::GET, "/hostgroup", vms::host_groups)
        .add(M::GET, "/hostgroup/{group}/nodes", vms::group_nodes)
        .add(M::POST, "/hostgroup/{group}/nodes", vms::create)
        .add(
            M::DELETE,
            "/hostgroup/{group}/nodes/{hostname}",
            vms::delete_in_group,
        )
        .add(M::GET, "/nodes", vms::nodes)
        .add(M::GET, "/vm/{hostname}", vms::describe)
        .add(M::DELETE, "/vm/{hostname}", vms::delete)
        .add(M::GET, "/vm/{hostname}/tags", vms::tags)
        .add(M::PATCH, "/vm/{hostname}/tags", vms::patch_tags)
        .add(M::GET, "/vm/{hostname}/health", guest::health)
        .add(M::GET, "/vm/{hostname}/logs", vms::logs)
        .add(M::POST, "/vm/{hostname}/shutdown", vms::shutdown)
        .add(M::POST, "/vm/{hostname}/relaunch", vms::relaunch)
        .add(M::POST, "/vm/{hostname}/exec", guest::exec)
        .add(M::GET, "/vm/{hostname}/cp", guest::download)
        .add(M::POST, "/vm/{hostname}/cp", guest::upload)
        .add(M::GET, "/vm/{hostname}/shell", guest::shell)
        .add(M::GET, "/vm/{hostname}/forward", guest::forward)
        .add(M::POST, "/vm/{hostname}/commit", commits::commit)
        .add(M::GET, "/vm/commits", commits::list)
        .add(M::DELETE, "/vm/commits/{id}", commits::delete)
        .add(M::POST, "/vm/commits/{id}/fork", commits::fork)
}

/// The application: routes, fallbacks, state.
pub fn app(daemon: AppState) -> Router {
    routes()
        .router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(daemon)
}

/// The application with the bearer token required (the TCP listener).
pub fn app_with_token(daemon: AppState, token: String) -> Router {
    let token = Arc::new(token);
    app(daemon).layer(axum::middleware::from_fn(
        move |req: Request, next: Next| {
            let token = token.clone();
            async move { require_token(&token, req, next).await }
        },
    ))
}

async fn require_token(token: &str, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        None => ApiError::new(
            tine_proto::api::ErrorCode::Unauthorized,
            "missing bearer token (Authorization: Bearer <token>; the token is in <data_dir>/auth/token)",
        )
        .into_response(),
        Some(t) if !constant_time_eq(t.as_bytes(), token.as_bytes()) => ApiError::new(
            tine_proto::api::ErrorCode::Unauthorized,
            "wrong bearer token",
        )
        .into_response(),
        Some(_) => next.run(req).await,
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> Response {
    let mut r = ApiError::bad_request(format!(
        "{} is not allowed on {}",
        req.method(),
        req.uri().path()
    ))
    .into_response();
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/yaml")], OPENAPI_YAML)
}

/// Parses a JSON body into `T`, answering 400 with serde's message
/// (which names the field) when it does not parse. An empty body is `{}`.
pub fn parse_json<T: DeserializeOwned>(body: &Bytes) -> ApiResult<T> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))
}

/// Parses a `timeout` value: a humantime duration (`30s`, `1m`, `500ms`)
/// or a number of seconds.
pub fn parse_timeout(value: Option<&str>, default: Duration) -> ApiResult<Duration> {
    let Some(v) = value else {
        return Ok(default);
    };
    if let Ok(secs) = v.parse::<f64>() {
        if (0.0..1e9).contains(&secs) {
            return Ok(Duration::from_secs_f64(secs));
        }
    }
    humantime::parse_duration(v).map_err(|e| {
        ApiError::bad_request(format!(
            "timeout `{v}` is not a duration ({e}); use 30s, 1m or 500ms"
        ))
    })
}

/// Parses the query value `key` as one of a closed set; a value outside
/// it is a 400 that names the key and the allowed values.
pub fn parse_query_enum<T>(pairs: &[(String, String)], key: &str) -> ApiResult<Option<T>>
where
    T: std::str::FromStr<Err = tine_proto::api::UnknownValue>,
{
    query_get(pairs, key)
        .map(|v| {
            v.parse::<T>()
                .map_err(|e| ApiError::bad_request(e.to_string()))
        })
        .transpose()
}

/// The query string as ordered key/value pairs (repeated keys kept).
pub fn query_pairs(uri: &axum::http::Uri) -> Vec<(String, String)> {
    uri.query()
        .map(|q| {
            form_urlencoded::parse(q.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// The first value of `key`.
pub fn query_get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Refuses query keys outside `allowed`, naming the first unknown one.
pub fn query_only(pairs: &[(String, String)], allowed: &[&str]) -> ApiResult<()> {
    if let Some((k, _)) = pairs.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
        return Err(ApiError::bad_request(format!(
            "unknown query parameter `{k}` (allowed: {})",
            allowed.join(", ")
        )));
    }
    Ok(())
}

/// Parses an optional numeric query value.
pub fn query_num<T: std::str::FromStr>(
    pairs: &[(String, String)],
    key: &str,
) -> ApiResult<Option<T>> {
    query_get(pairs, key)
        .map(|v| {
            v.parse()
                .map_err(|_| ApiError::bad_request(format!("`{key}={v}` is not a number")))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_accept_humantime_and_seconds() {
        let d = Duration::from_secs(60);
        assert_eq!(parse_timeout(None, d), Ok(d));
        assert_eq!(parse_timeout(Some("5"), d), Ok(Duration::from_secs(5)));
        assert_eq!(parse_timeout(Some("1m"), d), Ok(Duration::from_secs(60)));
        assert_eq!(
            parse_timeout(Some("250ms"), d),
            Ok(Duration::from_millis(250))
        );
        let e = parse_timeout(Some("soon"), d).expect_err("bad");
        assert!(e.message.contains("timeout `soon`"), "{}", e.message);
    }

    #[test]
    fn json_bodies_name_the_problem() {
        let e = parse_json::<tine_proto::api::CreateVmRequest>(&Bytes::from_static(b"{\"cpus\":"))
            .expect_err("malformed");
        assert!(
            e.message.starts_with("malformed JSON body"),
            "{}",
            e.message
        );
        let ok: tine_proto::api::CreateVmRequest = parse_json(&Bytes::new()).expect("empty is {}");
        assert_eq!(ok, Default::default());
    }

    #[test]
    fn queries_keep_repeats_and_refuse_unknown_keys() {
        let uri: axum::http::Uri = "/x?cmd=ls&args=-l&args=%2Ftmp".parse().expect("uri");
        let q = query_pairs(&uri);
        assert_eq!(q.len(), 3);
        assert_eq!(q[2].1, "/tmp");
        assert!(query_only(&q, &["cmd", "args"]).is_ok());
        let e = query_only(&q, &["cmd"]).expect_err("unknown");
        assert!(e.message.contains("`args`"));
    }

    #[test]
    fn the_openapi_document_lists_exactly_the_served_routes() {
        let doc: serde_yaml::Value = serde_yaml::from_str(OPENAPI_YAML).expect("valid YAML");
        let paths = doc["paths"].as_mapping().expect("paths");
        let mut documented = std::collections::BTreeSet::new();
        for (path, item) in paths {
            let path = path.as_str().expect("path").to_owned();
            for (method, _) in item.as_mapping().expect("path item") {
                let m = method.as_str().expect("method");
                if m != "parameters" {
                    documented.insert((m.to_ascii_uppercase(), path.clone()));
                }
            }
        }
        let served: std::collections::BTreeSet<(String, String)> = routes()
            .list
            .iter()
            .map(|(m, p)| (m.as_str().to_owned(), p.clone()))
            .collect();
        let missing: Vec<_> = served.difference(&documented).collect();
        let extra: Vec<_> = documented.difference(&served).collect();
        assert!(
            missing.is_empty(),
            "served but not in docs/openapi.yaml: {missing:?}"
        );
        assert!(
            extra.is_empty(),
            "in docs/openapi.yaml but not served: {extra:?}"
        );
    }

    #[test]
    fn closed_query_values_name_the_allowed_ones() {
        let uri: axum::http::Uri = "/x?wait=later".parse().expect("uri");
        let e = parse_query_enum::<tine_proto::api::Wait>(&query_pairs(&uri), "wait")
            .expect_err("bad wait");
        assert_eq!(e.message, "wait `later` is not one of none, agent");
        let uri: axum::http::Uri = "/x?wait=agent".parse().expect("uri");
        assert_eq!(
            parse_query_enum(&query_pairs(&uri), "wait").expect("wait"),
            Some(tine_proto::api::Wait::Agent)
        );
    }

    #[test]
    fn token_comparison_is_exact() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
