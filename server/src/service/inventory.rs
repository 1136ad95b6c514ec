//! Inventory: a daemon's reported sections, and the Inventory controller that turns them
//! into devices, labels, the GPU count, health and mismatch conditions and the hardware key,
//! on every report and again when a pool's expectations change.

use bc_core::Actor;
use bc_core::catalog::HardwareProfile;
use bc_core::hardware::{HardwareKey, hardware_key};
use bc_core::health::{Device, InventoryFacts};
use bc_core::ids::{NodeId, PoolId};
use chrono::{DateTime, Utc};
use std::collections::{BTreeMap, HashMap};

use super::Services;
use super::node_changes::NodeChangeRequest;
use super::store::inventory::SectionRow;
use super::store::node_filter::NodeFilter;
use super::store::nodes::ChildSets;
use super::store::{WriteTxn, catalog, inventory, nodes};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

/// One inventory section as a daemon reported it (its hash already checked), its content as
/// JSON text. Reports wait in sessions and in the gateway's batches until the writer takes
/// them, thousands at once while a fleet comes up, and a parsed `serde_json::Value` is many
/// times the size of its text: held parsed, they were the largest part of the server's
/// peak heap (BENCHMARKS.md, session 35). Each batch parses its own as it stores them.
#[derive(Debug, Clone)]
pub struct ReportedSection {
    pub section: String,
    pub hash: String,
    pub content: String,
}

/// A [`ReportedSection`] parsed, for the Inventory controller.
struct ParsedSection {
    section: String,
    hash: String,
    content: serde_json::Value,
}

impl ParsedSection {
    /// The gateway wrote the text from a parsed value, so a failure here is the server's own
    /// fault, not the daemon's.
    fn parse(reported: &ReportedSection) -> ApiResult<ParsedSection> {
        let content = serde_json::from_str(&reported.content).map_err(|err| {
            ApiError::Internal(anyhow::anyhow!(
                "inventory section `{}` held as text is not JSON: {err}",
                reported.section
            ))
        })?;
        Ok(ParsedSection {
            section: reported.section.clone(),
            hash: reported.hash.clone(),
            content,
        })
    }
}

impl Services {
    /// Stores inventory reports, each the sections one daemon sent together (the sections
    /// `welcome` asked for, or those of one `inventory.refresh`), and, in the same
    /// transaction, runs the Inventory controller over each reporting node
    /// ([`Services::inventory_controller_in`]). One transaction for many reports, not one per
    /// report or section, and statements per batch, not per node: at 10,000 nodes coming up,
    /// the reports were the bulk of the writer's work. Each report is answered in the order
    /// given; a malformed one is refused whole and stores nothing.
    pub async fn store_inventory_reports(
        &self,
        reports: &[(NodeId, Vec<ReportedSection>)],
    ) -> ApiResult<Vec<ApiResult<()>>> {
        if reports.iter().all(|(_, report)| report.is_empty()) {
            return Ok(reports.iter().map(|_| Ok(())).collect());
        }
        // Parsed before the writer is taken, one batch at a time.
        let runs: Vec<InventoryRun> = reports
            .iter()
            .map(|(node_id, report)| {
                let names: Vec<&str> = report.iter().map(|r| r.section.as_str()).collect();
                Ok(InventoryRun {
                    cause: format!("inventory:{}", names.join(",")),
                    gpus_reported: report.iter().any(|r| r.section == "gpus"),
                    node_id: node_id.clone(),
                    report: report
                        .iter()
                        .map(ParsedSection::parse)
                        .collect::<ApiResult<_>>()?,
                })
            })
            .collect::<ApiResult<_>>()?;
        let txn = self.store.write().await?;
        let now = self.clock.now();
        // The node rows before their inventory rows (ARCHITECTURE.md, Invariants: lock
        // order), since the controller changes the nodes below.
        let ids: Vec<NodeId> = reports.iter().map(|(id, _)| id.clone()).collect();
        txn.lock_nodes(&ids).await?;
        let outcomes = self.inventory_controller_in(&txn, runs, now).await?;
        txn.commit().await?;
        Ok(outcomes.into_iter().map(|o| o.map(|_| ())).collect())
    }

