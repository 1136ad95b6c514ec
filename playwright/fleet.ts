// A real control plane with a simulated fleet, for one test file:
//
//   let fleet: Fleet;
//   test.beforeAll(async () => { fleet = await startFleet({ sim: 3 }); });
//   test.afterAll(async () => { await fleet?.stop(); });
//
// It runs `better-compute dev --sim N [--sim-mixed] [--sim-metal M]` (the release binary: BC_BIN, else
// `${CARGO_TARGET_DIR:-/var/tmp/better-compute-ci-target}/release/better-compute`) from the
// repository root, so the server serves the dashboard from web/dist, with its own temporary
// data directory (a fresh SQLite database, CA and JWT secret) and free loopback ports for the
// API and the gateway, and waits for the sign-in link `dev` prints.
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';

export const repoRoot = path.resolve(__dirname, '..');

export interface FleetOptions {
  /** Simulated nodes (`--sim N`). */
  sim: number;
  /** `--sim-mixed`: some nodes fail their diagnostic or miss a GPU, and from `faultsAfterSecs`
   * after start (45 by default) some GPUs fail in service, for health remediation to treat. */
  mixed?: boolean;
  /** `--sim-faults-after`: when the GPUs of `mixed` fail in service, in seconds. */
  faultsAfterSecs?: number;
  /** `--sim-metal N`: simulated bare-metal machines behind simulated Redfish BMCs, enrolled
   * into the `dev-metal` pool (hostnames `metal-0001`, …) and walked to `ready` by the
   * workflows (about 30 s on these machines). Independent of `sim`. */
  simMetal?: number;
  /** More configuration for the server, as `BC_…` environment variables. */
  env?: Record<string, string>;
  /** How long to wait for the sign-in link (default 60 s). */
  startTimeoutMs?: number;
}

export interface Fleet {
  /** The API's origin, e.g. `http://127.0.0.1:41234`. */
  url: string;
  /** The admin token `dev` minted (12 h). */
  token: string;
  /** The dashboard link that signs in: `${url}/#token=${token}`. */
  signInUrl: string;
  /** POSTs to /graphql with the bearer token; returns the response's JSON (`data`, `errors`). */
  graphql<T = any>(query: string, variables?: Record<string, unknown>): Promise<T>;
  /** Everything the server printed so far (stdout and stderr). */
  output(): string;
  /** SIGTERM, SIGKILL after 10 s; removes the data directory. Safe to call twice. */
  stop(): Promise<void>;
}

/** The release binary, absolute (the child runs from the repository root). */
export function binaryPath(): string {
  return path.resolve(
    process.env.BC_BIN ||
      path.join(
        process.env.CARGO_TARGET_DIR || '/var/tmp/better-compute-ci-target',
        'release',
        'better-compute',
      ),
  );
}

/** Where a test's explicit screenshots go: `playwright/test-results/screenshots/<name>.png`. */
export function screenshotPath(name: string): string {
  const dir = path.join(__dirname, 'test-results', 'screenshots');
  mkdirSync(dir, { recursive: true });
  return path.join(dir, `${name}.png`);
}

/** Distinct free loopback ports (all held open until all are known). */
async function freePorts(count: number): Promise<number[]> {
  const servers = await Promise.all(
    Array.from(
      { length: count },
      () =>
        new Promise<net.Server>((resolve, reject) => {
          const server = net.createServer();
          server.once('error', reject);
          server.listen(0, '127.0.0.1', () => resolve(server));
        }),
    ),
  );
  const ports = servers.map((s) => (s.address() as net.AddressInfo).port);
  await Promise.all(servers.map((s) => new Promise((resolve) => s.close(resolve))));
  return ports;
}

// Servers still running when the worker exits (a crashed test file) are killed with it.
const running = new Set<ChildProcess>();
process.on('exit', () => {
  for (const child of running) child.kill('SIGKILL');
});

