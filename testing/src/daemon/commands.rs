//! What the simulated machine does with the gateway's commands (`diag.nvml`,
//! `inventory.refresh`, `logs.collect`, `gpu.reset`, `node.reboot`, `disk.wipe`): how long
//! each runs, and the result it reports.

use super::session::{Session, inventory_message, send};
use super::{DaemonError, FakeDaemon};
use bc_core::command::{CommandKind, Outcome};
use bc_core::protocol::DaemonMessage;
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::time::Instant;

/// A command the simulated machine is running.
pub(super) struct Running {
    done_at: Instant,
    id: String,
    kind: CommandKind,
    params: Value,
}

/// Commands under way: when each finishes, and what it is.
#[derive(Default)]
pub(super) struct Underway(Vec<Running>);

impl Underway {
    pub(super) fn start(&mut self, id: String, kind: CommandKind, params: Value) {
        self.0.push(Running {
            done_at: Instant::now() + simulated_duration(kind),
            id,
            kind,
            params,
        });
    }

    /// Stops the command `id`; false if it is not running (it finished already).
    pub(super) fn cancel(&mut self, id: &str) -> bool {
        match self.0.iter().position(|r| r.id == id) {
            Some(position) => {
                self.0.remove(position);
                true
            }
            None => false,
        }
    }

    /// When the next command finishes (None: nothing runs).
    pub(super) fn next_done(&self) -> Option<Instant> {
        self.0.iter().map(|r| r.done_at).min()
    }

    /// Takes out the commands that have finished by now.
    pub(super) fn take_done(&mut self) -> Vec<Running> {
        let now = Instant::now();
        let (done, still): (Vec<Running>, Vec<Running>) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|r| r.done_at <= now);
        self.0 = still;
        done
    }
}

/// What finishing a command does to the session.
pub(super) enum CommandEffect {
    None,
    /// The machine changed (a reset cleared a fault): the session reports it as it is now.
    Reinventory,
    /// The machine reboots: the session drops and the daemon comes back.
    Reboot,
}

/// How long the simulated machine takes for each kind: short, so tests and `dev --sim` move
/// quickly, with the diagnostic the slowest as on real hardware.
fn simulated_duration(kind: CommandKind) -> Duration {
    match kind {
        CommandKind::DiagNvml => Duration::from_millis(300),
        CommandKind::NodeReboot => Duration::from_millis(200),
        _ => Duration::from_millis(50),
    }
}

/// The answer to a `cancel` for a command that was still running.
pub(super) fn cancelled(id: String) -> DaemonMessage {
    DaemonMessage::CommandResult {
        id,
        outcome: Outcome::Cancelled,
        exit_code: None,
        output: "cancelled by the control plane\n".to_owned(),
        result: None,
    }
}

/// What a finished command reports in its `commandResult`.
struct Report {
    outcome: Outcome,
    exit_code: Option<i32>,
    output: String,
    result: Value,
}

impl Report {
    fn succeeded(output: String, result: Value) -> Report {
        Report {
            outcome: Outcome::Succeeded,
            exit_code: Some(0),
            output,
            result,
        }
    }
}

impl FakeDaemon {
    /// Ends a command: the result the simulated machine produces, sent to the gateway.
    pub(super) async fn finish_command(
        &self,
        ws: &mut Session,
        command: Running,
        inventory: &BTreeMap<String, Value>,
    ) -> Result<CommandEffect, DaemonError> {
        let mut effect = CommandEffect::None;
        let report = match command.kind {
            CommandKind::DiagNvml => diag_nvml(
                &command.params,
                inventory,
                self.shared.knobs.fail_diagnostics,
                &self.faults(),
                self.has_hardware_fault(),
            ),
            CommandKind::InventoryRefresh => {
                inventory_refresh(ws, &command.params, inventory).await?
            }
            CommandKind::LogsCollect => logs_collect(self.hostname()),
            CommandKind::GpuReset => {
                // The driver reloads: the faults a reset recovers from clear (if the knobs
                // say a reset works on this machine).
                if self.remedy(false) {
                    effect = CommandEffect::Reinventory;
                }
                gpu_reset(&command.params)
            }
            CommandKind::NodeReboot => {
                self.remedy(true);
                effect = CommandEffect::Reboot;
                Report::succeeded(
                    "rebooting\n".to_owned(),
                    serde_json::json!({ "rebooting": true }),
                )
            }
            CommandKind::DiskWipe => {
                // The simulated machine's disks hold nothing but what the status counts:
                // the wipe is recorded there, for tests to see that it ran on the machine.
                self.update(|s| s.disk_wipes += 1);
                disk_wipe(inventory)
            }
        };
        let message = DaemonMessage::CommandResult {
            id: command.id,
            outcome: report.outcome,
            exit_code: report.exit_code,
            output: report.output,
            result: Some(report.result),
        };
        send(ws, &message).await?;
        self.update(|s| s.commands_finished += 1);
        Ok(effect)
    }
}

