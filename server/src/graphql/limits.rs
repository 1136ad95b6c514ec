//! What a query may cost, checked before any work is done on it.
//!
//! async-graphql validates a document by walking it with every fragment spread expanded, and
//! some of its walks are not memoised: a 1 KiB query whose fragments each spread the next one
//! twice expands to 2^26 fields and kept a worker busy for half a minute before its
//! complexity was refused. [`QueryLimits`] runs in the `prepare_request` hook, before parsing
//! and validation: it refuses a query over [`GraphqlConfig::max_query_bytes`], parses it,
//! and measures the document with each fragment's expansion computed once (so the check is
//! linear in the query's size, whatever the expansion), against the aliases, fragment spreads,
//! fields and depth it may have. Only a document that passes reaches validation, whose work
//! is then bounded by the same numbers. It applies to HTTP and WebSocket requests alike.
//!
//! Introspection has limits of its own. Standard tools (GraphiQL, codegen) send graphql-js's
//! introspection query, which nests 15 fields deep, deeper than any query of the API needs;
//! and the introspection types can nest lists without end (`types { fields { type { fields
//! … } } }`), each multiplying the answer, at a shallow depth. So fields under `__schema` and
//! `__type` are held to [`GraphqlConfig::introspection_max_depth`] instead of `max_depth`,
//! and to [`GraphqlConfig::introspection_max_cost`]: an upper bound on the values the answer
//! can hold, each list counting as the longest such list in this schema.

use async_graphql::extensions::{
    Extension, ExtensionContext, ExtensionFactory, NextPrepareRequest,
};
use async_graphql::parser::types::{
    Directive, ExecutableDocument, FragmentDefinition, Selection, SelectionSet,
};
use async_graphql::registry::{MetaType, Registry};
use async_graphql::{Name, Positioned, Request, ServerError, ServerResult};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use crate::config::GraphqlConfig;
use crate::error::ApiError;

/// The extension that enforces the limits of [`GraphqlConfig`] on every request.
pub struct QueryLimits {
    inner: Arc<LimitsExtension>,
}

impl QueryLimits {
    pub fn new(config: &GraphqlConfig) -> QueryLimits {
        QueryLimits {
            inner: Arc::new(LimitsExtension {
                config: config.clone(),
                shape: OnceLock::new(),
            }),
        }
    }
}

impl ExtensionFactory for QueryLimits {
    fn create(&self) -> Arc<dyn Extension> {
        self.inner.clone()
    }
}

struct LimitsExtension {
    config: GraphqlConfig,
    /// The schema's longest introspection lists, read from its registry on first use.
    shape: OnceLock<IntrospectionShape>,
}

#[async_trait::async_trait]
impl Extension for LimitsExtension {
    async fn prepare_request(
        &self,
        ctx: &ExtensionContext<'_>,
        mut request: Request,
        next: NextPrepareRequest<'_>,
    ) -> ServerResult<Request> {
        let shape = self
            .shape
            .get_or_init(|| IntrospectionShape::of(&ctx.schema_env.registry));
        check_request(&mut request, &self.config, shape).map_err(refusal)?;
        next.run(ctx, request).await
    }
}

/// A refusal as the GraphQL error the caller sees: `BAD_USER_INPUT` with the message.
fn refusal(err: ApiError) -> ServerError {
    let err = async_graphql::Error::from(err);
    let mut server_error = ServerError::new(err.message, None);
    server_error.extensions = err.extensions;
    server_error
}

/// Checks the query's size, parses it (the parsed document stays in the request, so it is
/// not parsed again) and checks the document's measures against `config`.
pub fn check_request(
    request: &mut Request,
    config: &GraphqlConfig,
    shape: &IntrospectionShape,
) -> Result<(), ApiError> {
    let bytes = request.query.len();
    if bytes > config.max_query_bytes {
        return Err(over(
            format!("the query is {bytes} bytes"),
            "max_query_bytes",
            config.max_query_bytes,
        ));
    }
    let document = match request.parsed_query() {
        Ok(document) => document,
        // async-graphql reports it again, with its position, when it parses the query.
        Err(_) => return Ok(()),
    };
    check_document(document, config, shape)
}

