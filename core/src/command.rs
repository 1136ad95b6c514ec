//! The command queue's rules: kinds with their parameters, timeouts and safety flags, lanes,
//! and the status a command moves through.

use crate::Actor;
use crate::axes::{Trust, axis_enum};
use crate::error::DomainError;
use crate::ids::{CommandId, NodeId, TenantId};
use chrono::{DateTime, Duration, Utc};
use serde::{Deserialize, Serialize};

axis_enum!(
    /// What a command does on the node.
    CommandKind {
        /// Re-read the machine's inventory and report changed sections.
        InventoryRefresh = "inventory.refresh",
        /// NVIDIA GPU diagnostics (DCGM/NVML); acceptance runs it.
        DiagNvml = "diag.nvml",
        /// Collect logs (journal, dmesg, NVIDIA bug report) for support.
        LogsCollect = "logs.collect",
        /// Reset one GPU or all of them. Destructive: running workloads on them die.
        GpuReset = "gpu.reset",
        /// Reboot the machine. Destructive.
        NodeReboot = "node.reboot",
        /// Erase every local disk (the release and retire workflows run it in the ramdisk).
        /// Destructive: whatever was installed or stored is gone.
        DiskWipe = "disk.wipe",
    }
);

axis_enum!(
    /// Lanes: commands in one lane of a node run one at a time, in order; lanes run side by side.
    ///
    /// - `gpu`: everything that touches the GPUs or the machine as a whole (`diag.nvml`,
    ///   `gpu.reset`, `node.reboot`, `disk.wipe`). A diagnostic during a reset measures
    ///   nothing, and a reboot must not cut a diagnostic or a wipe in half, so they queue
    ///   behind each other.
    /// - `inventory`: `inventory.refresh` only reads; it may run beside a diagnostic.
    /// - `logs`: `logs.collect` is what an operator wants *while* something is stuck in the `gpu`
    ///   lane, so it never waits behind it.
    Lane {
        Gpu = "gpu",
        Inventory = "inventory",
        Logs = "logs",
    }
);

/// How long a command may wait in the queue before it expires, unless the sender says.
pub const DEFAULT_QUEUE_TTL: Duration = Duration::hours(1);
/// The longest a sender may let a command wait in the queue.
pub const MAX_QUEUE_TTL: Duration = Duration::days(30);
/// The most output a command keeps (bytes); the daemon truncates, the control plane enforces.
pub const MAX_OUTPUT_BYTES: usize = 64 * 1024;
/// The longest timeout a sender may ask for.
pub const MAX_TIMEOUT: Duration = Duration::hours(6);
/// How long a `disk.wipe` may run unless the sender says otherwise. The ramdisk erases
/// NVMe drives with a sanitize or format (a crypto erase takes seconds, a block erase of a
/// large drive tens of minutes) and a GPU server holds a handful of them, erased one after
/// the other: an hour covers that. A machine with spinning disks, which must be overwritten,
/// needs a longer timeout from its sender.
pub const DISK_WIPE_TIMEOUT: Duration = Duration::hours(1);

impl CommandKind {
    pub fn lane(self) -> Lane {
        match self {
            CommandKind::DiagNvml
            | CommandKind::GpuReset
            | CommandKind::NodeReboot
            | CommandKind::DiskWipe => Lane::Gpu,
            CommandKind::InventoryRefresh => Lane::Inventory,
            CommandKind::LogsCollect => Lane::Logs,
        }
    }

    /// How long the command may run once started, unless the sender says otherwise.
    pub fn default_timeout(self) -> Duration {
        match self {
            CommandKind::InventoryRefresh => Duration::seconds(60),
            // A full DCGM level-2 diagnostic takes a few minutes on 8 GPUs.
            CommandKind::DiagNvml => Duration::minutes(15),
            CommandKind::LogsCollect => Duration::minutes(10),
            CommandKind::GpuReset => Duration::minutes(2),
            // Until the daemon is back and says so; BIOS POST on big GPU servers is slow.
            CommandKind::NodeReboot => Duration::minutes(20),
            CommandKind::DiskWipe => DISK_WIPE_TIMEOUT,
        }
    }

