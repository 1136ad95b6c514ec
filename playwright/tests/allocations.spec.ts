// Placement on the node page and the capacity chart, on `dev --sim 3` (24 GPUs): a node's
// allocations, a drain's progress until it ends by itself, and allocated/free GPUs changing
// live.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { signIn, waitForNodes } from './helpers';
import { GPU_MODEL, GPUS_PER_NODE, localInput, release, reserve, tenantOfDevPool } from './placement';

const NODES = 3;

let fleet: Fleet;
let tenantId: string;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: NODES });
  await waitForNodes(fleet, NODES, (n) => n.schedulable);
  tenantId = await tenantOfDevPool(fleet, 'acme');
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('a node shows its allocations, and a drain counts them down until it ends', async ({ page }) => {
  const booked = await reserve(fleet, tenantId, { gpusPerNode: 4 });
  expect(booked.state).toBe('PLACED');
  const [allocation] = booked.allocations;
  expect(allocation.atoms).toHaveLength(4);

  await signIn(page, fleet);
  await page.goto(`${fleet.url}/nodes/${allocation.nodeId}`);
  const section = page.getByTestId('node-allocations');
  await expect(section.locator('h2')).toHaveText(`Allocations (4 of ${GPUS_PER_NODE} GPUs booked)`);
  const row = section.locator(`[data-testid="allocation-row"][data-reservation="${booked.id}"]`);
  await expect(row.getByTestId('allocation-atoms')).toHaveText(allocation.atoms.join(' '));
  await expect(page.getByTestId('drain-progress')).toHaveCount(0);

  // Drained without a deadline: it waits for the allocation.
  await page.getByTestId('action-drain').click();
  await page.getByTestId('action-reason').fill('firmware update');
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();
  await expect(page.getByTestId('drain-progress-text')).toHaveText('1 allocation left, no deadline');

  // Drained again with a deadline half an hour away (the input counts whole minutes).
  await page.getByTestId('action-drain').click();
  await page.getByTestId('action-reason').fill('firmware update, by 30 min');
  await page.getByTestId('action-deadline').fill(localInput(new Date(Date.now() + 30 * 60_000)));
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();
  await expect(page.getByTestId('drain-progress-text')).toHaveText(/^1 allocation left, deadline in (29|30) min$/);
  await page.screenshot({ path: screenshotPath('node-allocations-drain'), fullPage: true });

  // The allocation leads to its reservation.
  await row.getByRole('link').click();
  await expect(page.getByTestId('reservation-id')).toHaveText(booked.id);
  await expect(page.locator(`[data-testid="reservation-allocation"][data-node="${allocation.nodeId}"]`)).toHaveAttribute(
    'data-active',
    'true',
  );
  await page.goBack();

  // Released: the node holds nothing, and its drain ends by itself; the cordon stays.
  await release(fleet, booked.id);
  await expect(page.getByTestId('no-allocations')).toBeVisible();
  await expect(page.getByTestId('drain-progress')).toHaveCount(0, { timeout: 30_000 });
  await expect(page.locator('[data-testid="event-row"][data-type="node.drained"]')).toHaveCount(1);
  await expect(page.locator('[data-fact="Cordoned"]')).toContainText('yes');

  await page.getByTestId('action-uncordon').click();
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
});

test('capacity shows allocated and free GPUs of each pool, live', async ({ page }) => {
  await waitForNodes(fleet, NODES, (n) => n.schedulable);
  const total = NODES * GPUS_PER_NODE;
  await signIn(page, fleet);
  await page.getByRole('link', { name: 'Capacity' }).click();
  const tableRow = page.getByTestId('capacity-row');
  await expect(tableRow.getByTestId('capacity-allocated')).toHaveText('0 GPUs');
  await expect(tableRow.getByTestId('capacity-free')).toHaveText(`${total} GPUs`);
  const bar = page.getByTestId('capacity-bar');
  await expect(bar.locator('rect[data-part="allocated"]')).toHaveCount(0);

  const booked = await reserve(fleet, tenantId, { gpusPerNode: 4, nodeCount: 2 });
  expect(booked.state).toBe('PLACED');
  await expect(tableRow.getByTestId('capacity-allocated')).toHaveText('8 GPUs');
  await expect(tableRow.getByTestId('capacity-free')).toHaveText(`${total - 8} GPUs`);
  await expect(bar.locator('rect[data-part="allocated"] title')).toHaveText(`allocated: 8 GPUs (${total - 8} free)`);
  await expect(bar).toContainText(`${total} GPUs · 8 allocated, ${total - 8} free`);
  const model = page.locator(`[data-testid="capacity-model-row"][data-model="${GPU_MODEL}"]`);
  await expect(model.locator('td[data-col="allocated"]')).toHaveText('8 GPUs');
  await expect(model.locator('td[data-col="free"]')).toHaveText(`${total - 8} GPUs`);
  await page.screenshot({ path: screenshotPath('capacity-allocated'), fullPage: true });

  await release(fleet, booked.id);
  await expect(tableRow.getByTestId('capacity-allocated')).toHaveText('0 GPUs');
  await expect(tableRow.getByTestId('capacity-free')).toHaveText(`${total} GPUs`);
});