/// Checks a parsed document's measures against `config`.
pub fn check_document(
    document: &ExecutableDocument,
    config: &GraphqlConfig,
    shape: &IntrospectionShape,
) -> Result<(), ApiError> {
    let m = measure(document, shape)?;
    let checks = [
        (m.aliases, "aliases", "max_aliases", config.max_aliases),
        (
            m.spreads,
            "fragment spreads",
            "max_fragment_spreads",
            config.max_fragment_spreads,
        ),
        (
            m.fields,
            "fields and directives",
            "max_fields",
            config.max_fields,
        ),
    ];
    for (value, what, key, limit) in checks {
        if value > limit as u64 {
            return Err(over(
                format!(
                    "the query has {} {what} with its fragments expanded",
                    count(value)
                ),
                key,
                limit,
            ));
        }
    }
    if m.depth > config.max_depth as u64 {
        return Err(over(
            format!("the query nests fields {} deep", count(m.depth)),
            "max_depth",
            config.max_depth,
        ));
    }
    if m.introspection_depth > config.introspection_max_depth as u64 {
        return Err(over(
            format!(
                "the query nests introspection fields {} deep",
                count(m.introspection_depth)
            ),
            "introspection_max_depth",
            config.introspection_max_depth,
        ));
    }
    if m.introspection_cost > config.introspection_max_cost as u64 {
        return Err(over(
            format!(
                "the introspection answer could hold {} values",
                count(m.introspection_cost)
            ),
            "introspection_max_cost",
            config.introspection_max_cost,
        ));
    }
    Ok(())
}

fn over(what: String, key: &str, limit: usize) -> ApiError {
    ApiError::BadUserInput(format!("{what}; the limit (graphql.{key}) is {limit}"))
}

/// A measure for a message: saturated ones are beyond counting.
fn count(value: u64) -> String {
    if value == u64::MAX {
        "too many".to_owned()
    } else {
        value.to_string()
    }
}

/// The longest list each introspection field can return in this schema: the factor by which
/// it multiplies what is selected under it.
#[derive(Debug, Clone, Default)]
pub struct IntrospectionShape {
    types: u64,
    fields: u64,
    input_fields: u64,
    args: u64,
    enum_values: u64,
    interfaces: u64,
    possible_types: u64,
    directives: u64,
    locations: u64,
}

impl IntrospectionShape {
    /// Read from the schema's registry: every type, directive and their members.
    pub fn of(registry: &Registry) -> IntrospectionShape {
        let mut shape = IntrospectionShape {
            types: registry.types.len() as u64,
            directives: registry.directives.len() as u64,
            ..IntrospectionShape::default()
        };
        let len = |n: usize| n as u64;
        for ty in registry.types.values() {
            match ty {
                MetaType::Object { fields, .. } | MetaType::Interface { fields, .. } => {
                    shape.fields = shape.fields.max(len(fields.len()));
                    for field in fields.values() {
                        shape.args = shape.args.max(len(field.args.len()));
                    }
                    if let MetaType::Interface { possible_types, .. } = ty {
                        shape.possible_types = shape.possible_types.max(len(possible_types.len()));
                    }
                }
                MetaType::Union { possible_types, .. } => {
                    shape.possible_types = shape.possible_types.max(len(possible_types.len()));
                }
                MetaType::Enum { enum_values, .. } => {
                    shape.enum_values = shape.enum_values.max(len(enum_values.len()));
                }
                MetaType::InputObject { input_fields, .. } => {
                    shape.input_fields = shape.input_fields.max(len(input_fields.len()));
                }
                MetaType::Scalar { .. } => {}
            }
        }
        for implemented in registry.implements.values() {
            shape.interfaces = shape.interfaces.max(len(implemented.len()));
        }
        for directive in registry.directives.values() {
            shape.args = shape.args.max(len(directive.args.len()));
            shape.locations = shape.locations.max(len(directive.locations.len()));
        }
        shape
    }