    /// Destructive commands interrupt work on the node: they need the node cordoned (or an
    /// admin's explicit force), and are never sent by the platform to a tenant-controlled node.
    pub fn destructive(self) -> bool {
        matches!(
            self,
            CommandKind::GpuReset | CommandKind::NodeReboot | CommandKind::DiskWipe
        )
    }

    /// Whether sending it again after a lost session is safe. A reboot that was dispatched
    /// may already have happened: it is failed, not redelivered. A wipe is redelivered:
    /// erasing erased disks again changes nothing.
    pub fn redeliverable(self) -> bool {
        !matches!(self, CommandKind::NodeReboot)
    }

    /// Checks and normalises the parameters.
    pub fn validate_params(
        self,
        params: &serde_json::Value,
    ) -> Result<serde_json::Value, DomainError> {
        let object = match params {
            serde_json::Value::Null => serde_json::Map::new(),
            serde_json::Value::Object(map) => map.clone(),
            _ => {
                return Err(DomainError::BadInput(
                    "command parameters must be an object".into(),
                ));
            }
        };
        let allowed: &[&str] = match self {
            CommandKind::InventoryRefresh => &["sections"],
            CommandKind::DiagNvml => &["level"],
            CommandKind::LogsCollect => &["since", "sources"],
            CommandKind::GpuReset => &["gpu"],
            CommandKind::NodeReboot => &["reason"],
            CommandKind::DiskWipe => &[],
        };
        if let Some(unknown) = object.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(DomainError::BadInput(format!(
                "{self} takes no parameter `{unknown}` (it takes: {})",
                allowed.join(", ")
            )));
        }
        let mut out = object;
        match self {
            CommandKind::DiagNvml => {
                let level = out.get("level").map_or(Some(1), serde_json::Value::as_u64);
                match level {
                    Some(level @ 1..=3) => {
                        out.insert("level".into(), level.into());
                    }
                    _ => {
                        return Err(DomainError::BadInput(
                            "diag.nvml `level` is 1, 2 or 3 (DCGM run levels)".into(),
                        ));
                    }
                }
            }
            CommandKind::GpuReset => {
                if let Some(gpu) = out.get("gpu")
                    && !(gpu.is_u64() || gpu.as_str().is_some_and(|s| s.starts_with("GPU-")))
                {
                    return Err(DomainError::BadInput(
                        "gpu.reset `gpu` is an index or a GPU UUID (`GPU-…`); omit it for all"
                            .into(),
                    ));
                }
            }
            CommandKind::InventoryRefresh => {
                if let Some(sections) = out.get("sections") {
                    let valid = sections.as_array().is_some_and(|list| {
                        list.iter().all(|s| {
                            s.as_str()
                                .is_some_and(|s| crate::protocol::INVENTORY_SECTIONS.contains(&s))
                        })
                    });
                    if !valid {
                        return Err(DomainError::BadInput(format!(
                            "inventory.refresh `sections` is a list of: {}",
                            crate::protocol::INVENTORY_SECTIONS.join(", ")
                        )));
                    }
                }
            }
            CommandKind::LogsCollect | CommandKind::NodeReboot | CommandKind::DiskWipe => {}
        }
        Ok(serde_json::Value::Object(out))
    }
}

axis_enum!(
    /// Where a command is.
    CommandStatus {
        Queued = "queued",
        Dispatched = "dispatched",
        Running = "running",
        Succeeded = "succeeded",
        Failed = "failed",
        TimedOut = "timed_out",
        Cancelled = "cancelled",
        Expired = "expired",
    }
);

impl CommandStatus {
    pub fn is_final(self) -> bool {
        matches!(
            self,
            CommandStatus::Succeeded
                | CommandStatus::Failed
                | CommandStatus::TimedOut
                | CommandStatus::Cancelled
                | CommandStatus::Expired
        )
    }

    /// The legal moves: queued → dispatched → running → a final state; queued or dispatched
    /// may also end (cancelled, expired, failed on redelivery); dispatched or running may go
    /// back to queued when the session drops (redelivery).
    pub fn can_move_to(self, to: CommandStatus) -> bool {
        use CommandStatus::*;
        matches!(
            (self, to),
            (Queued, Dispatched | Cancelled | Expired | Failed)
                | (
                    Dispatched,
                    Running | Queued | Succeeded | Failed | Cancelled | TimedOut
                )
                | (Running, Queued | Succeeded | Failed | Cancelled | TimedOut)
        )
    }
}

