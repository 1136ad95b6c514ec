//! The dashboard at `/`: its files from `dashboard_dir` (precompressed ones to browsers that
//! accept gzip), `index.html` for client-side routes, 404 for missing files, and a 503 page
//! while it is not built. The API answers the same either way.
//!
//! Serving files touches no database, so these tests run on SQLite only.

use bc_testing::{Backend, TestServer};
use reqwest::header;
use serde_json::json;
use std::path::Path;

const INDEX_HTML: &[u8] = b"<!doctype html><title>dashboard</title>";
const APP_JS: &[u8] = b"console.log('dashboard');";
/// The wasm magic number and version: what a real module starts with.
const APP_WASM: &[u8] = b"\0asm\x01\0\0\0";
/// Not real gzip: the server passes the `.gz` copy through untouched, so any bytes that differ
/// from `APP_WASM` show which file was served.
const APP_WASM_GZ: &[u8] = b"\x1f\x8b pretend this is app.wasm, gzipped";

/// What one request expects back.
struct Case {
    path: &'static str,
    /// Send `Accept-Encoding: gzip` (reqwest sends no `Accept-Encoding` by itself here).
    gzip: bool,
    status: u16,
    /// The start of `Content-Type`, when it matters.
    content_type: Option<&'static str>,
    /// `Content-Encoding`, if the response must have one.
    content_encoding: Option<&'static str>,
    body: Body,
}

enum Body {
    Exactly(&'static [u8]),
    Contains(&'static str),
}

/// Writes `files` (name, contents) into `dir`.
fn write_files(dir: &Path, files: &[(&str, &[u8])]) {
    for (name, contents) in files {
        std::fs::write(dir.join(name), contents).expect("writing a dashboard file");
    }
}

/// A server whose `dashboard_dir` is `dir`.
async fn server_on(dir: &Path) -> TestServer {
    let dir = dir.to_path_buf();
    TestServer::start_with(Backend::Sqlite, move |config| {
        config.dashboard_dir = dir.clone();
    })
    .await
    .expect("starting a test server")
}

/// Sends each case's request and checks its answer, including the `Cache-Control` every
/// dashboard response carries.
async fn check(s: &TestServer, cases: &[Case]) {
    let client = reqwest::Client::new();
    for case in cases {
        let mut request = client.get(format!("{}{}", s.url(), case.path));
        if case.gzip {
            request = request.header(header::ACCEPT_ENCODING, "gzip");
        }
        let response = request.send().await.expect("the test server answers");
        let what = format!("GET {} (gzip: {})", case.path, case.gzip);
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await.expect("a body");
        let header_of = |name| headers.get(name).and_then(|v| v.to_str().ok());
        assert_eq!(status, case.status, "{what}: {body:?}");
        assert_eq!(header_of(header::CACHE_CONTROL), Some("no-cache"), "{what}");
        if let Some(expected) = case.content_type {
            let content_type = header_of(header::CONTENT_TYPE).unwrap_or_default();
            assert!(
                content_type.starts_with(expected),
                "{what}: Content-Type {content_type:?}, expected {expected:?}"
            );
        }
        assert_eq!(
            header_of(header::CONTENT_ENCODING),
            case.content_encoding,
            "{what}"
        );
        match case.body {
            Body::Exactly(expected) => assert_eq!(&body[..], expected, "{what}"),
            Body::Contains(expected) => assert!(
                String::from_utf8_lossy(&body).contains(expected),
                "{what}: {body:?} does not contain {expected:?}"
            ),
        }
    }
}

/// `/healthz` and an authenticated GraphQL operation work.
async fn check_api(s: &TestServer) {
    assert_eq!(s.get("/healthz").await, (200, "ok".to_owned()));
    let data = s
        .gql(Some(s.admin_token()), "{ __typename }", json!({}))
        .await;
    assert_eq!(data.status, 200);
    assert_eq!(data.data()["__typename"], "Query");
}

/// A page of the dashboard: `index.html`, uncompressed.
fn page(path: &'static str) -> Case {
    Case {
        path,
        gzip: false,
        status: 200,
        content_type: Some("text/html"),
        content_encoding: None,
        body: Body::Exactly(INDEX_HTML),
    }
}

/// The 503 page that stands in for the dashboard while it is not built.
fn not_built(path: &'static str) -> Case {
    Case {
        path,
        gzip: false,
        status: 503,
        content_type: Some("text/html"),
        content_encoding: None,
        body: Body::Contains("scripts/build-web"),
    }
}

#[tokio::test]
async fn a_built_dashboard_serves_its_files_and_index_html_for_client_routes() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    write_files(
        dir.path(),
        &[
            ("index.html", INDEX_HTML),
            ("app.js", APP_JS),
            ("app.wasm", APP_WASM),
            ("app.wasm.gz", APP_WASM_GZ),
        ],
    );
    let s = server_on(dir.path()).await;
    check(
        &s,
        &[
            page("/"),
            page("/nodes/node_x"),
            Case {
                path: "/app.js",
                gzip: false,
                status: 200,
                content_type: Some("text/javascript"),
                content_encoding: None,
                body: Body::Exactly(APP_JS),
            },
            Case {
                path: "/app.wasm",
                gzip: false,
                status: 200,
                content_type: Some("application/wasm"),
                content_encoding: None,
                body: Body::Exactly(APP_WASM),
            },
            Case {
                path: "/app.wasm",
                gzip: true,
                status: 200,
                content_type: Some("application/wasm"),
                content_encoding: Some("gzip"),
                body: Body::Exactly(APP_WASM_GZ),
            },
            // A missing file is 404, not index.html: a script tag or a wasm fetch given HTML
            // would fail with a parse error far from the cause.
            Case {
                path: "/missing.js",
                gzip: false,
                status: 404,
                content_type: None,
                content_encoding: None,
                body: Body::Exactly(b""),
            },
        ],
    )
    .await;
    check_api(&s).await;
    s.stop().await;
}

#[tokio::test]
async fn an_unbuilt_dashboard_answers_503_until_it_is_built_and_the_api_works_meanwhile() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let s = server_on(dir.path()).await;
    check(&s, &[not_built("/"), not_built("/nodes/node_x")]).await;
    check_api(&s).await;

    // Building the dashboard while the server runs makes it appear without a restart.
    write_files(dir.path(), &[("index.html", INDEX_HTML)]);
    check(&s, &[page("/"), page("/nodes/node_x")]).await;
    check_api(&s).await;
    s.stop().await;
}