    /// How many values introspection field `name` can return (1 for a field that is no list).
    fn factor(&self, name: &str) -> u64 {
        let factor = match name {
            "types" => self.types,
            "fields" => self.fields,
            "inputFields" => self.input_fields,
            "args" => self.args,
            "enumValues" => self.enum_values,
            "interfaces" => self.interfaces,
            "possibleTypes" => self.possible_types,
            "directives" => self.directives,
            "locations" => self.locations,
            _ => 1,
        };
        factor.max(1)
    }
}

/// What a document asks for, with every fragment spread expanded; sums and products
/// saturate, so a measure of `u64::MAX` means "more than can be counted".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Measures {
    /// Fields with an alias.
    pub aliases: u64,
    /// Fragment spreads.
    pub spreads: u64,
    /// Fields and directives.
    pub fields: u64,
    /// The longest chain of nested fields outside introspection.
    pub depth: u64,
    /// The longest chain of nested fields under `__schema` or `__type` (those included).
    pub introspection_depth: u64,
    /// An upper bound on the values an answer to the introspection fields can hold.
    pub introspection_cost: u64,
}

impl Measures {
    /// Two selections side by side.
    fn beside(self, other: Measures) -> Measures {
        Measures {
            aliases: self.aliases.saturating_add(other.aliases),
            spreads: self.spreads.saturating_add(other.spreads),
            fields: self.fields.saturating_add(other.fields),
            depth: self.depth.max(other.depth),
            introspection_depth: self.introspection_depth.max(other.introspection_depth),
            introspection_cost: self
                .introspection_cost
                .saturating_add(other.introspection_cost),
        }
    }
}

/// Measures every operation of `document` (async-graphql validates all of them). A fragment
/// that spreads itself is refused here: following it would never end.
pub fn measure(
    document: &ExecutableDocument,
    shape: &IntrospectionShape,
) -> Result<Measures, ApiError> {
    let mut walk = Walk {
        fragments: &document.fragments,
        shape,
        memo: HashMap::new(),
    };
    let mut total = Measures::default();
    for (_, operation) in document.operations.iter() {
        let directives = directives(&operation.node.directives);
        let selection = walk.selection_set(&operation.node.selection_set.node, false)?;
        total = total.beside(selection).beside(directives);
    }
    Ok(total)
}

/// The fields under `__schema` and `__type` are introspection; `__typename` is an ordinary
/// field of every type.
fn is_introspection_root(name: &str) -> bool {
    matches!(name, "__schema" | "__type")
}

fn directives(directives: &[Positioned<Directive>]) -> Measures {
    Measures {
        fields: directives.len() as u64,
        ..Measures::default()
    }
}

struct Walk<'a> {
    fragments: &'a HashMap<Name, Positioned<FragmentDefinition>>,
    shape: &'a IntrospectionShape,
    /// Each fragment's expansion, measured once per context (inside introspection or not):
    /// `None` while it is being measured, to catch a fragment that spreads itself.
    memo: HashMap<(&'a str, bool), Option<Measures>>,
}

impl<'a> Walk<'a> {
    fn selection_set(
        &mut self,
        set: &'a SelectionSet,
        introspection: bool,
    ) -> Result<Measures, ApiError> {
        let mut total = Measures::default();
        for item in &set.items {
            let measures = match &item.node {
                Selection::Field(field) => {
                    let field = &field.node;
                    let name = field.name.node.as_str();
                    let inside = introspection || is_introspection_root(name);
                    let children = self.selection_set(&field.selection_set.node, inside)?;
                    let own = Measures {
                        aliases: u64::from(field.alias.is_some()),
                        fields: 1,
                        ..Measures::default()
                    }
                    .beside(directives(&field.directives));
                    let mut measures = own.beside(Measures {
                        depth: 0,
                        introspection_depth: 0,
                        ..children
                    });
                    if inside {
                        measures.introspection_depth = children
                            .introspection_depth
                            .max(children.depth)
                            .saturating_add(1);
                        measures.introspection_cost = self
                            .shape
                            .factor(if introspection { name } else { "" })
                            .saturating_mul(children.introspection_cost.saturating_add(1));
                    } else {
                        measures.depth = children.depth.saturating_add(1);
                        measures.introspection_depth = children.introspection_depth;
                    }
                    measures
                }
                Selection::InlineFragment(fragment) => {
                    let fragment = &fragment.node;
                    self.selection_set(&fragment.selection_set.node, introspection)?
                        .beside(directives(&fragment.directives))
                }
                Selection::FragmentSpread(spread) => {
                    let spread = &spread.node;
                    let name = spread.fragment_name.node.as_str();
                    let own = Measures {
                        spreads: 1,
                        ..Measures::default()
                    }
                    .beside(directives(&spread.directives));
                    own.beside(self.fragment(name, introspection)?)
                }
            };
            total = total.beside(measures);
        }
        Ok(total)
    }

