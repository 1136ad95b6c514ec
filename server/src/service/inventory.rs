//! Inventory: a daemon's reported sections, and the Inventory controller that turns them
//! into devices, labels, the GPU count, health conditions and the hardware key.

use bc_core::Actor;
use bc_core::hardware::hardware_key;
use bc_core::health::Device;
use bc_core::ids::NodeId;
use std::collections::BTreeMap;

use super::Services;
use super::store::{catalog, inventory, nodes};
use crate::auth::Principal;
use crate::error::{ApiError, ApiResult};

impl Services {
    /// Stores one inventory section a daemon sent and, in the same transaction, runs the
    /// Inventory controller over it: devices and atoms, inventory labels, the GPU count, the
    /// health conditions with their `noScheduleReasons`, and the hardware key.
    pub async fn store_inventory_section(
        &self,
        node_id: &NodeId,
        section: &str,
        hash: &str,
        content: serde_json::Value,
    ) -> ApiResult<()> {
        let controller = Actor::Controller("inventory".into());
        let txn = self.store.write().await?;
        let now = self.clock.now();
        let runs_controller = matches!(section, "gpus" | "system" | "network");
        if runs_controller {
            // The node row before its inventory rows (ARCHITECTURE.md, Invariants: lock
            // order), since the controller changes the node below.
            nodes::lock(&*txn, node_id).await?;
        }
        inventory::put_section(&*txn, node_id, section, hash, content, now).await?;
        if runs_controller {
            let sections = inventory::sections(&*txn, node_id).await?;
            let node = nodes::load(&*txn, node_id, false)
                .await?
                .ok_or_else(|| ApiError::NotFound(format!("node `{node_id}` does not exist")))?;
            let expected_gpus = match &node.pool_id {
                Some(pool_id) => catalog::pool(&*txn, pool_id)
                    .await?
                    .and_then(|p| p.hardware_profile.gpu_count),
                None => None,
            };
            let facts = match sections.get("gpus") {
                Some(gpus) => Some(
                    bc_core::health::interpret_gpus(gpus, expected_gpus)
                        .map_err(|e| ApiError::BadUserInput(e.to_string()))?,
                ),
                None => None,
            };
            // The key is recomputed only from a complete set of identifiers (both sections
            // reported): sections arrive one by one, and a key from half of them would
            // differ from the join's, or be untrusted, until the other half arrives.
            let complete = sections.contains_key("system") && sections.contains_key("network");
            let ids = if complete {
                bc_core::health::identifiers(sections.get("system"), sections.get("network"))
            } else {
                BTreeMap::new()
            };
            let hw = hardware_key(&ids);
            // A trusted key must be unique across live nodes: one already held by another
            // node is kept, but untrusted, rather than letting two nodes claim one machine.
            let held_elsewhere = match (&hw.key, hw.trusted) {
                (Some(key), true) => nodes::by_trusted_hardware_key(&*txn, key)
                    .await?
                    .is_some_and(|other| &other != node_id),
                _ => false,
            };
            let trusted = hw.trusted && !held_elsewhere;
            self.change_node_in(
                &txn,
                &controller,
                node_id,
                None,
                &|_| true,
                &format!("inventory:{section}"),
                |n, by, now| {
                    let mut changes = match &facts {
                        Some(facts) => n.apply_gpu_inventory(facts, by, now)?,
                        None => Vec::new(),
                    };
                    if hw.key.is_some() {
                        changes.extend(n.set_hardware_key(hw.key.clone(), trusted));
                    }
                    Ok(changes)
                },
            )
            .await?;
            if let Some(facts) = &facts {
                inventory::replace_devices(&*txn, node_id, &facts.devices, now).await?;
            }
        }
        txn.commit().await?;
        Ok(())
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
