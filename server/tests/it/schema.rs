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
