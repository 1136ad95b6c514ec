//! `schema.graphql` is the API contract: it must equal the schema the code builds.
//! After an intended change, regenerate it with
//! `cargo run --bin better-compute -- schema > schema.graphql`
//! (or run this test with `UPDATE_SCHEMA=1`).

use std::path::PathBuf;

#[test]
fn schema_graphql_matches_the_code() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../schema.graphql");
    let generated = better_compute::graphql::sdl();
    if std::env::var_os("UPDATE_SCHEMA").is_some() {
        std::fs::write(&path, &generated).expect("writing schema.graphql");
        return;
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "schema.graphql is out of date with the code; regenerate it with \
         `cargo run --bin better-compute -- schema > schema.graphql` and review the diff"
    );
}

/// The seed's `NodeDetail` is the axes except `power`, and the identity fields except
/// `adapter`, `drivers` and the hardware key itself (only `hardwareKeyTrusted`). The domain
/// view holds the whole record (`bc_core::view::NodeDetail`), so hiding those is this
/// output type's job: it must have no field for them.
#[test]
fn node_detail_hides_power_adapter_drivers_and_the_key() {
    let sdl = better_compute::graphql::sdl();
    let start = sdl
        .find("type NodeDetail {")
        .expect("the schema has a NodeDetail type");
    let body = &sdl[start..];
    let body = &body[..body.find("\n}").expect("the type ends")];
    let fields: Vec<&str> = body
        .lines()
        .skip(1)
        .map(str::trim)
        .filter_map(|line| line.split_once([':', '(']).map(|(name, _)| name))
        .filter(|name| !name.is_empty() && !name.contains(' '))
        .collect();
    for hidden in ["power", "adapter", "drivers", "hardwareKey"] {
        assert!(
            !fields.contains(&hidden),
            "`{hidden}` must not be a field of NodeDetail: {fields:?}"
        );
    }
    for shown in [
        "hardwareKeyTrusted",
        "connectivity",
        "provisionState",
        "session",
    ] {
        assert!(
            fields.contains(&shown),
            "`{shown}` is a field of NodeDetail: {fields:?}"
        );
    }
}

/// The roots carry the names every GraphQL client and tool expects (`Query`, `Mutation`,
/// `Subscription`), not the Rust structs' names.
#[test]
fn roots_are_query_mutation_and_subscription() {
    let sdl = better_compute::graphql::sdl();
    assert!(
        sdl.contains(
            "schema {\n\tquery: Query\n\tmutation: Mutation\n\tsubscription: Subscription\n}"
        ),
        "the schema's roots are Query, Mutation and Subscription"
    );
    for root in ["type Query {", "type Mutation {", "type Subscription {"] {
        assert!(sdl.contains(root), "the schema defines `{root}`");
    }
}

/// The fields of an object type in the SDL: `(name, arguments, type)`, descriptions left out.
fn fields_of(sdl: &str, type_name: &str) -> Vec<(String, String, String)> {
    let head = format!("type {type_name} {{");
    let start = sdl.find(&head).expect("the type is in the schema") + head.len();
    let body = &sdl[start..];
    let body = &body[..body.find("\n}").expect("the type ends")];
    // Descriptions out and whitespace collapsed: `name( input: XInput! ): XPayload! name2: …`.
    let bare = body
        .split("\"\"\"")
        .step_by(2)
        .collect::<Vec<_>>()
        .join(" ");
    let bare = bare.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut fields = Vec::new();
    let mut rest = bare.as_str();
    while !rest.trim().is_empty() {
        let name_end = rest.find(['(', ':']).expect("a field has a type");
        let name = rest[..name_end].trim().to_owned();
        let mut arguments = String::new();
        rest = &rest[name_end..];
        if rest.starts_with('(') {
            // Arguments hold no parentheses (no argument has a default list or object).
            let close = rest.find(')').expect("arguments end");
            arguments = rest[1..close].trim().to_owned();
            rest = &rest[close + 1..];
        }
        let rest_after = rest.trim_start().trim_start_matches(':').trim_start();
        let end = rest_after.find(' ').unwrap_or(rest_after.len());
        fields.push((name, arguments, rest_after[..end].to_owned()));
        rest = &rest_after[end..];
    }
    fields
}

/// The mutation convention (Relay's): every mutation takes exactly one argument,
/// `input: <Name>Input!`, and answers `<Name>Payload!`, an object of its own, so either can
/// grow without breaking a client.
#[test]
fn every_mutation_takes_one_input_and_answers_its_own_payload() {
    let fields = fields_of(&better_compute::graphql::sdl(), "Mutation");
    assert!(fields.len() >= 19, "every mutation is found: {fields:?}");
    let mut wrong = Vec::new();
    for (name, arguments, answer) in &fields {
        let pascal = format!("{}{}", name[..1].to_uppercase(), &name[1..]);
        let (input, payload) = (
            format!("input: {pascal}Input!"),
            format!("{pascal}Payload!"),
        );
        if *arguments != input || *answer != payload {
            wrong.push(format!(
                "{name}({arguments}): {answer}, not {name}({input}): {payload}"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A list at the top of the API grows with the fleet unless it pages: every one is a
/// connection (`first`/`after`, `edges`, `pageInfo`, `totalCount`), except those whose
/// length is fixed by the code.
#[test]
fn top_level_lists_are_connections_or_fixed() {
    // (field, why its length is fixed)
    const FIXED: [(&str, &str); 2] = [
        (
            "provisionStateTable",
            "one edge per ProvisionMove: the state table is a constant",
        ),
        (
            "livenessBrakes",
            "at most one per site, only while a site-wide outage lasts: bounded by the sites",
        ),
    ];
    let fields = fields_of(&better_compute::graphql::sdl(), "Query");
    let mut wrong = Vec::new();
    for (name, arguments, answer) in &fields {
        let list = answer.starts_with('[');
        let connection = answer.ends_with("Connection!");
        let fixed = FIXED.iter().any(|(field, _)| field == name);
        if list && !fixed {
            wrong.push(format!(
                "`{name}` answers a list ({answer}), not a connection"
            ));
        }
        if connection && !(arguments.contains("first: Int") && arguments.contains("after: String"))
        {
            wrong.push(format!(
                "`{name}` pages without `first` and `after`: ({arguments})"
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    let sdl = better_compute::graphql::sdl();
    for (name, _, answer) in fields.iter().filter(|(_, _, a)| a.ends_with("Connection!")) {
        let connection = answer.trim_end_matches('!');
        let shape: Vec<String> = fields_of(&sdl, connection)
            .into_iter()
            .map(|(field, _, _)| field)
            .collect();
        for field in ["pageInfo", "edges", "nodes", "totalCount"] {
            assert!(
                shape.iter().any(|f| f == field),
                "`{name}`'s {connection} has `{field}`: {shape:?}"
            );
        }
    }
}