/// Who may send `kind` to a node of `trust` that is `cordoned`, as `platform` (a platform
/// principal, not a tenant) and with `force` (admins only).
pub fn check_safety(
    kind: CommandKind,
    trust: Trust,
    cordoned: bool,
    platform: bool,
    force: bool,
    is_admin: bool,
) -> Result<(), DomainError> {
    if !kind.destructive() {
        return Ok(());
    }
    if platform && trust == Trust::TenantControlled {
        return Err(DomainError::Forbidden(format!(
            "{kind} is destructive and the node is tenant-controlled: the platform never sends it destructive commands"
        )));
    }
    if force && !is_admin {
        return Err(DomainError::Forbidden("force needs the admin role".into()));
    }
    if !cordoned && !force {
        return Err(DomainError::BadInput(format!(
            "{kind} is destructive: cordon (or drain) the node first, or have an admin force it"
        )));
    }
    Ok(())
}

/// Whether health remediation may send `kind` to a node without an operator's cordon. A
/// destructive command needs the node cordoned so that it interrupts no work; remediation
/// gets the same guarantee another way: it acts only on a node that holds no allocation
/// (`allocations`) and that a NoSchedule condition keeps new work off (`kept_off`), both
/// checked with the node row locked, and never on a tenant-controlled node. The command is
/// recorded with `force`, as an admin's would be.
pub fn check_remediation_safety(
    kind: CommandKind,
    trust: Trust,
    allocations: u64,
    kept_off: bool,
) -> Result<(), DomainError> {
    if !kind.destructive() {
        return Ok(());
    }
    if trust == Trust::TenantControlled {
        return Err(DomainError::Forbidden(format!(
            "{kind} is destructive and the node is tenant-controlled: remediation never sends it"
        )));
    }
    if allocations > 0 {
        return Err(DomainError::BadInput(format!(
            "{kind} is destructive and the node holds {allocations} allocation(s): remediation waits until they are released"
        )));
    }
    if !kept_off {
        return Err(DomainError::BadInput(format!(
            "{kind} is destructive and nothing keeps new work off the node"
        )));
    }
    Ok(())
}

/// A command and everything that happened to it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Command {
    pub id: CommandId,
    pub node_id: NodeId,
    pub tenant_id: Option<TenantId>,
    pub kind: CommandKind,
    pub lane: Lane,
    pub params: serde_json::Value,
    pub status: CommandStatus,
    pub force: bool,
    /// Not dispatched before this time.
    pub not_before: DateTime<Utc>,
    /// How long it may run once dispatched.
    pub timeout: Duration,
    /// A command still queued at this time expires.
    pub expires_at: DateTime<Utc>,
    /// How many times it was dispatched (redelivery counts again).
    pub attempts: i32,
    pub session_epoch: Option<i64>,
    pub exit_code: Option<i32>,
    pub output: String,
    pub result: Option<serde_json::Value>,
    /// Why it failed, timed out, expired or was cancelled, in words.
    pub error: Option<String>,
    pub created_by: Actor,
    pub created_at: DateTime<Utc>,
    pub dispatched_at: Option<DateTime<Utc>>,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
}

/// How a command the daemon ran ended, as the daemon reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Succeeded,
    Failed,
    Cancelled,
}

/// What sending a command asks for.
#[derive(Debug, Clone)]
pub struct NewCommand {
    pub kind: CommandKind,
    pub params: serde_json::Value,
    pub timeout: Option<Duration>,
    pub not_before: Option<DateTime<Utc>>,
    pub ttl: Option<Duration>,
    pub force: bool,
}

