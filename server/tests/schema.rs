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
