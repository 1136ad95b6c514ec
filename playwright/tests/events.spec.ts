// The fleet's event log page (issue 15, item 8): every event, filtered by node, type, actor and
// time, a page at a time, live, with links to the nodes (and to a node as of a change).
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { mutate, node, nodes, signIn, waitForNodes } from './helpers';

let fleet: Fleet;
let actor: string;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 3 });
  await waitForNodes(fleet, 3, (n) => n.schedulable);
  actor = `user:${(await fleet.graphql('{ viewer { subject } }')).data.viewer.subject}`;
});
test.afterAll(async () => {
  await fleet?.stop();
});

async function label(id: string, value: string) {
  const current = await node(fleet, id);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!, $value: String!) { labelNode(input: {id: $id, version: $v, set: [{key: "step", value: $value}]}) { node { version } } }', {
    id,
    v: current.version,
    value,
  });
}

async function openLog(page: import('@playwright/test').Page) {
  await signIn(page, fleet);
  await page.getByRole('navigation').getByRole('link', { name: 'Events', exact: true }).click();
  await expect(page.getByTestId('event-live')).toHaveText('live');
}

test('the log lists the fleet, a page at a time, and follows new events live', async ({ page }) => {
  const [first] = await nodes(fleet);
  // More than one page (50) of events.
  let total = (await fleet.graphql('{ events(first: 1) { totalCount } }')).data.events.totalCount;
  for (let i = 0; total < 60; i++, total++) await label(first.id, `fill-${i}`);

  await openLog(page);
  const rows = page.getByTestId('log-row');
  await expect(rows).toHaveCount(50);
  await expect(page.getByTestId('event-count')).toContainText('50 of');
  await page.getByTestId('event-more').click();
  await expect.poll(async () => rows.count()).toBeGreaterThan(50);

  // A change anywhere arrives on top, without a reload.
  await label(first.id, 'live');
  await expect(rows.first()).toHaveAttribute('data-type', 'node.label_set');
  await expect(rows.first()).toHaveAttribute('data-actor', actor);
  await expect(rows.first()).toContainText('step=live');
  await page.screenshot({ path: screenshotPath('event-log'), fullPage: false });

  // Its node link leads to the node's page.
  await rows.first().getByTestId('log-node').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);
});

test('filters: node, type, actor and time; live events obey them', async ({ page }) => {
  const [first, second] = await nodes(fleet);
  await openLog(page);
  const rows = page.getByTestId('log-row');

  // One node, by hostname.
  await page.getByTestId('log-filter-node').fill(second.hostname);
  await page.getByTestId('log-filter-apply').click();
  await expect(rows.first()).toBeVisible();
  for (const n of await rows.evaluateAll((els) => els.map((e) => e.getAttribute('data-node')))) {
    expect(n).toBe(second.id);
  }
  // A change to another node does not appear; one to this node does.
  await label(first.id, 'elsewhere');
  await label(second.id, 'here');
  await expect(rows.first()).toContainText('step=here');
  await expect(page.locator(`[data-testid="log-row"][data-node="${first.id}"]`)).toHaveCount(0);

  // Types and actor: cordons by this operator, across the fleet.
  await page.getByTestId('log-filter-node').fill('');
  await page.getByTestId('log-filter-types').selectOption(['NODE_CORDONED', 'NODE_UNCORDONED']);
  await page.getByTestId('log-filter-actor').fill(actor);
  await page.getByTestId('log-filter-apply').click();
  await expect(page.getByTestId('event-empty')).toBeVisible();
  const current = await node(fleet, first.id);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "log filter"}) { node { version } } }', {
    id: first.id,
    v: current.version,
  });
  await expect(rows).toHaveCount(1);
  await expect(rows.first()).toHaveAttribute('data-type', 'node.cordoned');
  await expect(rows.first()).toHaveAttribute('data-actor', actor);
  await label(first.id, 'not-a-cordon');
  await page.waitForTimeout(1_000);
  await expect(rows).toHaveCount(1);

  // The "as of" link: the node right after the cordon, as a past view.
  await rows.first().getByTestId('log-as-of').click();
  await expect(page.getByTestId('past-view')).toBeVisible();
  await expect(page.locator('dd[data-fact="Cordoned"]')).toContainText('yes: log filter');

  // Time: nothing after a day from now; everything before it.
  await page.getByRole('navigation').getByRole('link', { name: 'Events', exact: true }).click();
  await page.getByTestId('log-filter-since').fill('2099-01-01T00:00');
  await page.getByTestId('log-filter-apply').click();
  await expect(page.getByTestId('event-empty')).toBeVisible();
  await page.getByTestId('log-filter-since').fill('');
  await page.getByTestId('log-filter-until').fill('2099-01-01T00:00');
  await page.getByTestId('log-filter-apply').click();
  await expect(rows.first()).toBeVisible();

  // Reset: every event again; an unknown node is refused in words.
  await page.getByTestId('log-filter-reset').click();
  await expect(rows).toHaveCount(50);
  await page.getByTestId('log-filter-node').fill('no-such-host');
  await page.getByTestId('log-filter-apply').click();
  await expect(page.getByTestId('log-filter-error')).toHaveText('No node is called no-such-host.');
});