impl Command {
    /// A queued command for `node_id`, parameters validated and defaults applied.
    pub fn new(
        new: NewCommand,
        node_id: NodeId,
        tenant_id: Option<TenantId>,
        by: Actor,
        now: DateTime<Utc>,
    ) -> Result<Command, DomainError> {
        let params = new.kind.validate_params(&new.params)?;
        let timeout = new.timeout.unwrap_or_else(|| new.kind.default_timeout());
        if timeout <= Duration::zero() || timeout > MAX_TIMEOUT {
            return Err(DomainError::BadInput(format!(
                "a timeout is between 1 second and {} hours",
                MAX_TIMEOUT.num_hours()
            )));
        }
        if new
            .ttl
            .is_some_and(|ttl| ttl <= Duration::zero() || ttl > MAX_QUEUE_TTL)
        {
            return Err(DomainError::BadInput(format!(
                "a command waits in the queue between 1 second and {} days",
                MAX_QUEUE_TTL.num_days()
            )));
        }
        let not_before = new.not_before.unwrap_or(now).max(now);
        let expires_at = expiry(not_before, new.ttl);
        if expires_at <= now {
            return Err(DomainError::BadInput(
                "the command would expire before it could run".into(),
            ));
        }
        Ok(Command {
            id: CommandId::generate(),
            node_id,
            tenant_id,
            lane: new.kind.lane(),
            kind: new.kind,
            params,
            status: CommandStatus::Queued,
            force: new.force,
            not_before,
            timeout,
            expires_at,
            attempts: 0,
            session_epoch: None,
            exit_code: None,
            output: String::new(),
            result: None,
            error: None,
            created_by: by,
            created_at: now,
            dispatched_at: None,
            started_at: None,
            finished_at: None,
            updated_at: now,
        })
    }

    /// Why this command, as it is, cannot become `to`: the refusal of an illegal move, and of
    /// a move computed from a status the command has since left (a change that lost a race
    /// is answered with the command's real status, in words about the command).
    pub fn refusal(&self, to: CommandStatus) -> DomainError {
        DomainError::CommandState {
            id: self.id.to_string(),
            current: self.status.to_string(),
            attempted: to.to_string(),
            finished: self.status.is_final(),
        }
    }

    fn move_to(
        &mut self,
        to: CommandStatus,
        now: DateTime<Utc>,
    ) -> Result<CommandStatus, DomainError> {
        let from = self.status;
        if !from.can_move_to(to) {
            return Err(self.refusal(to));
        }
        self.status = to;
        self.updated_at = now;
        if to.is_final() {
            self.finished_at = Some(now);
        }
        Ok(from)
    }

    /// Handed to the session of `epoch`.
    pub fn dispatch(
        &mut self,
        epoch: i64,
        now: DateTime<Utc>,
    ) -> Result<CommandStatus, DomainError> {
        let from = self.move_to(CommandStatus::Dispatched, now)?;
        self.attempts += 1;
        self.session_epoch = Some(epoch);
        self.dispatched_at = Some(now);
        Ok(from)
    }

    /// The daemon started it.
    pub fn start(&mut self, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        let from = self.move_to(CommandStatus::Running, now)?;
        self.started_at = Some(now);
        Ok(from)
    }

    /// The daemon's result. A result for a command that already ended (a cancel or timeout
    /// won the race) is refused, and the first final state stands.
    pub fn finish(
        &mut self,
        outcome: Outcome,
        exit_code: Option<i32>,
        output: &str,
        result: Option<serde_json::Value>,
        now: DateTime<Utc>,
    ) -> Result<CommandStatus, DomainError> {
        let to = match outcome {
            Outcome::Succeeded => CommandStatus::Succeeded,
            Outcome::Failed => CommandStatus::Failed,
            Outcome::Cancelled => CommandStatus::Cancelled,
        };
        let from = self.move_to(to, now)?;
        self.exit_code = exit_code;
        self.output = bound_output(&without_nul(output));
        self.result = result.map(json_without_nul);
        Ok(from)
    }

    /// Cancelled by a person: a queued command never runs; a dispatched or running one is
    /// told to stop and counts as cancelled from now on.
    pub fn cancel(&mut self, by: &Actor, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        let from = self.move_to(CommandStatus::Cancelled, now)?;
        self.error = Some(format!("cancelled by {by}"));
        Ok(from)
    }

    /// Still queued at `expires_at`.
    pub fn expire(&mut self, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        let from = self.move_to(CommandStatus::Expired, now)?;
        self.error = Some(format!(
            "not dispatched before it expired at {}",
            self.expires_at.to_rfc3339()
        ));
        Ok(from)
    }

    /// Dispatched or running for longer than its timeout.
    pub fn time_out(&mut self, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        let from = self.move_to(CommandStatus::TimedOut, now)?;
        self.error = Some(format!("no result within {} s", self.timeout.num_seconds()));
        Ok(from)
    }

