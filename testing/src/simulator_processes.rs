//! A simulated fleet run as several `better-compute sim` child processes, for fleets too big
//! for one: every session is an open file, and a process may hold at most 20,000 of them on
//! this machine kind (issue 16), so 100,000 daemons need at least six processes.
//!
//! Each child holds an even share of the daemons, under its own hostname prefix (so no two
//! children make the same machine), and prints its progress as one JSON line every half
//! second (`sim --progress-json`); [`SimulatorProcesses::progress`] is the sum of the last
//! line of each. SIGTERM stops a child as Ctrl-C stops `sim`: its daemons close their
//! sessions, it prints its last progress and exits.

use crate::bench::Stopped;
use crate::sim::Progress;
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::process::Child;
use tokio::task::JoinHandle;

/// How long a child may take to stop after SIGTERM before it is killed: its daemons get 15 s
/// to close their sessions (`sim::SHUTDOWN_TIMEOUT`), plus time to exit.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// How many lines of a child's log an error quotes.
const LOG_TAIL_LINES: usize = 10;

/// What every child is given: where to join and how its daemons behave.
#[derive(Debug, Clone)]
pub struct SimulatorSpec {
    /// The `better-compute` binary (its `sim` command).
    pub binary: PathBuf,
    /// The gateways of every replica: each child spreads its daemons over all of them.
    pub gateways: Vec<String>,
    pub join_secret: String,
    /// The CA's SHA-256 fingerprint to pin.
    pub ca_sha256: String,
    pub heartbeat: Option<Duration>,
    pub join_concurrency: usize,
    /// Where each child's log (its stderr) goes, as `simulator-<n>.log`.
    pub log_dir: PathBuf,
}

/// Running simulator processes.
pub struct SimulatorProcesses {
    children: Vec<SimulatorProcess>,
}

struct SimulatorProcess {
    child: Child,
    /// Its last progress line.
    progress: Arc<Mutex<Progress>>,
    /// Set when its output ends: it has exited (or is about to), and its daemons are gone.
    ended: Arc<AtomicBool>,
    reader: JoinHandle<()>,
    log: PathBuf,
}

impl SimulatorProcesses {
    /// Starts `processes` children holding `nodes` daemons between them (the first ones one
    /// more each when they do not divide evenly).
    pub fn start(
        spec: &SimulatorSpec,
        nodes: usize,
        processes: usize,
    ) -> anyhow::Result<SimulatorProcesses> {
        anyhow::ensure!(processes > 0, "at least one simulator process");
        let mut children = Vec::with_capacity(processes);
        for index in 0..processes {
            let share = nodes / processes + usize::from(index < nodes % processes);
            children.push(SimulatorProcess::start(spec, index, share)?);
        }
        tracing::info!(nodes, processes, "simulator processes started");
        Ok(SimulatorProcesses { children })
    }

    /// An error quoting its log if a child has exited (before [`SimulatorProcesses::shutdown`]).
    pub fn check(&self) -> anyhow::Result<()> {
        match self
            .children
            .iter()
            .find(|c| c.ended.load(Ordering::Relaxed))
        {
            None => Ok(()),
            Some(child) => anyhow::bail!(
                "a simulator process exited; {} ends with:\n{}",
                child.log.display(),
                child.log_tail()
            ),
        }
    }

    /// How many children there are.
    pub fn count(&self) -> usize {
        self.children.len()
    }

    /// The daemons of every child.
    pub fn len(&self) -> usize {
        self.progress().nodes
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The children's progress, summed.
    pub fn progress(&self) -> Progress {
        self.children.iter().map(SimulatorProcess::progress).sum()
    }

    /// Why some daemon gave up: the end of the log of a child where one did.
    pub fn sample_error(&self) -> Option<String> {
        self.children
            .iter()
            .find_map(SimulatorProcess::sample_error)
    }

    /// The children's CPU time so far, in clock ticks, summed.
    pub fn cpu_ticks(&self) -> anyhow::Result<f64> {
        self.children
            .iter()
            .map(|c| crate::bench::cpu_ticks_of_pid(c.pid()?))
            .sum()
    }

    /// Stops every child (SIGTERM, then a kill after [`STOP_TIMEOUT`]); their last progress.
    pub async fn shutdown(self) -> Progress {
        let stops = self.children.into_iter().map(SimulatorProcess::stop);
        futures::future::join_all(stops).await.into_iter().sum()
    }
}

impl SimulatorProcess {
    fn start(spec: &SimulatorSpec, index: usize, nodes: usize) -> anyhow::Result<Self> {
        let log = log_path(&spec.log_dir, index);
        let stderr =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut command = crate::bench::isolated_command(&spec.binary, &[]);
        command
            .arg("sim")
            .args(spec.gateways.iter().flat_map(|g| ["--server", g.as_str()]))
            .args(["--token", &spec.join_secret, "--ca-sha256", &spec.ca_sha256])
            .args(["--nodes", &nodes.to_string()])
            .args(["--hostname-prefix", &format!("sim{index:02}-")])
            .args(["--join-concurrency", &spec.join_concurrency.to_string()])
            .arg("--progress-json");
        if let Some(every) = spec.heartbeat {
            command.args(["--heartbeat-secs", &every.as_secs().to_string()]);
        }
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} sim", spec.binary.display()))?;
        let stdout = child.stdout.take().context("the simulator's stdout")?;
        let progress = Arc::new(Mutex::new(Progress {
            nodes,
            ..Progress::default()
        }));
        let ended = Arc::new(AtomicBool::new(false));
        let reader = tokio::spawn({
            let progress = progress.clone();
            let ended = ended.clone();
            async move {
                let mut lines = tokio::io::BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    // Only progress lines are JSON; anything else is for a person.
                    if let Ok(latest) = serde_json::from_str::<Progress>(&line)
                        && let Ok(mut shown) = progress.lock()
                    {
                        *shown = latest;
                    }
                }
                // Whatever its last line said, none of its daemons is connected now.
                if let Ok(mut shown) = progress.lock() {
                    shown.connected = 0;
                }
                ended.store(true, Ordering::Relaxed);
            }
        });
        Ok(SimulatorProcess {
            child,
            progress,
            ended,
            reader,
            log,
        })
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.child.id().context("a simulator process has exited")
    }

    fn progress(&self) -> Progress {
        self.progress.lock().map(|p| *p).unwrap_or_default()
    }

    async fn stop(mut self) -> Progress {
        match crate::bench::terminate(&mut self.child, STOP_TIMEOUT).await {
            Ok(Stopped::Killed) => {
                tracing::warn!(log = %self.log.display(), "a simulator process did not stop in time; killed it");
            }
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "stopping a simulator process"),
        }
        // The child's stdout is closed now, so the reader has read its last line.
        let progress = self.progress.clone();
        let _ = self.reader.await;
        progress.lock().map(|p| *p).unwrap_or_default()
    }

    /// The end of its log, when some of its daemons gave up.
    fn sample_error(&self) -> Option<String> {
        (self.progress().failed > 0)
            .then(|| format!("{} ends with:\n{}", self.log.display(), self.log_tail()))
    }

    /// The last [`LOG_TAIL_LINES`] lines of its log.
    fn log_tail(&self) -> String {
        crate::bench::log_tail(&self.log, LOG_TAIL_LINES)
    }
}

fn log_path(dir: &Path, index: usize) -> PathBuf {
    dir.join(format!("simulator-{index}.log"))
}
