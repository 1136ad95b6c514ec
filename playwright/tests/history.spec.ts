// A node's history (issue 15, item 8): a timeline per axis, condition and reason with who
// changed what, a time slider and clicks on changes that show the node as it was (nodeAsOf),
// clearly marked as a past view, and the way back to live.
import type { Locator } from '@playwright/test';
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { mutate, node, nodes, row, signIn, waitForNodes } from './helpers';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 2 });
  await waitForNodes(fleet, 2, (n) => n.schedulable);
});
test.afterAll(async () => {
  await fleet?.stop();
});

/** Moves the slider to `at` (ms since the epoch) and lets go, as a drag would end. */
async function slideTo(slider: Locator, at: number) {
  const start = Number(await slider.getAttribute('data-start'));
  const end = Number(await slider.getAttribute('data-end'));
  const position = Math.round(((at - start) / (end - start)) * 1000);
  await slider.evaluate((el, value) => {
    const input = el as HTMLInputElement;
    input.value = String(value);
    input.dispatchEvent(new Event('input', { bubbles: true }));
    input.dispatchEvent(new Event('change', { bubbles: true }));
  }, position);
}

test('the timeline shows each axis over time, and the node as of any moment', async ({ page }) => {
  const [target] = await nodes(fleet);
  const viewer = (await fleet.graphql('{ viewer { subject } }')).data.viewer.subject;
  // History to look at: a cordon that holds a few seconds, then an uncordon. The node lives
  // a while first, so that the moment the slider goes back to below (a second before the
  // cordon) is in its life: a fleet of two is schedulable about a second after it joins.
  await new Promise((resolve) => setTimeout(resolve, 3_000));
  let current = await node(fleet, target.id);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "history check"}) { node { version } } }', {
    id: target.id,
    v: current.version,
  });
  const cordonedAt = Date.now();
  await new Promise((resolve) => setTimeout(resolve, 3_000));
  current = await node(fleet, target.id);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }', {
    id: target.id,
    v: current.version,
  });
  const live = await node(fleet, target.id);

  await signIn(page, fleet);
  await row(page, target.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(target.hostname);

  // A lane per axis, and the cordon as a segment by the operator who set it.
  const lanes = page.getByTestId('history-lanes');
  for (const axis of ['provisionState', 'maintenance', 'cordoned', 'connectivity']) {
    await expect(lanes.locator(`[data-testid="lane"][data-lane="${axis}"]`)).toBeVisible();
  }
  const cordonedLane = lanes.locator('[data-lane="cordoned"]');
  const cordonSegment = cordonedLane.locator('[data-testid="segment"][data-value="true"]');
  await expect(cordonSegment).toHaveCount(1);
  await expect(cordonSegment).toHaveAttribute('data-actor', `user:${viewer}`);
  await expect(cordonSegment).toHaveAttribute('title', /node\.cordoned by user:/);
  await expect(cordonedLane.locator('[data-testid="segment"][data-value="false"]').last()).toHaveAttribute('data-actor', `user:${viewer}`);
  await expect(page.getByTestId('past-view')).toHaveCount(0);

  // A click on the change: the node right after it, marked as the past.
  await cordonSegment.click();
  await expect(page.getByTestId('past-view')).toBeVisible();
  await expect(page.getByTestId('past-moment')).toContainText('version');
  await expect(page.getByTestId('node-version')).toContainText('(past)');
  await expect(page.locator('dd[data-fact="Cordoned"]')).toContainText('yes: history check');
  await expect(page.getByTestId('action-cordon')).toHaveCount(0);
  await expect(page.getByTestId('action-uncordon')).toHaveCount(0);
  await page.screenshot({ path: screenshotPath('node-history-past'), fullPage: true });

  // Back to live: the node as it is.
  await page.getByTestId('back-to-live').click();
  await expect(page.getByTestId('past-view')).toHaveCount(0);
  await expect(page.getByTestId('node-version')).toHaveText(`version ${live.version}`);
  await expect(page.locator('dd[data-fact="Cordoned"]')).toHaveText('no');

  // The slider: a moment inside the cordon, then one before it.
  const slider = page.getByTestId('time-slider');
  await slideTo(slider, cordonedAt + 1_500);
  await expect(page.getByTestId('past-view')).toBeVisible();
  await expect(page.locator('dd[data-fact="Cordoned"]')).toContainText('yes: history check');
  await expect(page.getByTestId('slider-moment')).not.toHaveText('now');
  await slideTo(slider, cordonedAt - 1_000);
  await expect(page.locator('dd[data-fact="Cordoned"]')).toHaveText('no');
  await expect(page.getByTestId('node-version')).toContainText('(past)');

  // A change in the table below: the node right after it.
  const uncordonRow = page.locator('[data-testid="event-row"][data-type="node.uncordoned"]');
  await uncordonRow.getByTestId('event-as-of').click();
  await expect(page.locator('dd[data-fact="Cordoned"]')).toHaveText('no');
  await expect(uncordonRow).toHaveClass(/picked/);

  // Live changes while the past is shown do not replace it.
  current = await node(fleet, target.id);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!) { labelNode(input: {id: $id, version: $v, set: [{key: "team", value: "history"}]}) { node { version } } }', {
    id: target.id,
    v: current.version,
  });
  await expect(page.locator('[data-testid="event-row"][data-type="node.label_set"]').filter({ hasText: 'team=history' })).toHaveCount(1);
  await expect(page.getByTestId('past-view')).toBeVisible();
  await page.getByTestId('back-to-live').click();
  await expect(page.getByTestId('node-version')).toHaveText(`version ${current.version + 1}`);

  // Leaving from a past view does not panic (the fixture watches the console).
  await slideTo(slider, cordonedAt + 1_500);
  await expect(page.getByTestId('past-view')).toBeVisible();
  await page.getByRole('navigation').getByRole('link', { name: 'Fleet', exact: true }).click();
  await expect(row(page, target.id)).toBeVisible();
});

test('a link with ?version= opens the node as of that version', async ({ page }) => {
  const [, other] = await nodes(fleet);
  await signIn(page, fleet);
  await page.goto(`${fleet.url}/nodes/${other.id}?version=1`);
  await expect(page.getByTestId('past-view')).toBeVisible();
  await expect(page.getByTestId('node-version')).toHaveText('version 1 (past)');
  await page.getByTestId('back-to-live').click();
  await expect(page.getByTestId('node-version')).toHaveText(`version ${(await node(fleet, other.id)).version}`);
});