    /// Runs the Inventory controller again over every live node of a pool, a hundred nodes
    /// per transaction, against the pool's hardware profile as it is now: what `updatePool`
    /// does when the expectations change, so that the mismatch conditions follow at once
    /// rather than at each node's next report. Returns how many nodes changed.
    pub(crate) async fn reevaluate_pool_inventory(&self, pool_id: &PoolId) -> ApiResult<usize> {
        /// Nodes read per page while walking the pool.
        const PAGE: u64 = 500;
        /// Nodes re-evaluated in one transaction: each is a node write with its events, and
        /// a hundred keep SQLite's writer for tens of milliseconds, not seconds.
        const REEVALUATED_PER_TRANSACTION: usize = 100;
        let filter = NodeFilter {
            pool_ids: vec![pool_id.clone()],
            ..NodeFilter::default()
        };
        let mut after: Option<String> = None;
        let mut changed = 0;
        loop {
            let page = {
                let read = self.store.read().await?;
                nodes::list(&read, &filter, after.as_deref(), PAGE, ChildSets::ALL).await?
            };
            let Some(last) = page.last() else {
                break;
            };
            after = Some(last.id.to_string());
            let ids: Vec<NodeId> = page.iter().map(|node| node.id.clone()).collect();
            for ids in ids.chunks(REEVALUATED_PER_TRANSACTION) {
                let txn = self.store.write().await?;
                txn.lock_nodes(ids).await?;
                let runs = ids
                    .iter()
                    .map(|node_id| InventoryRun {
                        node_id: node_id.clone(),
                        report: Vec::new(),
                        cause: format!("pool:{pool_id}"),
                        gpus_reported: false,
                    })
                    .collect();
                let now = self.clock.now();
                for outcome in self.inventory_controller_in(&txn, runs, now).await? {
                    match outcome {
                        Ok(true) => changed += 1,
                        // Deleted since the page was read: nothing left to re-evaluate.
                        Ok(false) | Err(ApiError::NotFound(_)) => {}
                        Err(err) => return Err(err),
                    }
                }
                txn.commit().await?;
            }
            if (page.len() as u64) < PAGE {
                break;
            }
        }
        Ok(changed)
    }