    /// When it must have a result by, once dispatched.
    pub fn deadline(&self) -> Option<DateTime<Utc>> {
        self.dispatched_at.map(|at| at + self.timeout)
    }

    /// The final status it is overdue for at `now`, if any: `expired` for a queued command
    /// past `expires_at`, `timed_out` for a dispatched or running one past its deadline.
    pub fn overdue(&self, now: DateTime<Utc>) -> Option<CommandStatus> {
        match self.status {
            CommandStatus::Queued => (self.expires_at <= now).then_some(CommandStatus::Expired),
            CommandStatus::Dispatched | CommandStatus::Running => self
                .deadline()
                .is_some_and(|deadline| deadline <= now)
                .then_some(CommandStatus::TimedOut),
            _ => None,
        }
    }

    /// Ends it as [`Command::overdue`] says, judged on the command as it is now: one found
    /// overdue a moment ago may have been dispatched, requeued or finished since, and is then
    /// refused (it is not overdue any more) rather than expired or timed out by mistake.
    pub fn end_overdue(&mut self, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        match self.overdue(now) {
            Some(CommandStatus::Expired) => self.expire(now),
            Some(_) => self.time_out(now),
            None => Err(self.refusal(match self.status {
                CommandStatus::Queued => CommandStatus::Expired,
                _ => CommandStatus::TimedOut,
            })),
        }
    }

    /// The session it was dispatched to ended first: queued again for the next session, or,
    /// for a command that may already have taken effect, failed with the reason.
    pub fn session_lost(&mut self, now: DateTime<Utc>) -> Result<CommandStatus, DomainError> {
        if self.kind.redeliverable() {
            let from = self.move_to(CommandStatus::Queued, now)?;
            self.session_epoch = None;
            Ok(from)
        } else {
            let from = self.move_to(CommandStatus::Failed, now)?;
            self.error = Some(format!(
                "the session ended while {} was {}; it may have run, so it is not sent again",
                self.kind, from
            ));
            Ok(from)
        }
    }
}

/// When a queued command expires (the end of time rather than an overflow).
pub fn expiry(now: DateTime<Utc>, ttl: Option<Duration>) -> DateTime<Utc> {
    now.checked_add_signed(ttl.unwrap_or(DEFAULT_QUEUE_TTL))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `text` with each NUL character replaced by U+FFFD. PostgreSQL's `text` and `jsonb` cannot
/// hold a NUL, and a tool's output may carry one: kept as it came, it would keep the whole
/// result from being recorded.
fn without_nul(text: &str) -> String {
    text.replace('\0', "\u{FFFD}")
}

/// A daemon's result with [`without_nul`] applied to every string and key in it.
fn json_without_nul(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) if s.contains('\0') => Value::String(without_nul(&s)),
        Value::Array(items) => Value::Array(items.into_iter().map(json_without_nul).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(key, value)| {
                    let key = if key.contains('\0') {
                        without_nul(&key)
                    } else {
                        key
                    };
                    (key, json_without_nul(value))
                })
                .collect(),
        ),
        other => other,
    }
}

