//! What the handlers share: the state type and the parsing of query
//! strings and JSON bodies into 400s that name the problem.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use serde::de::DeserializeOwned;

use crate::core::Daemon;
use crate::error::{ApiError, ApiResult};

/// Shared state of the handlers.
pub type AppState = Arc<Daemon>;

/// Default `timeout` of waits for the agent.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(60);

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

/// Every value of `key`, in order.
pub fn query_all(pairs: &[(String, String)], key: &str) -> Vec<String> {
    pairs
        .iter()
        .filter(|(k, _)| k == key)
        .map(|(_, v)| v.clone())
        .collect()
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

/// A boolean query value: `true`/`1` or `false`/`0`; another is a 400.
pub fn query_bool(q: &[(String, String)], key: &str) -> ApiResult<Option<bool>> {
    match query_get(q, key) {
        None => Ok(None),
        Some("true" | "1") => Ok(Some(true)),
        Some("false" | "0" | "") => Ok(Some(false)),
        Some(v) => Err(ApiError::bad_request(format!(
            "`{key}={v}` is not true or false"
        ))),
    }
}

/// Parses a Go duration (`300ms`, `1.5s`, `2m30s`, `1h`; units ns, us,
/// µs, ms, s, m, h), as Slicer's SDKs send `debounce` and `timeout`.
pub fn parse_go_duration(key: &str, value: &str) -> ApiResult<Duration> {
    let bad = || {
        ApiError::bad_request(format!(
            "`{key}={value}` is not a duration like 300ms, 1.5s or 2m30s"
        ))
    };
    let mut rest = value.trim();
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = 0f64;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let number: f64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += number * seconds;
        rest = &rest[unit_len..];
    }
    Duration::try_from_secs_f64(total)
        .ok()
        .filter(|d| d.as_secs() < 1 << 40)
        .ok_or_else(bad)
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
    fn go_durations_parse_as_the_sdks_write_them() {
        let ms = |v: &str| parse_go_duration("t", v).map(|d| d.as_millis());
        assert_eq!(ms("300ms"), Ok(300));
        assert_eq!(ms("1.5s"), Ok(1500));
        assert_eq!(ms("2m30s"), Ok(150_000));
        assert_eq!(ms("1h"), Ok(3_600_000));
        assert_eq!(ms("0"), Ok(0));
        assert_eq!(ms("500us"), Ok(0));
        for bad in ["", "5", "5x", "s", "1.2.3s", "-1s", "ms5"] {
            let e = parse_go_duration("debounce", bad).expect_err(bad);
            assert!(e.message.contains("`debounce="), "{}", e.message);
        }
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
}
