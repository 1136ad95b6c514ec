//! Runs the migrator up, down and up again on SQLite and PostgreSQL, then
//! writes and reads one row per table through `bc-entity`, so the entities
//! and the DDL are checked to agree on both backends.
//!
//! The PostgreSQL test needs a server; it connects to
//! `postgres://postgres@127.0.0.1:5432/postgres` (override with
//! `BC_TEST_PG_ADMIN_URL`), creates a throwaway database and drops it after.

use std::time::{SystemTime, UNIX_EPOCH};

use bc_entity::{
    event, node, node_condition, node_label, node_no_schedule_reason, node_session, node_taint,
    pool, site, tenant,
};
use bc_migration::{Migrator, MigratorTrait};
use chrono::{DateTime, Utc};
use sea_orm::{
    ActiveModelTrait, ConnectionTrait, Database, DatabaseConnection, DbBackend, EntityLoaderTrait,
    EntityTrait, IntoActiveModel, ModelTrait, NotSet, PaginatorTrait, QueryFilter, RelationTrait,
    Set, Statement,
};
use serde_json::json;

const TABLES: [&str; 19] = [
    "tenants",
    "sites",
    "pools",
    "nodes",
    "node_labels",
    "node_taints",
    "node_conditions",
    "node_no_schedule_reasons",
    "node_sessions",
    "events",
    "reservations",
    "allocations",
    "atom_bookings",
    "pool_offers",
    "remediation_attempts",
    "node_bmcs",
    "bare_metal_workflows",
    "controller_leases",
    "liveness_brakes",
];

/// A name no other run uses: pid and wall-clock nanos.
fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos();
    format!("{}_{nanos}", std::process::id())
}

/// Microsecond precision: what PostgreSQL `timestamptz` keeps.
fn ts(micros: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(1_796_000_000_000_000 + micros).expect("valid timestamp")
}

async fn table_exists(db: &DatabaseConnection, table: &str) -> bool {
    let sql = match db.get_database_backend() {
        DbBackend::Sqlite => {
            format!("SELECT 1 AS x FROM sqlite_master WHERE type = 'table' AND name = '{table}'")
        }
        _ => format!(
            "SELECT 1 AS x FROM information_schema.tables \
             WHERE table_schema = current_schema() AND table_name = '{table}'"
        ),
    };
    db.query_one_raw(Statement::from_string(db.get_database_backend(), sql))
        .await
        .expect("query catalog")
        .is_some()
}

async fn assert_schema(db: &DatabaseConnection, present: bool) {
    for table in TABLES {
        assert_eq!(
            table_exists(db, table).await,
            present,
            "table {table} present should be {present}"
        );
    }
}

fn sample_node(id: &str, hardware_key: Option<&str>, trusted: bool) -> node::Model {
    node::Model {
        id: id.to_owned(),
        hostname: format!("{id}.example"),
        site_id: "site_1".to_owned(),
        pool_id: Some("pool_1".to_owned()),
        owner_tenant_id: Some("tenant_1".to_owned()),
        role: "worker".to_owned(),
        trust: "trusted".to_owned(),
        adapter: "bcd".to_owned(),
        drivers: json!({"nvidia": "560.35"}),
        hardware_key: hardware_key.map(str::to_owned),
        hardware_key_trusted: trusted,
        generation: 3,
        observed_generation: 2,
        identity_generation: 1,
        version: 7,
        provision_state: "ready".to_owned(),
        failed_from: None,
        maintenance: false,
        maintenance_reason: None,
        cordoned: true,
        cordon_reason: Some("disk".to_owned()),
        cordoned_by: Some("ops".to_owned()),
        cordoned_at: Some(ts(10)),
        drain_started_at: Some(ts(11)),
        drain_deadline: None,
        power: "on".to_owned(),
        connectivity: "connected".to_owned(),
        connectivity_since: ts(12),
        no_schedule_reasons: "[]".to_owned(),
        gpu_count: 8,
        created_at: ts(13),
        updated_at: ts(14_500_001),
        deleted_at: None,
    }
}

