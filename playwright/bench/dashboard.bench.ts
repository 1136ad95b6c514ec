// How the dashboard copes with a large fleet: NODES nodes (default 10,000; BC_BENCH_NODES),
// enrolled through the API (bare-metal records, no daemons, so the 2-core machine spends its
// time on the server and the browser rather than on 10,000 simulated daemons), and a stream
// of changes (cordon/uncordon at BC_BENCH_CHANGES_PER_S, default 50/s) while it scrolls.
//
// It prints: time to the full table, DOM rows, JS heap, scroll frame times with and without
// the change stream, sorting time, and the latency from a mutation to its row.
import { test, expect, type Page } from '@playwright/test';
import { startFleet, screenshotPath, type Fleet } from '../fleet';

const NODES = Number(process.env.BC_BENCH_NODES || 10_000);
const CHANGES_PER_S = Number(process.env.BC_BENCH_CHANGES_PER_S || 50);
const ENROLL_CONCURRENCY = 16;
const SCROLL_FRAMES = 300;
const LATENCY_SAMPLES = 20;

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 0 });
});
test.afterAll(async () => {
  await fleet?.stop();
});

function quantile(sorted: number[], q: number): number {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
}
function summary(values: number[]): string {
  const s = [...values].sort((a, b) => a - b);
  return `p50 ${quantile(s, 0.5).toFixed(1)} / p99 ${quantile(s, 0.99).toFixed(1)} / max ${s[s.length - 1].toFixed(1)} ms`;
}

async function gql(query: string, variables?: Record<string, unknown>) {
  const answer = await fleet.graphql(query, variables);
  if (answer.errors) throw new Error(`${query}: ${JSON.stringify(answer.errors)}`);
  return answer.data;
}

/** Scrolls the table by a page-ish step on every animation frame; the frames' durations. */
async function scrollFrames(page: Page): Promise<number[]> {
  return page.evaluate(async (frames) => {
    const el = document.querySelector('.table-scroll') as HTMLElement;
    const deltas: number[] = [];
    let last = performance.now();
    for (let i = 0; i < frames; i++) {
      el.scrollTop += 211;
      if (el.scrollTop + el.clientHeight >= el.scrollHeight - 1) el.scrollTop = 0;
      await new Promise((r) => requestAnimationFrame(() => r(null)));
      const now = performance.now();
      deltas.push(now - last);
      last = now;
    }
    return deltas;
  }, SCROLL_FRAMES);
}

/** Cordons and uncordons random nodes at CHANGES_PER_S until `stop` resolves. */
async function changeStream(ids: string[], stop: Promise<void>): Promise<number> {
  let done = false;
  stop.then(() => (done = true));
  let sent = 0;
  while (!done) {
    const started = Date.now();
    const id = ids[Math.floor(Math.random() * ids.length)];
    const node = (await gql(`query($id: ID!) { node(id: $id) { version cordoned } }`, { id })).node;
    const op = node.cordoned
      ? `mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }`
      : `mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "bench"}) { node { version } } }`;
    await fleet.graphql(op, { id, v: node.version });
    sent++;
    await new Promise((r) => setTimeout(r, Math.max(0, 1000 / CHANGES_PER_S - (Date.now() - started))));
  }
  return sent;
}

