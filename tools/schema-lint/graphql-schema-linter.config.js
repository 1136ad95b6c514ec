// The rules schema.graphql is held to (scripts/test runs them; any violation fails the run).
// Every rule of graphql-schema-linter 3.0.1 is listed: those that fit are on, and the ones
// left off say why.
module.exports = {
  rules: [
    // Every type, field, argument, enum value and input field says what it means.
    'types-have-descriptions',
    'fields-have-descriptions',
    'arguments-have-descriptions',
    'enum-values-have-descriptions',
    'input-object-values-have-descriptions',
    'descriptions-are-capitalized',
    'deprecations-have-a-reason',
    // Naming.
    'types-are-capitalized',
    'fields-are-camel-cased',
    'input-object-values-are-camel-cased',
    'enum-values-all-caps',
    // Nothing defined that nothing uses.
    'defined-types-are-used',
    // Connections as Relay specifies them.
    'relay-connection-types-spec',
    'relay-connection-arguments-spec',
    'relay-page-info-spec',
    // Off: the four `*-sorted-alphabetically` rules (enum values, type fields, input object
    // fields, interface fields). The schema's order carries meaning that an alphabetical one
    // would destroy: `SchedulingCheck` lists the seven checks in the order they run and
    // `CapacityBucket` the buckets in that order, `ProvisionState` and `CommandStatus` follow
    // a node's and a command's life, and a type's fields read from its identity (`id`) to its
    // details. async-graphql writes the SDL, and GraphiQL shows the documentation, in
    // declaration order, which is the order written for readers.
  ],
};
