//! Inventory: a daemon's reported sections, and the Inventory controller that turns them
//! into devices, labels, the GPU count, health and mismatch conditions and the hardware key,
//! on every report and again when a pool's expectations change.

use bc_core::Actor;
use bc_core::catalog::HardwareProfile;
use bc_core::hardware::hardware_key;
use bc_core::health::Device;
use bc_core::ids::{NodeId, PoolId};
use std::collections::BTreeMap;

use super::Services;
use super::store::node_filter::NodeFilter;
use super::store::{WriteTxn, catalog, inventory, nodes};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

/// One inventory section as a daemon reported it (its hash already checked).
#[derive(Debug, Clone)]
pub struct ReportedSection {
    pub section: String,
    pub hash: String,
    pub content: serde_json::Value,
}

impl Services {
    /// Stores the inventory sections a daemon sent together (the sections `welcome` asked
    /// for, or those of one `inventory.refresh`) and, in the same transaction, runs the
    /// Inventory controller once over the node's reports
    /// ([`Services::inventory_controller_in`]). One transaction for a whole report, not one
    /// per section: a first connect sends seven sections, and at 10,000 nodes coming up
    /// those transactions, each rereading every section, the node and its pool, were the
    /// bulk of the writer's work. A malformed section refuses the whole report.
    pub async fn store_inventory_sections(
        &self,
        node_id: &NodeId,
        report: Vec<ReportedSection>,
    ) -> ApiResult<()> {
        if report.is_empty() {
            return Ok(());
        }
        let txn = self.store.write().await?;
        let now = self.clock.now();
        // The node row before its inventory rows (ARCHITECTURE.md, Invariants: lock order),
        // since the controller changes the node below.
        nodes::lock(&*txn, node_id).await?;
        let gpus_reported = report.iter().any(|r| r.section == "gpus");
        let names: Vec<&str> = report.iter().map(|r| r.section.as_str()).collect();
        let cause = format!("inventory:{}", names.join(","));
        inventory::put_sections(
            &*txn,
            node_id,
            report.into_iter().map(|r| (r.section, r.hash, r.content)),
            now,
        )
        .await?;
        self.inventory_controller_in(&txn, node_id, &cause, gpus_reported)
            .await?;
        txn.commit().await?;
        Ok(())
    }

    /// Runs the Inventory controller again over every live node of a pool, each in a
    /// transaction of its own, against the pool's hardware profile as it is now: what
    /// `updatePool` does when the expectations change, so that the mismatch conditions
    /// follow at once rather than at each node's next report. Returns how many nodes
    /// changed.
    pub(crate) async fn reevaluate_pool_inventory(&self, pool_id: &PoolId) -> ApiResult<usize> {
        /// Nodes read per page while walking the pool.
        const PAGE: u64 = 500;
        let filter = NodeFilter {
            pool_ids: vec![pool_id.clone()],
            ..NodeFilter::default()
        };
        let mut after: Option<String> = None;
        let mut changed = 0;
        loop {
            let page = {
                let read = self.store.read().await?;
                nodes::list(&read, &filter, after.as_deref(), PAGE).await?
            };
            let Some(last) = page.last() else {
                break;
            };
            after = Some(last.id.to_string());
            for node in &page {
                let txn = self.store.write().await?;
                nodes::lock(&*txn, &node.id).await?;
                let cause = format!("pool:{pool_id}");
                if self
                    .inventory_controller_in(&txn, &node.id, &cause, false)
                    .await?
                {
                    changed += 1;
                }
                txn.commit().await?;
            }
            if (page.len() as u64) < PAGE {
                break;
            }
        }
        Ok(changed)
    }

    /// The Inventory controller for one node, inside the caller's transaction (the node row
    /// already locked): reads every stored section and the pool's hardware profile, and
    /// applies what they say ([`bc_core::health::interpret`]): devices and atoms, inventory
    /// labels, the GPU count, the health and mismatch conditions with their
    /// `noScheduleReasons`, and the hardware key. The devices are rewritten only when
    /// `gpus_reported` (a fresh `gpus` section): other sections and a re-evaluation leave
    /// them, and the placer's index of free atoms, alone. Returns whether the node changed.
    async fn inventory_controller_in(
        &self,
        txn: &WriteTxn,
        node_id: &NodeId,
        cause: &str,
        gpus_reported: bool,
    ) -> ApiResult<bool> {
        let controller = Actor::Controller("inventory".into());
        let now = self.clock.now();
        let sections = inventory::sections(&**txn, node_id).await?;
        let (_, pool_id) = nodes::generation_and_pool(&**txn, node_id)
            .await?
            .ok_or_else(|| ApiError::NotFound(format!("node `{node_id}` does not exist")))?;
        let profile = match &pool_id {
            Some(pool_id) => catalog::pool(&**txn, pool_id)
                .await?
                .map(|p| p.hardware_profile)
                .unwrap_or_default(),
            None => HardwareProfile::default(),
        };
        let facts = bc_core::health::interpret(&sections, &profile)
            .map_err(|e| ApiError::BadUserInput(e.to_string()))?;
        // The key is recomputed only from a complete set of identifiers (both sections
        // reported): sections arrive one by one, and a key from half of them would differ
        // from the join's, or be untrusted, until the other half arrives.
        let complete = sections.contains_key("system") && sections.contains_key("network");
        let ids = if complete {
            bc_core::health::identifiers(sections.get("system"), sections.get("network"))
        } else {
            BTreeMap::new()
        };
        let hw = hardware_key(&ids);
        // A trusted key must be unique across live nodes: one already held by another node
        // is kept, but untrusted, rather than letting two nodes claim one machine.
        let held_elsewhere = match (&hw.key, hw.trusted) {
            (Some(key), true) => nodes::by_trusted_hardware_key(&**txn, key)
                .await?
                .is_some_and(|other| &other != node_id),
            _ => false,
        };
        let trusted = hw.trusted && !held_elsewhere;
        let (_, changes) = self
            .change_node_in(
                txn,
                &controller,
                node_id,
                None,
                &|_| true,
                cause,
                |n, by, now| {
                    let mut changes = n.apply_inventory(&facts, by, now)?;
                    if hw.key.is_some() {
                        changes.extend(n.set_hardware_key(hw.key.clone(), trusted));
                    }
                    Ok(changes)
                },
            )
            .await?;
        if let Some(devices) = &facts.devices
            && gpus_reported
        {
            inventory::replace_devices(&**txn, node_id, devices, now).await?;
        }
        Ok(!changes.is_empty())
    }

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