const SIGN_IN = /(https?:\/\/\S*#token=(\S+))/;
const OUTPUT_LIMIT = 1 << 20;

export async function startFleet(options: FleetOptions): Promise<Fleet> {
  const bin = binaryPath();
  const [apiPort, gatewayPort] = await freePorts(2);
  const dataDir = mkdtempSync(path.join(tmpdir(), 'bc-playwright-'));

  // The server reads every `BC_…` variable as configuration and refuses unknown keys, so the
  // test tooling's (BC_BIN, BC_TEST_…, BC_WEB_…) must not reach it, nor DATABASE_URL (it would
  // replace the fresh SQLite database). Passed through: BC_DASHBOARD_DIR (test another build
  // of the dashboard) and BC_LOG__… (more logging).
  const env: Record<string, string> = {};
  for (const [key, value] of Object.entries(process.env)) {
    if (value === undefined || key === 'DATABASE_URL') continue;
    if (key.startsWith('BC_') && key !== 'BC_DASHBOARD_DIR' && !key.startsWith('BC_LOG__')) continue;
    env[key] = value;
  }
  Object.assign(env, {
    BC_DATA_DIR: dataDir,
    BC_LISTEN: `127.0.0.1:${apiPort}`,
    BC_GATEWAY__LISTEN: `127.0.0.1:${gatewayPort}`,
    ...options.env,
  });

  const args = ['dev', '--sim', String(options.sim)];
  if (options.mixed) args.push('--sim-mixed');
  if (options.faultsAfterSecs !== undefined) args.push('--sim-faults-after', String(options.faultsAfterSecs));
  if (options.simMetal !== undefined) args.push('--sim-metal', String(options.simMetal));
  const child = spawn(bin, args, { cwd: repoRoot, env, stdio: ['ignore', 'pipe', 'pipe'] });
  running.add(child);

  let output = '';
  let stdout: string | null = '';
  const record = (chunk: Buffer) => {
    output += chunk.toString();
    if (output.length > OUTPUT_LIMIT) output = output.slice(-OUTPUT_LIMIT);
  };
  child.stderr!.on('data', record);

  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    if (child.exitCode === null && child.signalCode === null) {
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 10_000);
      await exited;
      clearTimeout(timer);
    }
    running.delete(child);
    rmSync(dataDir, { recursive: true, force: true });
  };

  const timeoutMs = options.startTimeoutMs ?? 60_000;
  let signInUrl: string;
  let token: string;
  try {
    [signInUrl, token] = await new Promise<[string, string]>((resolve, reject) => {
      const fail = (why: string) =>
        reject(new Error(`${bin} ${args.join(' ')}: ${why}\n--- its output ---\n${output}`));
      const timer = setTimeout(() => fail(`no sign-in link within ${timeoutMs} ms`), timeoutMs);
      child.once('error', (e) => {
        clearTimeout(timer);
        fail(`could not start (${e.message}); build it with cargo build --release --bin better-compute`);
      });
      child.once('exit', (code, signal) => {
        clearTimeout(timer);
        fail(`exited (${signal ?? `code ${code}`}) before printing the sign-in link`);
      });
      child.stdout!.on('data', (chunk: Buffer) => {
        record(chunk);
        if (stdout === null) return;
        stdout += chunk.toString();
        const m = SIGN_IN.exec(stdout);
        if (m) {
          clearTimeout(timer);
          stdout = null;
          resolve([m[1], m[2]]);
        }
      });
    });
  } catch (e) {
    await stop();
    throw e;
  }

  const url = new URL(signInUrl).origin;
  return {
    url,
    token,
    signInUrl,
    async graphql(query, variables) {
      const res = await fetch(`${url}/graphql`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', authorization: `Bearer ${token}` },
        body: JSON.stringify({ query, variables: variables ?? {} }),
      });
      const text = await res.text();
      try {
        return JSON.parse(text);
      } catch {
        throw new Error(`POST ${url}/graphql: HTTP ${res.status}, not JSON: ${text.slice(0, 500)}`);
      }
    },
    output: () => output,
    stop,
  };
}
