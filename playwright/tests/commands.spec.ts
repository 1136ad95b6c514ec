// Commands from the node page: a diagnostic whose result appears live, a destructive command
// that needs a confirmation (and a cordon), cancelling a queued command, and revoking a
// node's identity.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { mutate, nodes, signIn, waitForNodes } from './helpers';

const NODES = 3;

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: NODES });
  await waitForNodes(fleet, NODES, (n) => n.schedulable);
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('a diagnostic sent from the node page shows its result live', async ({ page }) => {
  const [target] = await nodes(fleet);
  await signIn(page, fleet);
  // Acceptance already ran a diagnostic on it.
  const sent = await fleet.graphql(`query($id: ID!) { commands(filter: {nodeId: [$id]}) { nodes { id } } }`, { id: target.id });
  const before = sent.data.commands.nodes.length;
  expect(before).toBeGreaterThan(0);
  await page.goto(`${fleet.url}/nodes/${target.id}`);
  await expect(page.getByTestId('command-row')).toHaveCount(before);

  await page.getByTestId('action-command').click();
  await page.getByTestId('command-kind').selectOption({ label: 'diag.nvml' });
  await page.getByTestId('command-params').fill('{"level": 1}');
  await page.getByTestId('command-send').click();
  await expect(page.getByTestId('command-sent')).toContainText('Queued 1 command');
  await page.getByRole('button', { name: 'Close' }).click();

  const latest = page.getByTestId('command-row').first();
  await expect(page.getByTestId('command-row')).toHaveCount(before + 1);
  await expect(latest).toHaveAttribute('data-kind', 'diag.nvml');
  await expect(latest).toHaveAttribute('data-status', 'SUCCEEDED', { timeout: 30_000 });
  await expect(latest.getByTestId('command-result')).toContainText('"passed":true');
  await page.screenshot({ path: screenshotPath('node-commands'), fullPage: true });
});

test('a destructive command needs a confirmation, and the server wants a cordon', async ({ page }) => {
  const target = (await nodes(fleet))[1];
  await signIn(page, fleet);
  await page.goto(`${fleet.url}/nodes/${target.id}`);
  await page.getByTestId('action-command').click();
  await page.getByTestId('command-kind').selectOption({ label: 'gpu.reset (destructive)' });
  await page.getByTestId('command-send').click();
  await expect(page.getByTestId('command-error')).toContainText('tick the confirmation');

  await page.getByTestId('command-confirm-destructive').check();
  await page.getByTestId('command-send').click();
  // Not cordoned, not forced: refused, nothing queued.
  await expect(page.getByTestId('command-error')).toContainText('cordon (or drain) the node first');
  const queued = await fleet.graphql(`{ commands(filter: {kind: [GPU_RESET]}) { nodes { id } } }`);
  expect(queued.data.commands.nodes).toHaveLength(0);
});

test('a queued command is cancelled, and revoking the identity ends the session', async ({ page }) => {
  const target = (await nodes(fleet))[2];
  const later = new Date(Date.now() + 3_600_000).toISOString();
  await mutate(fleet, `mutation($id: ID!, $at: DateTime!) {
    sendCommand(input: {nodeIds: [$id], kind: LOGS_COLLECT, notBefore: $at}) { commands { id } } }`, { id: target.id, at: later });
  await signIn(page, fleet);
  await page.goto(`${fleet.url}/nodes/${target.id}`);
  const queued = page.locator('[data-testid="command-row"][data-kind="logs.collect"]');
  await expect(queued).toHaveAttribute('data-status', 'QUEUED');
  await queued.getByTestId('command-cancel').click();
  await queued.getByTestId('command-cancel-confirm').click();
  await expect(queued).toHaveAttribute('data-status', 'CANCELLED');

  await page.getByTestId('action-revoke').click();
  await expect(page.getByTestId('action-dialog')).toContainText('certificate stops working');
  await page.getByTestId('action-reason').fill('disk swapped');
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();
  await expect(page.locator('[data-fact="Identity generation"]')).toHaveText('2');
  await expect(page.locator('[data-fact="Connectivity"]')).toContainText('disconnected', { timeout: 30_000 });
});
