//! The typed GraphQL client. Every operation in `graphql/operations.graphql` becomes a type
//! here, checked against `../schema.graphql` at compile time, and every answer becomes either
//! its data or one [`ApiError`] carrying the server's stable `extensions.code`.

use graphql_client::{GraphQLQuery, Response};
use serde::Serialize;

use crate::session;

/// The server's `DateTime` scalar: RFC 3339, kept as sent and parsed where it is shown.
pub type DateTime = String;
/// The server's `JSON` scalar.
#[allow(clippy::upper_case_acronyms)]
pub type JSON = serde_json::Value;

macro_rules! operations {
    ($($name:ident),* $(,)?) => {$(
        #[derive(GraphQLQuery)]
        #[graphql(
            schema_path = "../schema.graphql",
            query_path = "graphql/operations.graphql",
            response_derives = "Debug, Clone, PartialEq, Serialize",
            variables_derives = "Debug, Clone"
        )]
        pub struct $name;
    )*};
}

operations!(
    Viewer,
    CatalogSites,
    CatalogPools,
    FleetChanges,
    NodeRowById,
    NodePage,
    NodeEvents,
    NodeEventsLive,
    NodeCommandsLive,
    Capacity,
    CordonNode,
    UncordonNode,
    DrainNode,
    TaintNode,
    UntaintNode,
    LabelNode,
    RevokeNodeIdentity,
    SendCommand,
    CancelCommand,
);

// History (issue 15): `history.rs`, `events.rs`, and the node page's past view.
operations!(NodeAsOf, EventLog, EventLogLive, ClearNodeCondition);

// Placement (issue 13): `placement.rs`, `reservations.rs`, `allocations.rs`.
operations!(
    Tenants,
    Reservations,
    ReservationById,
    CreateReservation,
    ReleaseReservation,
    ReservationUpdatesLive,
);

// Bare metal (issue 14): `metal.rs`, `bare_metal.rs`.
operations!(
    BareMetalNodeById,
    EnrollBareMetalNode,
    PowerNode,
    AbortWorkflow,
    ProvisionStateTable,
    TransitionNode,
);

/// Where the API lives: the same origin that served the dashboard.
pub const GRAPHQL_PATH: &str = "/graphql";

/// An error from the API (its `extensions.code`) or from getting there (`NETWORK`,
/// `BAD_RESPONSE`, both made here).
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub code: String,
    pub message: String,
    /// `CONFLICT`: the node's version now.
    pub current_version: Option<i64>,
    /// `RESUME_REQUIRED`: where to resume a subscription.
    pub cursor: Option<Box<str>>,
    /// `INVALID_STATE`: the moves that are allowed.
    pub allowed: Vec<String>,
    /// `BAD_USER_INPUT` about one field: the input path, as `input.bmc.address`. The rare
    /// details are boxed strings: every `Result` of the dashboard carries this type.
    pub field: Option<Box<str>>,
}

