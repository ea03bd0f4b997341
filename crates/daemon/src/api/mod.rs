//! The REST API (docs/api.md, docs/openapi.yaml): routes onto [`crate::core::Daemon`]
//! methods, errors as `{error, code}`, the bearer token on TCP.

mod agent_call;
mod bg;
mod commits;
#[cfg(test)]
mod contract;
mod fs;
mod guest;
mod images;
mod params;
mod secrets;
mod stats;
#[cfg(test)]
mod testing;
mod vms;
mod watch;

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{on, MethodFilter};
use axum::{Json, Router};

use crate::error::ApiError;

/// The OpenAPI description kept in the repository and served as is.
pub const OPENAPI_YAML: &str = include_str!("../../../../docs/openapi.yaml");

pub use guest::{parse_target, parse_upstream};
pub use params::{
    parse_json, parse_query_enum, parse_timeout, query_get, query_num, query_only, query_pairs,
    AppState, DEFAULT_WAIT,
};

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
        .add(M::GET, "/nodes/stats", stats::all)
        .add(M::GET, "/node/{hostname}/stats", stats::one)
        .add(M::GET, "/vm/{hostname}", vms::describe)
        .add(M::DELETE, "/vm/{hostname}", vms::delete)
        .add(M::GET, "/vm/{hostname}/tags", vms::tags)
        .add(M::PATCH, "/vm/{hostname}/tags", vms::patch_tags)
        .add(M::GET, "/vm/{hostname}/network", vms::network)
        .add(M::PUT, "/vm/{hostname}/network", vms::set_network)
        .add(M::GET, "/vm/{hostname}/health", guest::health)
        .add(M::GET, "/vm/{hostname}/logs", vms::logs)
        .add(M::POST, "/vm/{hostname}/shutdown", vms::shutdown)
        .add(M::POST, "/vm/{hostname}/relaunch", vms::relaunch)
        .add(M::POST, "/vm/{hostname}/pause", vms::pause)
        .add(M::POST, "/vm/{hostname}/resume", vms::resume)
        .add(M::POST, "/vm/{hostname}/suspend", vms::suspend)
        .add(M::POST, "/vm/{hostname}/restore", vms::restore)
        .add(M::POST, "/daemon/shutdown", vms::daemon_shutdown)
        .add(M::POST, "/vm/{hostname}/exec", guest::exec)
        .add(M::GET, "/vm/{hostname}/exec", bg::list)
        .add(M::GET, "/vm/{hostname}/exec/{id}", bg::get)
        .add(M::DELETE, "/vm/{hostname}/exec/{id}", bg::remove)
        .add(M::GET, "/vm/{hostname}/exec/{id}/logs", bg::logs)
        .add(M::POST, "/vm/{hostname}/exec/{id}/kill", bg::kill)
        .add(M::GET, "/vm/{hostname}/exec/{id}/wait-exit", bg::wait_exit)
        .add(M::GET, "/vm/{hostname}/cp", guest::download)
        .add(M::POST, "/vm/{hostname}/cp", guest::upload)
        .add(M::GET, "/vm/{hostname}/fs/stat", fs::stat)
        .add(M::GET, "/vm/{hostname}/fs/readdir", fs::readdir)
        .add(M::POST, "/vm/{hostname}/fs/mkdir", fs::mkdir)
        .add(M::DELETE, "/vm/{hostname}/fs/remove", fs::remove)
        .add(M::GET, "/vm/{hostname}/fs/watch", watch::watch)
        .add(M::GET, "/vm/{hostname}/shell", guest::shell)
        .add(M::GET, "/vm/{hostname}/forward", guest::forward)
        .add(M::POST, "/vm/{hostname}/commit", commits::commit)
        .add(M::GET, "/vm/commits", commits::list)
        .add(M::DELETE, "/vm/commits/{id}", commits::delete)
        .add(M::POST, "/vm/commits/{id}/fork", commits::fork)
        .add(M::PUT, "/vm/commits/{id}/pool", commits::set_pool)
        .add(M::DELETE, "/vm/commits/{id}/pool", commits::reset_pool)
        .add(M::GET, "/secrets", secrets::list)
        .add(M::POST, "/secrets", secrets::create)
        .add(M::PATCH, "/secrets/{name}", secrets::update)
        .add(M::DELETE, "/secrets/{name}", secrets::delete)
        .add(M::GET, "/images", images::list)
        .add(M::POST, "/images", images::import)
        .add(M::GET, "/images/{name}", images::get)
        .add(M::DELETE, "/images/{name}", images::delete)
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
    let path = req.uri().path();
    if path == "/proxy" || path.starts_with("/proxy/") {
        return ApiError::not_found(format!(
            "{} {path}: Slicer's egress proxy API is not part of tine; no proxy runs, \
             so there are no proxy clients, secrets or allow rules to manage. \
             A VM's egress is limited by its isolated network's allow/drop lists \
             (`network` at create and fork, PUT /vm/{{hostname}}/network)",
            req.method()
        ));
    }
    ApiError::not_found(format!("no route {} {path}", req.method()))
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

async fn healthz() -> Json<tine_proto::api::HealthResponse> {
    Json(tine_proto::api::HealthResponse {
        status: tine_proto::api::HealthStatus::Ok,
    })
}

async fn openapi() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/yaml")], OPENAPI_YAML)
}

#[cfg(test)]
mod tests {
    use super::*;

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