/// Cuts `output` to [`MAX_OUTPUT_BYTES`] on a character boundary, saying so at the end.
pub fn bound_output(output: &str) -> String {
    if output.len() <= MAX_OUTPUT_BYTES {
        return output.to_owned();
    }
    let marker = "\n…[truncated]";
    let mut end = MAX_OUTPUT_BYTES - marker.len();
    while !output.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{marker}", &output[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use strum::IntoEnumIterator;

    #[test]
    fn a_result_is_kept_without_nul_characters() {
        let now = Utc::now();
        let new = NewCommand {
            kind: CommandKind::LogsCollect,
            params: serde_json::json!({}),
            timeout: None,
            not_before: None,
            ttl: None,
            force: false,
        };
        let node = NodeId::parse("node_a").expect("a node id");
        let mut command = Command::new(new, node, None, Actor::System, now).expect("a command");
        command.dispatch(1, now).expect("dispatched");
        command
            .finish(
                Outcome::Succeeded,
                Some(0),
                "before\0after",
                Some(serde_json::json!({ "k\0": ["v\0", 1] })),
                now,
            )
            .expect("finished");
        assert_eq!(command.output, "before\u{FFFD}after");
        assert_eq!(
            command.result,
            Some(serde_json::json!({ "k\u{FFFD}": ["v\u{FFFD}", 1] }))
        );
    }

    #[test]
    fn kinds_have_stable_names_lanes_and_flags() {
        assert_eq!(CommandKind::DiagNvml.to_string(), "diag.nvml");
        assert_eq!(
            "node.reboot".parse::<CommandKind>().ok(),
            Some(CommandKind::NodeReboot)
        );
        let destructive: Vec<_> = CommandKind::iter().filter(|k| k.destructive()).collect();
        assert_eq!(
            destructive,
            vec![
                CommandKind::GpuReset,
                CommandKind::NodeReboot,
                CommandKind::DiskWipe
            ]
        );
        assert_eq!(CommandKind::LogsCollect.lane(), Lane::Logs);
        assert!(!CommandKind::NodeReboot.redeliverable());
        assert_eq!(
            "disk.wipe".parse::<CommandKind>().ok(),
            Some(CommandKind::DiskWipe)
        );
        assert_eq!(CommandKind::DiskWipe.lane(), Lane::Gpu);
        assert_eq!(CommandKind::DiskWipe.default_timeout(), DISK_WIPE_TIMEOUT);
        assert!(CommandKind::DiskWipe.redeliverable());
    }

    #[test]
    fn params_are_validated() {
        assert_eq!(
            CommandKind::DiagNvml
                .validate_params(&serde_json::Value::Null)
                .ok(),
            Some(serde_json::json!({"level": 1}))
        );
        assert!(
            CommandKind::DiagNvml
                .validate_params(&serde_json::json!({"level": 9}))
                .is_err()
        );
        assert!(
            CommandKind::GpuReset
                .validate_params(&serde_json::json!({"gpu": "GPU-1234"}))
                .is_ok()
        );
        assert!(
            CommandKind::GpuReset
                .validate_params(&serde_json::json!({"gpu": true}))
                .is_err()
        );
        assert!(
            CommandKind::LogsCollect
                .validate_params(&serde_json::json!({"rm": "-rf"}))
                .is_err()
        );
        assert!(
            CommandKind::InventoryRefresh
                .validate_params(&serde_json::json!({"sections": ["gpus"]}))
                .is_ok()
        );
        assert!(
            CommandKind::InventoryRefresh
                .validate_params(&serde_json::json!({"sections": ["bios"]}))
                .is_err()
        );
        assert!(
            CommandKind::InventoryRefresh
                .validate_params(&serde_json::json!([1]))
                .is_err()
        );
        assert!(
            CommandKind::DiskWipe
                .validate_params(&serde_json::json!({"disks": "all"}))
                .is_err(),
            "a wipe takes no parameter: it erases every local disk"
        );
    }

    #[test]
    fn destructive_commands_need_a_cordon_or_an_admins_force_and_never_reach_tenant_controlled_nodes()
     {
        use CommandKind::*;
        assert!(check_safety(DiagNvml, Trust::TenantControlled, false, true, false, false).is_ok());
        assert!(check_safety(GpuReset, Trust::Platform, false, true, false, true).is_err());
        assert!(check_safety(GpuReset, Trust::Platform, true, true, false, false).is_ok());
        assert!(check_safety(GpuReset, Trust::Platform, false, true, true, true).is_ok());
        assert!(matches!(
            check_safety(GpuReset, Trust::Platform, false, true, true, false),
            Err(DomainError::Forbidden(_))
        ));
        assert!(matches!(
            check_safety(NodeReboot, Trust::TenantControlled, true, true, true, true),
            Err(DomainError::Forbidden(_))
        ));
        // The tenant itself may reboot its own dedicated machine.
        assert!(
            check_safety(
                NodeReboot,
                Trust::TenantControlled,
                true,
                false,
                false,
                false
            )
            .is_ok()
        );
    }

    #[test]
    fn remediation_acts_destructively_only_on_an_idle_node_kept_off_by_its_condition() {
        use CommandKind::*;
        assert!(check_remediation_safety(GpuReset, Trust::Platform, 0, true).is_ok());
        assert!(check_remediation_safety(DiagNvml, Trust::Platform, 3, false).is_ok());
        assert!(check_remediation_safety(GpuReset, Trust::Platform, 1, true).is_err());
        assert!(check_remediation_safety(NodeReboot, Trust::Platform, 0, false).is_err());
        assert!(matches!(
            check_remediation_safety(NodeReboot, Trust::TenantControlled, 0, true),
            Err(DomainError::Forbidden(_))
        ));
    }

    #[test]
    fn statuses_move_only_forward_or_back_to_the_queue() {
        use CommandStatus::*;
        assert!(Queued.can_move_to(Dispatched));
        assert!(Running.can_move_to(Queued));
        assert!(!Succeeded.can_move_to(Running));
        assert!(!Queued.can_move_to(Running));
        for status in CommandStatus::iter().filter(|s| s.is_final()) {
            assert!(
                CommandStatus::iter().all(|to| !status.can_move_to(to)),
                "{status} is final"
            );
        }
    }

    fn queued(kind: CommandKind) -> Command {
        let now = Utc::now();
        let new = NewCommand {
            kind,
            params: serde_json::Value::Null,
            timeout: None,
            not_before: None,
            ttl: None,
            force: false,
        };
        Command::new(
            new,
            NodeId::generate(),
            None,
            Actor::User("alice".into()),
            now,
        )
        .expect("valid")
    }

    #[test]
    fn a_command_runs_once_and_its_first_final_state_stands() {
        let now = Utc::now();
        let mut c = queued(CommandKind::DiagNvml);
        assert_eq!(c.params, serde_json::json!({"level": 1}));
        c.dispatch(3, now).expect("queued → dispatched");
        c.start(now).expect("dispatched → running");
        c.cancel(&Actor::User("bob".into()), now)
            .expect("running → cancelled");
        // The daemon's result arrives after the cancel: refused, the cancel stands.
        assert!(
            c.finish(Outcome::Succeeded, Some(0), "ok", None, now)
                .is_err()
        );
        assert_eq!(c.status, CommandStatus::Cancelled);
        assert!(c.finished_at.is_some());
    }

    #[test]
    fn a_lost_session_requeues_what_is_safe_to_resend_and_fails_the_rest() {
        let now = Utc::now();
        let mut diag = queued(CommandKind::DiagNvml);
        diag.dispatch(1, now).expect("dispatch");
        diag.session_lost(now).expect("requeue");
        assert_eq!(
            (diag.status, diag.session_epoch, diag.attempts),
            (CommandStatus::Queued, None, 1)
        );
        let mut reboot = queued(CommandKind::NodeReboot);
        reboot.dispatch(1, now).expect("dispatch");
        reboot.session_lost(now).expect("fail");
        assert_eq!(reboot.status, CommandStatus::Failed);
        assert!(
            reboot
                .error
                .as_deref()
                .is_some_and(|e| e.contains("not sent again"))
        );
    }

    #[test]
    fn only_an_overdue_command_is_ended_as_overdue() {
        let mut c = queued(CommandKind::LogsCollect);
        let expired = c.expires_at;
        assert_eq!(c.overdue(expired - Duration::seconds(1)), None);
        assert_eq!(c.overdue(expired), Some(CommandStatus::Expired));
        // Found expired, then dispatched before it was ended: judged as it is now, it has its
        // whole timeout ahead and is refused, not timed out.
        c.dispatch(1, expired).expect("dispatch");
        assert_eq!(c.overdue(expired), None);
        let refused = c.end_overdue(expired).expect_err("not overdue any more");
        assert_eq!(
            refused,
            DomainError::CommandState {
                id: c.id.to_string(),
                current: "dispatched".into(),
                attempted: "timed_out".into(),
                finished: false,
            }
        );
        assert_eq!(c.status, CommandStatus::Dispatched);
        let deadline = c.deadline().expect("dispatched");
        assert_eq!(c.end_overdue(deadline), Ok(CommandStatus::Dispatched));
        assert_eq!(c.status, CommandStatus::TimedOut);
        assert_eq!(
            c.overdue(deadline),
            None,
            "a final command is never overdue"
        );
    }

    #[test]
    fn output_is_bounded_on_a_character_boundary() {
        let long = "é".repeat(MAX_OUTPUT_BYTES);
        let bounded = bound_output(&long);
        assert!(bounded.len() <= MAX_OUTPUT_BYTES);
        assert!(bounded.ends_with("[truncated]"));
        assert_eq!(bound_output("short"), "short");
    }
}