    /// The measures of fragment `name`'s selection, computed once per context. An unknown
    /// fragment measures nothing here; validation reports it.
    fn fragment(&mut self, name: &'a str, introspection: bool) -> Result<Measures, ApiError> {
        match self.memo.get(&(name, introspection)) {
            Some(Some(measures)) => return Ok(*measures),
            Some(None) => {
                return Err(ApiError::BadUserInput(format!(
                    "fragment `{name}` spreads itself"
                )));
            }
            None => {}
        }
        let Some((key, definition)) = self.fragments.get_key_value(name) else {
            return Ok(Measures::default());
        };
        let key = key.as_str();
        self.memo.insert((key, introspection), None);
        let measures = self
            .selection_set(&definition.node.selection_set.node, introspection)?
            .beside(directives(&definition.node.directives));
        self.memo.insert((key, introspection), Some(measures));
        Ok(measures)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> IntrospectionShape {
        IntrospectionShape {
            types: 100,
            fields: 40,
            input_fields: 10,
            args: 5,
            enum_values: 20,
            interfaces: 2,
            possible_types: 3,
            directives: 6,
            locations: 19,
        }
    }

    fn measures(query: &str) -> Measures {
        let document = async_graphql::parser::parse_query(query).expect("a query");
        measure(&document, &shape()).expect("measurable")
    }

    #[test]
    fn fields_aliases_spreads_and_depth_are_counted_with_fragments_expanded() {
        let m = measures(
            "query { a: viewer { subject } ...F ...F }
             fragment F on QueryRoot { b: viewer @include(if: true) { subject role } }",
        );
        assert_eq!(
            m,
            Measures {
                aliases: 3,
                spreads: 2,
                // viewer, subject; twice (viewer, directive, subject, role)
                fields: 2 + 2 * 4,
                depth: 2,
                introspection_depth: 0,
                introspection_cost: 0,
            }
        );
    }

    #[test]
    fn an_exponential_expansion_is_measured_in_linear_time() {
        let mut query = String::from("query { ...F0 }\n");
        for level in 0..200 {
            let next = level + 1;
            query.push_str(&format!(
                "fragment F{level} on QueryRoot {{ ...F{next} ...F{next} }}\n"
            ));
        }
        query.push_str("fragment F200 on QueryRoot { viewer { subject } }\n");
        let started = std::time::Instant::now();
        let m = measures(&query);
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(m.fields, u64::MAX);
        assert_eq!(m.spreads, u64::MAX);
        assert_eq!(m.depth, 2);
    }

    #[test]
    fn a_fragment_that_spreads_itself_is_refused() {
        let document = async_graphql::parser::parse_query(
            "{ ...A } fragment A on QueryRoot { viewer { subject } ...B } fragment B on QueryRoot { ...A }",
        )
        .expect("a query");
        let err = measure(&document, &shape()).expect_err("a cycle");
        assert_eq!(err.code(), "BAD_USER_INPUT");
    }

    #[test]
    fn introspection_is_measured_on_its_own() {
        // __schema(1) types(100) { name(1) fields(40) { name(1) type(1) { name(1) } } }
        let m = measures(
            "{ viewer { subject } __schema { types { name fields { name type { name } } } } }",
        );
        assert_eq!(m.depth, 2);
        assert_eq!(m.introspection_depth, 5);
        assert_eq!(
            m.introspection_cost,
            1 + 100 * (1 + 1 + 40 * (1 + 1 + 1 + 1))
        );
        // `__typename` is an ordinary field.
        assert_eq!(measures("{ __typename }").introspection_depth, 0);
        // A fragment on an introspection type, spread inside introspection, multiplies.
        let m = measures(
            "{ __type(name: \"X\") { ...T } } fragment T on __Type { fields { args { name } } }",
        );
        assert_eq!(m.introspection_cost, 1 + 40 * (1 + 5 * 2));
        assert_eq!(m.introspection_depth, 4);
    }
}

/// The measures of real documents against this schema's shape, with the figures the
/// defaults in `config.rs` cite.
#[cfg(test)]
mod figures {
    use super::*;
    use std::sync::Mutex;