impl ApiError {
    pub fn local(code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: code.to_owned(),
            message: message.into(),
            current_version: None,
            cursor: None,
            allowed: Vec::new(),
            field: None,
        }
    }

    pub fn from_graphql(error: graphql_client::Error) -> ApiError {
        let ext = error.extensions.unwrap_or_default();
        let code = ext
            .get("code")
            .and_then(|c| c.as_str())
            .unwrap_or("INTERNAL")
            .to_owned();
        ApiError {
            code,
            message: error.message,
            current_version: ext
                .get("currentVersion")
                .and_then(serde_json::Value::as_i64),
            cursor: ext.get("cursor").and_then(|c| c.as_str()).map(Box::from),
            allowed: ext
                .get("allowed")
                .and_then(|a| a.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|m| m.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            field: ext.get("field").and_then(|f| f.as_str()).map(Box::from),
        }
    }

    pub fn is_conflict(&self) -> bool {
        self.code == "CONFLICT"
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

/// A GraphQL answer as a `Result`: the first error if there is one, otherwise the data.
pub fn into_result<D>(response: Response<D>) -> Result<D, ApiError> {
    if let Some(error) = response.errors.and_then(|e| e.into_iter().next()) {
        return Err(ApiError::from_graphql(error));
    }
    response
        .data
        .ok_or_else(|| ApiError::local("BAD_RESPONSE", "the answer had neither data nor errors"))
}

/// One operation as it goes on the wire. graphql_client's query text is the whole of
/// `operations.graphql`, and async-graphql validates every definition of a document against
/// the operation it runs (another operation's variables are "not defined", fragments it does
/// not use are "never used"), so each request carries only its operation and its fragments.
#[derive(Serialize)]
pub struct WireRequest<V> {
    query: String,
    #[serde(rename = "operationName")]
    operation_name: &'static str,
    variables: V,
}

pub fn wire_request<Q: GraphQLQuery>(variables: Q::Variables) -> WireRequest<Q::Variables> {
    let body = Q::build_query(variables);
    WireRequest {
        query: operation_document(body.query, body.operation_name),
        operation_name: body.operation_name,
        variables: body.variables,
    }
}

/// The definitions of `document` that operation `name` needs: itself and the fragments it
/// spreads, directly or through other fragments, in document order.
pub fn operation_document(document: &str, name: &str) -> String {
    let definitions = top_level_definitions(document);
    let mut wanted: Vec<String> = Vec::new();
    let mut queue: Vec<&str> = definitions
        .iter()
        .filter(|d| !d.starts_with("fragment") && definition_name(d) == Some(name))
        .copied()
        .collect();
    let mut keep: Vec<&str> = queue.clone();
    while let Some(definition) = queue.pop() {
        for spread in fragment_spreads(definition) {
            if wanted.iter().any(|w| w == spread) {
                continue;
            }
            wanted.push(spread.to_owned());
            if let Some(fragment) = definitions
                .iter()
                .find(|d| d.starts_with("fragment") && definition_name(d) == Some(spread))
            {
                keep.push(fragment);
                queue.push(fragment);
            }
        }
    }
    definitions
        .iter()
        .filter(|d| keep.contains(d))
        .copied()
        .collect::<Vec<_>>()
        .join("\n")
}

/// Splits a document into its top-level definitions (comments dropped, strings respected).
fn top_level_definitions(document: &str) -> Vec<&str> {
    let bytes = document.as_bytes();
    let mut out = Vec::new();
    let (mut depth, mut start, mut i) = (0usize, None::<usize>, 0usize);
    while i < bytes.len() {
        match bytes[i] {
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
            }
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0
                    && let Some(s) = start.take()
                {
                    out.push(document[s..=i].trim());
                }
            }
            c if depth == 0 && start.is_none() && !c.is_ascii_whitespace() => start = Some(i),
            _ => {}
        }
        i += 1;
    }
    out
}

fn definition_name(definition: &str) -> Option<&str> {
    let mut words = definition.split(|c: char| !(c.is_alphanumeric() || c == '_'));
    words.next()?;
    words.find(|w| !w.is_empty())
}

fn fragment_spreads(definition: &str) -> impl Iterator<Item = &str> {
    definition.split("...").skip(1).filter_map(|rest| {
        let name = rest
            .trim_start()
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .next()?;
        // `... on Type` is an inline fragment, not a spread.
        (!name.is_empty() && name != "on").then_some(name)
    })
}

/// Runs one query or mutation as the signed-in operator.
pub async fn run<Q: GraphQLQuery>(variables: Q::Variables) -> Result<Q::ResponseData, ApiError>
where
    Q::Variables: Serialize,
{
    let token =
        session::token().ok_or_else(|| ApiError::local("UNAUTHENTICATED", "not signed in"))?;
    run_with_token::<Q>(&token, variables).await
}