/// Insert one row per table through the entities and read it back.
async fn exercise_entities(db: &DatabaseConnection) {
    let tenant = tenant::Model {
        id: "tenant_1".to_owned(),
        name: "acme".to_owned(),
        created_at: ts(1),
    };
    let got = tenant
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert tenant");
    assert_eq!(got, tenant);

    let site = site::Model {
        id: "site_1".to_owned(),
        name: "fra1".to_owned(),
        kind: "custom".to_owned(),
        owner_tenant_id: Some("tenant_1".to_owned()),
        created_at: ts(2),
    };
    let got = site
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert site");
    assert_eq!(got, site);

    let pool = pool::Model {
        id: "pool_1".to_owned(),
        site_id: "site_1".to_owned(),
        name: "h100".to_owned(),
        kind: "metal-host".to_owned(),
        agent: "bcd".to_owned(),
        owner_tenant_id: None,
        hardware_profile: json!({"gpu": "H100", "count": 8, "nested": {"a": [1, 2]}}),
        drivers: json!(["nvidia"]),
        remediation: None,
        acceptance: Some(json!({"checks": [{"kind": "gpu-diagnostic", "level": 3}]})),
        created_at: ts(3),
    };
    let got = pool
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert pool");
    assert_eq!(got, pool);
    // UNIQUE(site_id, name).
    let dup = pool::Model {
        id: "pool_2".to_owned(),
        ..pool.clone()
    };
    assert!(
        dup.into_active_model().insert(db).await.is_err(),
        "duplicate (site_id, name) must be rejected"
    );
    let found = pool::Entity::find_by_site_name(("site_1".to_owned(), "h100".to_owned()))
        .one(db)
        .await
        .expect("find pool by unique key");
    assert_eq!(found.as_ref(), Some(&pool));

    let node = sample_node("node_1", Some("hwk_1"), true);
    let got = node
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert node");
    assert_eq!(got, node);
    let read = node::Entity::find_by_id("node_1")
        .one(db)
        .await
        .expect("select node")
        .expect("node exists");
    assert_eq!(read, node);

    // Partial unique index on trusted, live hardware keys.
    let second_trusted = sample_node("node_2", Some("hwk_1"), true);
    assert!(
        second_trusted.into_active_model().insert(db).await.is_err(),
        "a second live node with the same trusted hardware key must be rejected"
    );
    sample_node("node_3", Some("hwk_1"), false)
        .into_active_model()
        .insert(db)
        .await
        .expect("untrusted duplicate hardware key is allowed");
    let mut gone = sample_node("node_4", Some("hwk_1"), true);
    gone.deleted_at = Some(ts(99));
    gone.into_active_model()
        .insert(db)
        .await
        .expect("deleted node with the same trusted hardware key is allowed");

    // `no_schedule_reasons` is TEXT, so it compares to '[]' on every backend.
    let schedulable = node::Entity::find()
        .filter(node::COLUMN.no_schedule_reasons.eq("[]"))
        .filter(node::COLUMN.deleted_at.is_null())
        .count(db)
        .await
        .expect("count schedulable");
    assert_eq!(schedulable, 2);

    let label = node_label::Model {
        node_id: "node_1".to_owned(),
        key: "gpu".to_owned(),
        value: "h100".to_owned(),
    };
    let got = label
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert label");
    assert_eq!(got, label);

    let taint = node_taint::Model {
        node_id: "node_1".to_owned(),
        key: "dedicated".to_owned(),
        value: "acme".to_owned(),
        effect: "NoSchedule".to_owned(),
        added_by: "ops".to_owned(),
        added_at: ts(20),
    };
    let got = taint
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert taint");
    assert_eq!(got, taint);

    let condition = node_condition::Model {
        node_id: "node_1".to_owned(),
        condition_type: "GpuHealthy".to_owned(),
        status: "True".to_owned(),
        reason: "AllGood".to_owned(),
        message: "8/8 GPUs healthy".to_owned(),
        no_schedule: false,
        set_by: "bcd".to_owned(),
        last_transition_at: ts(21),
        updated_at: ts(22),
        proof: Some(json!({"since": "2026-12-03T12:00:00Z", "satisfied": []})),
    };
    let got = condition
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert condition");
    assert_eq!(got, condition);

    let reason = node_no_schedule_reason::Model {
        node_id: "node_1".to_owned(),
        reason: "cordoned".to_owned(),
        set_by: "ops".to_owned(),
        since: ts(23),
        detail: "disk".to_owned(),
    };
    let got = reason
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert no-schedule reason");
    assert_eq!(got, reason);

    let session = node_session::Model {
        node_id: "node_1".to_owned(),
        epoch: 42,
        gateway_id: "gw_1".to_owned(),
        connected_at: ts(24),
        disconnected_at: None,
        last_seen: ts(25),
    };
    let got = session
        .clone()
        .into_active_model()
        .insert(db)
        .await
        .expect("insert session");
    assert_eq!(got, session);

    // Relations resolve both ways.
    let labels = node
        .find_related(node_label::Entity)
        .all(db)
        .await
        .expect("node -> labels");
    assert_eq!(labels, vec![label.clone()]);
    let owner = site
        .find_related(tenant::Entity)
        .one(db)
        .await
        .expect("site -> tenant");
    assert_eq!(owner, Some(tenant.clone()));
    let session_of = node
        .find_related(node_session::Entity)
        .one(db)
        .await
        .expect("node -> session");
    assert_eq!(session_of, Some(session.clone()));
    let (_, pool_of) = node::Entity::find_by_id("node_1")
        .find_also_related(pool::Entity)
        .one(db)
        .await
        .expect("node + pool")
        .expect("node exists");
    assert_eq!(pool_of, Some(pool.clone()));
    // 2.0 entity loader: one query per relation, into `ModelEx`.
    let loaded = node::Entity::load()
        .filter_by_id("node_1")
        .with(site::Entity)
        .with(node_label::Entity)
        .with(node_condition::Entity)
        .with(node_session::Entity)
        .one(db)
        .await
        .expect("load node")
        .expect("node exists");
    assert_eq!(loaded.hostname, "node_1.example");
    assert_eq!(loaded.labels.len(), 1);
    assert_eq!(loaded.conditions.len(), 1);
    assert!(loaded.taints.is_empty(), "taints not requested");
    assert_eq!(
        loaded.site.as_ref().map(|s| s.name.as_str()),
        Some("fra1"),
        "site loaded"
    );
    assert_eq!(
        loaded.session.as_ref().map(|s| s.epoch),
        Some(42),
        "session loaded"
    );
    let _ = node::Relation::Site.def();
    let _ = node::Relation::NodeLabel.def();

    // events: `seq` left unset comes back from the database.
    let first = event::ActiveModel {
        seq: NotSet,
        node_id: Set(Some("node_1".to_owned())),
        tenant_id: Set(Some("tenant_1".to_owned())),
        event_type: Set("node.provision_state".to_owned()),
        axis: Set(Some("provision_state".to_owned())),
        from_value: Set(Some("provisioning".to_owned())),
        to_value: Set(Some("ready".to_owned())),
        actor: Set("system".to_owned()),
        cause: Set(None),
        data: Set(json!({"generation": 3})),
        created_at: Set(ts(30)),
        node_version: Set(Some(3)),
    }
    .insert(db)
    .await
    .expect("insert event");
    assert!(first.seq > 0, "seq assigned: {}", first.seq);
    assert_eq!(first.event_type, "node.provision_state");
    assert_eq!(first.data, json!({"generation": 3}));
    let second = event::ActiveModel {
        seq: NotSet,
        node_id: Set(None),
        tenant_id: Set(None),
        event_type: Set("tenant.created".to_owned()),
        axis: Set(None),
        from_value: Set(None),
        to_value: Set(None),
        actor: Set("admin".to_owned()),
        cause: Set(Some("api".to_owned())),
        data: Set(json!({})),
        created_at: Set(ts(31)),
        node_version: Set(None),
    }
    .insert(db)
    .await
    .expect("insert second event");
    assert!(second.seq > first.seq, "{} > {}", second.seq, first.seq);
    let read = event::Entity::find_by_id(first.seq)
        .one(db)
        .await
        .expect("select event")
        .expect("event exists");
    assert_eq!(read, first);

    // Hard-deleting a node cascades to its child rows, not to its events.
    node::Entity::delete_by_id("node_1")
        .exec(db)
        .await
        .expect("delete node");
    for (table, count) in [
        (
            "node_labels",
            node_label::Entity::find().count(db).await.expect("count"),
        ),
        (
            "node_taints",
            node_taint::Entity::find().count(db).await.expect("count"),
        ),
        (
            "node_conditions",
            node_condition::Entity::find()
                .count(db)
                .await
                .expect("count"),
        ),
        (
            "node_no_schedule_reasons",
            node_no_schedule_reason::Entity::find()
                .count(db)
                .await
                .expect("count"),
        ),
        (
            "node_sessions",
            node_session::Entity::find().count(db).await.expect("count"),
        ),
    ] {
        assert_eq!(count, 0, "{table} rows should cascade on node delete");
    }
    assert_eq!(event::Entity::find().count(db).await.expect("count"), 2);

    // Parents are protected while referenced.
    assert!(
        site.delete(db).await.is_err(),
        "deleting a referenced site must fail"
    );
}

