//! One request through the real router, for the API's unit tests (the SDK
//! contract tests and each route module's own).

use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use tower::ServiceExt;

/// One answer: status, content type, headers, body.
pub struct Answer {
    pub status: StatusCode,
    pub content_type: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    /// Decodes the body as JSON, failing with the body shown.
    pub fn decode<T: DeserializeOwned>(&self) -> T {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "cannot decode {} ({e}): {}",
                std::any::type_name::<T>(),
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header's value, when it is there and readable as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends `method uri` with `body` (and its content type, when given)
/// through `app`.
pub async fn send(
    app: &Router,
    method: Method,
    uri: &str,
    content_type: Option<&str>,
    body: Vec<u8>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(content_type) = content_type {
        req = req.header("content-type", content_type);
    }
    let req = req.body(Body::from(body)).expect("request");
    let response = app.clone().oneshot(req).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
        .to_vec();
    Answer {
        status,
        content_type,
        headers,
        body,
    }
}
