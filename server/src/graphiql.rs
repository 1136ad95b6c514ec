//! GraphiQL at `GET /graphql`, with its scripts served from the binary at `/graphql/assets/`
//! rather than a CDN (see `server/assets/graphiql/README.md`). The page signs in the way the
//! dashboard does: a `#token=` link, or the token the dashboard keeps in local storage.

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

/// The page.
pub fn page() -> Html<&'static str> {
    Html(include_str!("../assets/graphiql/index.html"))
}

/// (name, content type, bytes) of each file the page loads.
const ASSETS: &[(&str, &str, &[u8])] = &[
    (
        "graphiql-4.1.2.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../assets/graphiql/graphiql-4.1.2.min.js"),
    ),
    (
        "graphiql-4.1.2.min.css",
        "text/css; charset=utf-8",
        include_bytes!("../assets/graphiql/graphiql-4.1.2.min.css"),
    ),
    (
        "react-18.3.1.production.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../assets/graphiql/react-18.3.1.production.min.js"),
    ),
    (
        "react-dom-18.3.1.production.min.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../assets/graphiql/react-dom-18.3.1.production.min.js"),
    ),
];

/// Names carry their version, so a browser may keep each file for good.
const ASSET_CACHE_CONTROL: &str = "public, max-age=31536000, immutable";

/// `GET /graphql/assets/{file}`.
pub async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        Some((_, content_type, bytes)) => (
            [
                (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
                (
                    header::CACHE_CONTROL,
                    HeaderValue::from_static(ASSET_CACHE_CONTROL),
                ),
            ],
            *bytes,
        )
            .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}