    /// The Inventory controller for several nodes, each at most once, inside the caller's
    /// transaction (the node rows already locked): stores each run's new sections, reads
    /// every stored section and the pools' hardware profiles, and applies what they say
    /// ([`bc_core::health::interpret`]): devices and atoms, inventory labels, the GPU count,
    /// the health and mismatch conditions with their `noScheduleReasons`, and the hardware
    /// key. The devices are rewritten only when `gpus_reported` (a fresh `gpus` section):
    /// other sections and a re-evaluation leave them, and the placer's index of free atoms,
    /// alone. Answers, in the order given, whether each node changed; a run refused (a
    /// malformed section, a node that does not exist) writes nothing, its sections included.
    async fn inventory_controller_in(
        &self,
        txn: &WriteTxn,
        runs: Vec<InventoryRun>,
        now: DateTime<Utc>,
    ) -> ApiResult<Vec<ApiResult<bool>>> {
        let controller = Actor::Controller("inventory".into());
        let ids: Vec<NodeId> = runs.iter().map(|run| run.node_id.clone()).collect();
        let mut stored = inventory::sections_of(&**txn, &ids).await?;
        let pool_of = nodes::pool_of_each(&**txn, &ids).await?;
        let mut profiles: HashMap<PoolId, HardwareProfile> = HashMap::new();
        for pool_id in pool_of.values().flatten() {
            if !profiles.contains_key(pool_id) {
                let profile = catalog::pool(&**txn, pool_id)
                    .await?
                    .map(|p| p.hardware_profile)
                    .unwrap_or_default();
                profiles.insert(pool_id.clone(), profile);
            }
        }
        // Each run decided in memory, on its node's stored sections with the new ones over
        // them, before anything is written.
        let mut decided: Vec<ApiResult<InventoryDecision>> = Vec::with_capacity(runs.len());
        for run in runs {
            let Some(pool_id) = pool_of.get(&run.node_id) else {
                decided.push(Err(ApiError::NotFound(format!(
                    "node `{}` does not exist",
                    run.node_id
                ))));
                continue;
            };
            let mut sections = stored.remove(&run.node_id).unwrap_or_default();
            for reported in &run.report {
                sections.insert(reported.section.clone(), reported.content.clone());
            }
            let profile = pool_id
                .as_ref()
                .and_then(|pool| profiles.get(pool))
                .cloned()
                .unwrap_or_default();
            let facts = match bc_core::health::interpret(&sections, &profile) {
                Ok(facts) => facts,
                Err(err) => {
                    decided.push(Err(ApiError::BadUserInput(err.to_string())));
                    continue;
                }
            };
            // The key is recomputed only from a complete set of identifiers (both sections
            // reported): sections arrive one by one, and a key from half of them would differ
            // from the join's, or be untrusted, until the other half arrives.
            let complete = sections.contains_key("system") && sections.contains_key("network");
            let identifiers = if complete {
                bc_core::health::identifiers(sections.get("system"), sections.get("network"))
            } else {
                BTreeMap::new()
            };
            let new_sections = run
                .report
                .into_iter()
                .map(|r| SectionRow {
                    node_id: run.node_id.clone(),
                    section: r.section,
                    hash: r.hash,
                    content: r.content,
                })
                .collect();
            decided.push(Ok(InventoryDecision {
                new_sections,
                node_id: run.node_id,
                cause: run.cause,
                gpus_reported: run.gpus_reported,
                facts,
                key: hardware_key(&identifiers),
            }));
        }
        // A trusted key must be unique across live nodes: one already held by another node
        // is kept, but untrusted, rather than letting two nodes claim one machine.
        let trusted_keys: Vec<String> = decided
            .iter()
            .flatten()
            .filter(|d| d.key.trusted)
            .filter_map(|d| d.key.key.clone())
            .collect();
        // Two nodes of one batch may claim the same new key (two machines presenting the
        // same identifiers): the first claims it, as if the reports had come one by one, and
        // the second keeps it untrusted.
        let mut holders = nodes::trusted_hardware_key_holders(&**txn, &trusted_keys).await?;
        let everyone = |_: &bc_core::node::NodeRecord| true;
        let requests: Vec<_> = decided
            .iter()
            .flatten()
            .map(|d| {
                let held_elsewhere = match (&d.key.key, d.key.trusted) {
                    (Some(key), true) => {
                        let holder = holders.entry(key.clone()).or_insert(d.node_id.clone());
                        holder != &d.node_id
                    }
                    _ => false,
                };
                let trusted = d.key.trusted && !held_elsewhere;
                let (facts, key) = (&d.facts, d.key.key.clone());
                NodeChangeRequest {
                    id: d.node_id.clone(),
                    actor: controller.clone(),
                    expected_version: None,
                    cause: d.cause.clone(),
                    change: move |n: &mut bc_core::node::NodeRecord, by: &Actor, now| {
                        let mut changes = n.apply_inventory(facts, by, now)?;
                        if key.is_some() {
                            changes.extend(n.set_hardware_key(key, trusted));
                        }
                        Ok(changes)
                    },
                }
            })
            .collect();
        let mut changed = self
            .change_nodes_in(txn, &everyone, requests)
            .await?
            .into_iter();
        // The node changes answer the decided runs in order; the refused runs keep their
        // errors. Only a run whose node change went through stores its sections and devices,
        // so a refused report leaves nothing behind.
        let mut outcomes = Vec::with_capacity(decided.len());
        let mut new_sections = Vec::new();
        let mut devices: Vec<(NodeId, Vec<Device>)> = Vec::new();
        for decision in decided {
            let decision = match decision {
                Ok(decision) => decision,
                Err(err) => {
                    outcomes.push(Err(err));
                    continue;
                }
            };
            let Some((_, outcome)) = changed.next() else {
                return Err(ApiError::Internal(anyhow::anyhow!(
                    "a node change of the inventory went unanswered"
                )));
            };
            match outcome {
                Ok((_, changes)) => {
                    new_sections.extend(decision.new_sections);
                    if decision.gpus_reported
                        && let Some(list) = decision.facts.devices
                    {
                        devices.push((decision.node_id, list));
                    }
                    outcomes.push(Ok(!changes.is_empty()));
                }
                Err(err) => outcomes.push(Err(err)),
            }
        }
        inventory::put_sections(&**txn, new_sections, now).await?;
        inventory::replace_devices(&**txn, &devices, now).await?;
        Ok(outcomes)
    }
}

/// One node's turn of the Inventory controller: the sections it reported now (none for a
/// re-evaluation), why (the events' cause), and whether a fresh `gpus` section came.
struct InventoryRun {
    node_id: NodeId,
    report: Vec<ParsedSection>,
    cause: String,
    gpus_reported: bool,
}

/// What the Inventory controller decided for one node before writing anything.
struct InventoryDecision {
    node_id: NodeId,
    cause: String,
    gpus_reported: bool,
    new_sections: Vec<SectionRow>,
    facts: InventoryFacts,
    key: HardwareKey,
}

impl Services {
    /// A node's devices (GPUs) in name order, each with its atom, if the principal may see
    /// the node.
    pub async fn node_devices(
        &self,
        principal: &Principal,
        node: &bc_core::view::NodeDetail,
    ) -> ApiResult<Vec<Device>> {
        let node = &node.record;
        if !principal.can_see(node.owner_tenant_id.as_ref()) {
            return Err(ApiError::NotFound(format!(
                "node `{}` does not exist",
                node.id
            )));
        }
        Ok(inventory::devices(self.store.db(), &node.id).await?)
    }
}
