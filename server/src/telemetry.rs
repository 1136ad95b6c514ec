//! Logs (tracing) and metrics (Prometheus).

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextExecute, NextParseQuery,
};
use async_graphql::parser::types::{
    DocumentOperations, ExecutableDocument, OperationType, Selection,
};
use async_graphql::{Response, ServerResult, Variables};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;
use tracing_subscriber::EnvFilter;

use crate::config::{LogConfig, LogFormat};

/// Installs the global log subscriber. `RUST_LOG` overrides the configured filter.
pub fn init_logging(config: &LogConfig) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&config.filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(true)
        // Logs go to stderr so that stdout carries only what a command prints for its user
        // (`dev`'s sign-in link, `sim`'s progress), which scripts and tests read.
        .with_writer(std::io::stderr);
    // A second call (tests start several servers in one process) keeps the first subscriber.
    let _ = match config.format {
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Request latency buckets in seconds: from a cached read to a slow bulk write.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The process-wide Prometheus recorder. Installed once; every server in the process (tests
/// run several) renders from it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .unwrap_or_else(|_| PrometheusBuilder::new())
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            handle
        })
        .clone()
}

/// Records every GraphQL request's count and latency by operation. The operation label is
/// the operation type and its root fields (`mutation:cordonNode`), which the schema bounds,
/// rather than the client-chosen operation name, which it does not.
pub struct GraphqlMetrics;

impl ExtensionFactory for GraphqlMetrics {
    fn create(&self) -> Arc<dyn Extension> {
        Arc::new(GraphqlMetricsExtension {
            operation: Mutex::new(None),
        })
    }
}

struct GraphqlMetricsExtension {
    operation: Mutex<Option<String>>,
}

/// More root fields than this are summarised as `+N`, keeping label values short.
const MAX_LABELLED_ROOT_FIELDS: usize = 3;

fn operation_label(document: &ExecutableDocument, operation_name: Option<&str>) -> String {
    let operation = match (&document.operations, operation_name) {
        (DocumentOperations::Single(op), _) => Some(op),
        (DocumentOperations::Multiple(ops), Some(name)) => ops
            .iter()
            .find(|(n, _)| n.as_str() == name)
            .map(|(_, op)| op),
        (DocumentOperations::Multiple(_), None) => None,
    };
    let Some(operation) = operation else {
        return "unknown".to_owned();
    };
    let kind = match operation.node.ty {
        OperationType::Query => "query",
        OperationType::Mutation => "mutation",
        OperationType::Subscription => "subscription",
    };
    let mut fields: Vec<&str> = operation
        .node
        .selection_set
        .node
        .items
        .iter()
        .map(|item| match &item.node {
            Selection::Field(field) => field.node.name.node.as_str(),
            _ => "fragment",
        })
        .collect();
    fields.sort_unstable();
    fields.dedup();
    let extra = fields.len().saturating_sub(MAX_LABELLED_ROOT_FIELDS);
    fields.truncate(MAX_LABELLED_ROOT_FIELDS);
    let mut label = format!("{kind}:{}", fields.join(","));
    if extra > 0 {
        label.push_str(&format!(",+{extra}"));
    }
    label
}

#[async_trait::async_trait]
impl Extension for GraphqlMetricsExtension {
    async fn parse_query(
        &self,
        ctx: &ExtensionContext<'_>,
        query: &str,
        variables: &Variables,
        next: NextParseQuery<'_>,
    ) -> ServerResult<ExecutableDocument> {
        let document = next.run(ctx, query, variables).await?;
        // The operation name is not known here; `execute` refines a multi-operation document.
        let label = operation_label(&document, None);
        if let Ok(mut slot) = self.operation.lock() {
            *slot = Some(label);
        }
        Ok(document)
    }

    async fn execute(
        &self,
        ctx: &ExtensionContext<'_>,
        operation_name: Option<&str>,
        next: NextExecute<'_>,
    ) -> Response {
        let started = Instant::now();
        let response = next.run(ctx, operation_name).await;
        let operation = self
            .operation
            .lock()
            .ok()
            .and_then(|slot| slot.clone())
            .unwrap_or_else(|| "unknown".to_owned());
        let outcome = if response.errors.is_empty() {
            "ok"
        } else {
            "error"
        };
        metrics::counter!("bc_graphql_requests_total", "operation" => operation.clone(), "outcome" => outcome).increment(1);
        metrics::histogram!("bc_graphql_request_duration_seconds", "operation" => operation)
            .record(started.elapsed().as_secs_f64());
        response
    }
}