/// up, down, up, then the entity round trip, then down again.
async fn run(db: &DatabaseConnection) {
    Migrator::up(db, None).await.expect("first up");
    assert_schema(db, true).await;
    assert!(
        Migrator::get_pending_migrations(db)
            .await
            .expect("pending")
            .is_empty()
    );

    Migrator::down(db, None).await.expect("down");
    assert_schema(db, false).await;

    Migrator::up(db, None).await.expect("second up");
    assert_schema(db, true).await;

    exercise_entities(db).await;

    Migrator::down(db, None).await.expect("down with data");
    assert_schema(db, false).await;
}

/// Removes the SQLite file (and its WAL/SHM side files) even if the test panics.
struct TempSqliteFile(std::path::PathBuf);

impl Drop for TempSqliteFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", self.0.display()));
        }
    }
}

#[tokio::test]
async fn sqlite_up_down_up() {
    let file =
        TempSqliteFile(std::env::temp_dir().join(format!("bc_mig_{}.sqlite", unique_suffix())));
    let url = format!("sqlite://{}?mode=rwc", file.0.display());
    let db = Database::connect(&url).await.expect("open sqlite");

    Migrator::up(&db, None).await.expect("up");
    // SQLite only auto-increments a rowid alias, i.e. `INTEGER PRIMARY KEY`.
    let ddl = db
        .query_one_raw(Statement::from_string(
            DbBackend::Sqlite,
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'events'",
        ))
        .await
        .expect("read events DDL")
        .expect("events table exists")
        .try_get::<String>("", "sql")
        .expect("sql column");
    assert!(
        ddl.contains(r#""seq" integer NOT NULL PRIMARY KEY AUTOINCREMENT"#),
        "events DDL: {ddl}"
    );
    Migrator::down(&db, None).await.expect("down");

    run(&db).await;

    db.close().await.expect("close sqlite");
}

#[tokio::test]
async fn postgres_up_down_up() {
    let admin_url = std::env::var("BC_TEST_PG_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let admin = Database::connect(&admin_url)
        .await
        .expect("connect to the PostgreSQL admin database");
    let name = format!("bc_mig_{}", unique_suffix());
    admin
        .execute_unprepared(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create database");

    let (base, _) = admin_url.rsplit_once('/').expect("URL has a database path");
    let db = Database::connect(format!("{base}/{name}"))
        .await
        .expect("connect to the test database");

    // Catch panics so the database is dropped either way.
    let outcome = tokio::spawn({
        let db = db.clone();
        async move { run(&db).await }
    })
    .await;
    db.close().await.expect("close test database");
    admin
        .execute_unprepared(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .expect("drop database");
    admin.close().await.expect("close admin");

    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}