    /// Reads the schema's shape the way [`QueryLimits`] does.
    struct CaptureShape(Arc<Mutex<Option<IntrospectionShape>>>);

    impl ExtensionFactory for CaptureShape {
        fn create(&self) -> Arc<dyn Extension> {
            Arc::new(CaptureShape(self.0.clone()))
        }
    }

    #[async_trait::async_trait]
    impl Extension for CaptureShape {
        async fn prepare_request(
            &self,
            ctx: &ExtensionContext<'_>,
            request: Request,
            next: NextPrepareRequest<'_>,
        ) -> ServerResult<Request> {
            *self.0.lock().expect("unpoisoned") =
                Some(IntrospectionShape::of(&ctx.schema_env.registry));
            next.run(ctx, request).await
        }
    }

    fn shape() -> IntrospectionShape {
        let captured = Arc::new(Mutex::new(None));
        let schema = crate::graphql::schema_builder(None, &GraphqlConfig::default())
            .extension(CaptureShape(captured.clone()))
            .finish();
        let response = futures::executor::block_on(schema.execute("{ __typename }"));
        assert!(response.errors.is_empty(), "{:?}", response.errors);
        captured
            .lock()
            .expect("unpoisoned")
            .take()
            .expect("captured")
    }

    fn measure_text(query: &str, shape: &IntrospectionShape) -> Measures {
        let document = async_graphql::parser::parse_query(query).expect("a query");
        measure(&document, shape).expect("measurable")
    }

    #[test]
    fn the_standard_introspection_query_fits_the_defaults_with_room_to_grow() {
        let shape = shape();
        let query = include_str!("../../tests/fixtures/introspection-query.graphql");
        let m = measure_text(query, &shape);
        let config = GraphqlConfig::default();
        eprintln!("{shape:?}\n{} bytes: {m:?}", query.len());
        assert!(query.len() * 4 <= config.max_query_bytes);
        assert!(m.fields * 4 <= config.max_fields as u64);
        assert!(m.spreads * 4 <= config.max_fragment_spreads as u64);
        assert!(m.introspection_depth < config.introspection_max_depth as u64);
        assert!(m.introspection_cost * 2 <= config.introspection_max_cost as u64);
        assert_eq!(m.aliases, 0);
        assert_eq!(m.depth, 0);
    }

    #[test]
    fn the_dashboards_operations_fit_the_defaults_with_room_to_grow() {
        // Every operation at once: each alone (one request) measures far less. Fields have
        // room to double: the node page's fields are read twice, for the node now and as it
        // was (`nodeAsOf`, issue 15), so the document as a whole is the bigger measure.
        let operations = include_str!("../../../web/graphql/operations.graphql");
        let m = measure_text(operations, &shape());
        let config = GraphqlConfig::default();
        eprintln!("{} bytes: {m:?}", operations.len());
        assert!(m.fields * 2 <= config.max_fields as u64);
        assert!(m.spreads * 4 <= config.max_fragment_spreads as u64);
        assert!(m.aliases * 4 <= config.max_aliases as u64);
        assert!(m.depth * 2 <= config.max_depth as u64);
    }

    /// The parser keeps its own recursion limit: a query nested as deep as the byte limit
    /// allows is an error, not a stack overflow, on a worker thread's stack.
    #[test]
    fn a_query_nested_as_deep_as_the_bytes_allow_does_not_overflow_the_stack() {
        let levels = GraphqlConfig::default().max_query_bytes / 3;
        let query = format!("{}{}", "{a".repeat(levels), "}".repeat(levels));
        let parsed = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || async_graphql::parser::parse_query(query).is_ok())
            .expect("a thread")
            .join()
            .expect("no overflow");
        assert!(!parsed);
    }
}