/// The GPU diagnostic: it reports the simulated diagnostics' failures, and fails when the
/// machine is set to (`fail_diagnostics`), a GPU has a hardware fault (an XID a reset,
/// reboot or person must fix), or there is no GPU at all, as DCGM would.
fn diag_nvml(
    params: &Value,
    inventory: &BTreeMap<String, Value>,
    fail: bool,
    faults: &[u32],
    faulty: bool,
) -> Report {
    let level = params.get("level").cloned().unwrap_or(Value::from(1));
    let no_gpus = inventory
        .get("gpus")
        .and_then(|g| g.get("count"))
        .and_then(Value::as_u64)
        == Some(0);
    if no_gpus {
        let failures = serde_json::json!([{ "test": "deployment", "message": "no NVIDIA GPU found (NVML: driver not loaded)" }]);
        return Report {
            outcome: Outcome::Failed,
            exit_code: Some(1),
            output: format!("dcgmi diag -r {level}: FAIL\n{failures}\n"),
            result: serde_json::json!({ "passed": false, "level": level, "failures": failures }),
        };
    }
    let diagnostics = inventory
        .get("gpus")
        .and_then(|g| g.get("diagnostics"))
        .cloned()
        .unwrap_or(Value::Null);
    let mut failures = diagnostics
        .get("failures")
        .cloned()
        .unwrap_or_else(|| serde_json::json!([]));
    if faulty && let Some(list) = failures.as_array_mut() {
        list.push(serde_json::json!({
            "test": "pcie",
            "message": format!("GPU fault: XID {faults:?} reported since driver load"),
        }));
    }
    let passed = !fail && !faulty;
    let output = if passed {
        format!("dcgmi diag -r {level}: all tests passed\n")
    } else {
        format!("dcgmi diag -r {level}: FAIL\n{failures}\n")
    };
    let outcome = if passed {
        Outcome::Succeeded
    } else {
        Outcome::Failed
    };
    Report {
        outcome,
        exit_code: Some(i32::from(!passed)),
        output,
        result: serde_json::json!({ "passed": passed, "level": level, "failures": failures }),
    }
}

/// Sends the sections asked for (all of them if none are named) before the result, as
/// PROTOCOL.md allows while an `inventory.refresh` runs.
async fn inventory_refresh(
    ws: &mut Session,
    params: &Value,
    inventory: &BTreeMap<String, Value>,
) -> Result<Report, DaemonError> {
    let wanted: Vec<String> = match params.get("sections").and_then(Value::as_array) {
        Some(list) => list
            .iter()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect(),
        None => inventory.keys().cloned().collect(),
    };
    for section in &wanted {
        if let Some(content) = inventory.get(section) {
            send(ws, &inventory_message(section, content)).await?;
        }
    }
    Ok(Report::succeeded(
        format!("reported {} sections\n", wanted.len()),
        serde_json::json!({ "sections": wanted }),
    ))
}

fn logs_collect(hostname: &str) -> Report {
    let output = format!(
        "{hostname}: journal, dmesg and nvidia-bug-report collected\nkernel: NVRM: loading NVIDIA UNIX x86_64 Kernel Module\n"
    );
    Report::succeeded(
        output,
        serde_json::json!({ "archive": format!("logs-{hostname}.tar.zst") }),
    )
}

fn gpu_reset(params: &Value) -> Report {
    let gpu = params
        .get("gpu")
        .cloned()
        .unwrap_or_else(|| Value::from("all"));
    Report::succeeded(
        format!("nvidia-smi -r: GPU {gpu} reset\n"),
        serde_json::json!({ "reset": gpu }),
    )
}

/// Erases every disk the `disks` section lists, as the ramdisk does (an NVMe format with a
/// crypto erase), and names them in the result.
fn disk_wipe(inventory: &BTreeMap<String, Value>) -> Report {
    let disks: Vec<String> = inventory
        .get("disks")
        .and_then(|d| d.get("devices"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|d| d.get("name").and_then(Value::as_str).map(str::to_owned))
        .collect();
    let output: String = disks
        .iter()
        .map(|d| format!("nvme format /dev/{d} --ses=2: success\n"))
        .collect();
    Report::succeeded(output, serde_json::json!({ "wiped": disks }))
}