/// Runs one operation with an explicit token (sign-in checks a token before storing it).
pub async fn run_with_token<Q: GraphQLQuery>(
    token: &str,
    variables: Q::Variables,
) -> Result<Q::ResponseData, ApiError>
where
    Q::Variables: Serialize,
{
    let body = wire_request::<Q>(variables);
    let request = gloo_net::http::Request::post(GRAPHQL_PATH)
        .header("Authorization", &format!("Bearer {token}"))
        .json(&body)
        .map_err(|e| ApiError::local("BAD_REQUEST", e.to_string()))?;
    let response = request
        .send()
        .await
        .map_err(|e| ApiError::local("NETWORK", format!("the server did not answer: {e}")))?;
    let status = response.status();
    // Every answer, a 401 included, carries the GraphQL error shape; anything else (a proxy's
    // error page) is reported with its status.
    let parsed: Response<Q::ResponseData> = response.json().await.map_err(|e| {
        ApiError::local(
            "BAD_RESPONSE",
            format!("HTTP {status}: not a GraphQL answer ({e})"),
        )
    })?;
    into_result(parsed)
}

/// The wire value of a generated enum (`CONNECTED`), for display and comparison.
pub fn wire<T: Serialize>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_their_code_and_details() {
        let error: graphql_client::Error = serde_json::from_value(serde_json::json!({
            "message": "node_1 changed",
            "extensions": { "code": "CONFLICT", "currentVersion": 9 }
        }))
        .expect("an error");
        let api = ApiError::from_graphql(error);
        assert!(api.is_conflict());
        assert_eq!(api.current_version, Some(9));

        let response: Response<serde_json::Value> = serde_json::from_value(serde_json::json!({
            "data": null,
            "errors": [{ "message": "m", "extensions": {
                "code": "INVALID_STATE", "allowed": ["retire", "fail"] } }]
        }))
        .expect("a response");
        let err = into_result(response).expect_err("an error");
        assert_eq!(err.code, "INVALID_STATE");
        assert_eq!(err.allowed, ["retire", "fail"]);

        let error: graphql_client::Error = serde_json::from_value(serde_json::json!({
            "message": "`input.bmc.address` is plain http",
            "extensions": { "code": "BAD_USER_INPUT", "field": "input.bmc.address" }
        }))
        .expect("an error");
        assert_eq!(
            ApiError::from_graphql(error).field.as_deref(),
            Some("input.bmc.address")
        );

        let empty: Response<serde_json::Value> =
            serde_json::from_value(serde_json::json!({})).expect("a response");
        assert_eq!(
            into_result(empty).expect_err("no data").code,
            "BAD_RESPONSE"
        );
    }

    #[test]
    fn each_request_carries_only_its_operation_and_fragments() {
        let document = r#"
            # a comment { with braces
            fragment A on T { x ...B }
            fragment B on T { y(s: "}") }
            fragment C on T { z }
            query One($v: Int) { t(v: $v) { ...A ... on T { w } } }
            query Two { t { ...C } }
        "#;
        assert_eq!(
            operation_document(document, "One"),
            "fragment A on T { x ...B }\nfragment B on T { y(s: \"}\") }\nquery One($v: Int) { t(v: $v) { ...A ... on T { w } } }"
        );
        assert_eq!(
            operation_document(document, "Two"),
            "fragment C on T { z }\nquery Two { t { ...C } }"
        );
        // The real document: every generated operation finds itself.
        let body = FleetChanges::build_query(fleet_changes::Variables { after: None });
        let doc = operation_document(body.query, body.operation_name);
        assert!(doc.starts_with("fragment FleetRow on NodeDetail"), "{doc}");
        assert!(doc.contains("subscription FleetChanges"));
        assert!(!doc.contains("CommandFields"));
    }

    #[test]
    fn generated_enums_have_their_wire_names() {
        assert_eq!(
            wire(&fleet_changes::Connectivity::UNREACHABLE),
            "UNREACHABLE"
        );
    }
}