test(`the dashboard with ${NODES} nodes`, async ({ page }) => {
  const rows: [string, string][] = [];
  const site = (await gql(`mutation { createSite(input: {name: "bench", kind: PLATFORM}) { site { id } } }`)).createSite.site.id;
  const pool = (
    await gql(`mutation($s: ID!) { createPool(input: {siteId: $s, name: "bench-h100", kind: METAL_HOST, expectedGpuCount: 8}) { pool { id } } }`, { s: site })
  ).createPool.pool.id;
  const enrollStart = Date.now();
  const ids: string[] = [];
  let next = 0;
  await Promise.all(
    Array.from({ length: ENROLL_CONCURRENCY }, async () => {
      while (next < NODES) {
        const i = next++;
        const hostname = `bench-${String(i).padStart(5, '0')}`;
        const data = await gql(`mutation($s: ID!, $p: ID!, $h: String!) { enrollNode(input: {siteId: $s, poolId: $p, hostname: $h}) { node { id } } }`, {
          s: site,
          p: pool,
          h: hostname,
        });
        ids.push(data.enrollNode.node.id);
        if (ids.length % 1000 === 0) console.log(`enrolled ${ids.length} in ${((Date.now() - enrollStart) / 1000).toFixed(1)} s`);
      }
    }),
  );
  rows.push(['enroll (API, not the dashboard)', `${NODES} nodes in ${((Date.now() - enrollStart) / 1000).toFixed(1)} s`]);

  const openStart = Date.now();
  await page.goto(fleet.signInUrl);
  await expect(page.getByTestId('fleet-count')).toHaveText(`${NODES} of ${NODES} nodes`);
  rows.push(['sign-in to full table (snapshot)', `${((Date.now() - openStart) / 1000).toFixed(2)} s`]);
  rows.push(['DOM rows rendered', String(await page.getByTestId('fleet-row').count())]);

  rows.push(['scroll frames, idle', summary(await scrollFrames(page))]);

  let stopStream!: () => void;
  const streamStop = new Promise<void>((r) => (stopStream = r));
  const stream = changeStream(ids, streamStop);
  await page.waitForTimeout(2_000);
  const busy = await scrollFrames(page);
  stopStream();
  const changes = await stream;
  rows.push([`scroll frames, ${CHANGES_PER_S} changes/s arriving`, summary(busy)]);
  rows.push(['changes sent during that', String(changes)]);

  // Sorting all rows by a column: from the click to the second animation frame after it,
  // by when the new order has been computed and painted. (Waiting for a new first row
  // instead would wait forever on a column whose values are all equal, such as gpus here.)
  const sortTimes: number[] = [];
  for (const column of ['hostname', 'hostname', 'gpus', 'cordoned']) {
    sortTimes.push(
      await page.evaluate(async (key) => {
        const header = document.querySelector(`[data-testid="sort-${key}"]`) as HTMLElement;
        const t0 = performance.now();
        header.click();
        await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(() => r(null))));
        return performance.now() - t0;
      }, column),
    );
  }
  rows.push(['sort (click to painted, 4 sorts)', summary(sortTimes)]);
  await page.getByTestId('sort-hostname').click();

  // Mutation to row: cordon the first visible node through the API, wait for its cell.
  const latencies: number[] = [];
  for (let i = 0; i < LATENCY_SAMPLES; i++) {
    const id = (await page.locator('[data-testid="fleet-row"]').first().getAttribute('data-node'))!;
    const node = (await gql(`query($id: ID!) { node(id: $id) { version cordoned } }`, { id })).node;
    const want = node.cordoned ? 'no' : 'yes';
    const op = node.cordoned
      ? `mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }`
      : `mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "latency"}) { node { version } } }`;
    const t0 = Date.now();
    await gql(op, { id, v: node.version });
    await expect(page.locator(`[data-testid="fleet-row"][data-node="${id}"] td[data-col="cordoned"]`)).toHaveText(want);
    latencies.push(Date.now() - t0);
  }
  rows.push(['mutation to its row on screen', summary(latencies)]);

  const heap = await page.evaluate(() => (performance as any).memory?.usedJSHeapSize ?? 0);
  rows.push(['JS heap used', `${(heap / 1048576).toFixed(1)} MiB`]);
  await page.screenshot({ path: screenshotPath(`bench-${NODES}`) });

  const width = Math.max(...rows.map(([k]) => k.length));
  console.log(`\ndashboard-bench: ${NODES} nodes, Chromium ${page.context().browser()?.version()}`);
  for (const [k, v] of rows) console.log(`  ${k.padEnd(width)}  ${v}`);
});
