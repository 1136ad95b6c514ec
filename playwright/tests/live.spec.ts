// Changes made elsewhere show up live, and actions pass the version the operator saw: a
// cordon made in one browser appears in a second, a conflict shows what changed and retries,
// and bulk actions act on a selection.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { mutate, node, nodes, row, signIn, waitForNodes } from './helpers';

const NODES = 5;

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: NODES });
  await waitForNodes(fleet, NODES, (n) => n.schedulable);
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('a cordon made in one browser shows live in a second', async ({ browser, pageErrors }) => {
  const [target] = await nodes(fleet);
  const [firstContext, secondContext] = [await browser.newContext(), await browser.newContext()];
  pageErrors.watch(firstContext);
  pageErrors.watch(secondContext);
  const first = await firstContext.newPage();
  const second = await secondContext.newPage();
  await signIn(first, fleet);
  await signIn(second, fleet);
  await expect(row(second, target.id).locator('td[data-col="cordoned"]')).toHaveText('no');

  await row(first, target.id).getByRole('link').click();
  await first.getByTestId('action-cordon').click();
  await first.getByTestId('action-reason').fill('rack move');
  await first.getByTestId('action-confirm').click();
  await expect(first.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');

  // The second browser was not reloaded.
  await expect(row(second, target.id).locator('td[data-col="cordoned"]')).toHaveText('yes', { timeout: 2_000 });
  await expect(row(second, target.id).locator('td[data-col="schedulable"]')).toHaveText('no');
  await expect(first.locator('[data-fact="Cordoned"]')).toContainText('rack move');
  await first.getByRole('button', { name: 'Close' }).click();
  await expect(first.getByTestId('action-uncordon')).toBeVisible();
  await first.getByTestId('action-uncordon').click();
  await first.getByTestId('action-confirm').click();
  await expect(row(second, target.id).locator('td[data-col="cordoned"]')).toHaveText('no');
  await first.context().close();
  await second.context().close();
});

test('a conflict shows what changed and retries with the current version', async ({ page }) => {
  const target = (await nodes(fleet))[1];
  await signIn(page, fleet);
  await page.goto(`${fleet.url}/nodes/${target.id}`);
  await page.getByTestId('action-taint').click();
  await page.getByTestId('action-key').fill('gpu-burn');

  // Someone else cordons the node while the dialog is open.
  const before = await node(fleet, target.id);
  await mutate(fleet, `mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "elsewhere"}) { node { version } } }`, {
    id: target.id,
    v: before.version,
  });

  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('0 done, 1 changed since you looked, 0 failed.');
  await expect(page.getByTestId('conflict-change').first()).toHaveText('Cordoned: no → yes');
  await page.screenshot({ path: screenshotPath('conflict'), fullPage: true });

  await page.getByTestId('retry-conflicts').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();
  await expect(page.locator('[data-testid="taint"][data-key="gpu-burn"]')).toBeVisible();
  await expect(page.locator('[data-testid="reason-row"][data-reason="taint:gpu-burn"]')).toBeVisible();

  // Untaint from the chip, and the reason goes.
  await page.locator('[data-testid="taint"][data-key="gpu-burn"]').getByTestId('untaint').click();
  await page.getByTestId('action-confirm').click();
  await page.getByRole('button', { name: 'Close' }).click();
  await expect(page.locator('[data-testid="taint"][data-key="gpu-burn"]')).toHaveCount(0);
});

test('bulk actions on a selection; one node that changed meanwhile is named and retried', async ({ page }) => {
  await signIn(page, fleet);
  const all = await nodes(fleet);
  const picked = all.slice(2, 5);
  for (const n of picked) await row(page, n.id).locator('input[type="checkbox"]').check();
  await expect(page.getByTestId('selection-count')).toHaveText('3 selected');

  await page.getByTestId('bulk-label').click();
  await page.getByTestId('action-set-labels').fill('rack=r7');
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('3 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();
  // The operator looks again once the table shows the labelled nodes: the live feed brings
  // their new versions (on a loaded machine, after the dialog closed). A dialog opened before
  // that would rightly call all three "changed since you looked".
  for (const n of picked) {
    const { version } = await node(fleet, n.id);
    await expect(row(page, n.id)).toHaveAttribute('data-version', String(version));
  }

  // Drain all three, but one is cordoned elsewhere after the dialog opened.
  await page.getByTestId('bulk-drain').click();
  await page.getByTestId('action-reason').fill('firmware update');
  const changed = await node(fleet, picked[1].id);
  await mutate(fleet, `mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "elsewhere"}) { node { version } } }`, {
    id: changed.id,
    v: changed.version,
  });
  await page.getByTestId('action-confirm').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('2 done, 1 changed since you looked, 0 failed.');
  await expect(page.getByTestId('conflict')).toHaveCount(1);
  await expect(page.getByTestId('conflict')).toContainText(changed.hostname);
  await expect(page.getByTestId('conflict')).toContainText('Cordoned: no → yes');
  await page.getByTestId('retry-conflicts').click();
  await expect(page.getByTestId('outcome-summary')).toHaveText('1 done, 0 changed since you looked, 0 failed.');
  await page.getByRole('button', { name: 'Close' }).click();

  // A drain on a node that runs nothing ends at the drain controller's next tick
  // (`node.drained`): the cordon stays, and the history shows the drain.
  for (const n of picked) {
    const drained = await fleet.graphql(`query($id: ID!) { node(id: $id) { cordoned events(first: 50) { nodes { type } } } }`, { id: n.id });
    expect(drained.data.node.cordoned).toBe(true);
    expect(drained.data.node.events.nodes.map((e: { type: string }) => e.type)).toContain('node.drain_started');
  }
  const labelled = await fleet.graphql(`{ nodes(first: 100, filter: {labels: [{key: "rack", value: "r7"}]}) { totalCount } }`);
  expect(labelled.data.nodes.totalCount).toBe(3);
});
