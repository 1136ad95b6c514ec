// Leaving a node page, for every other page and for another node, while its live feeds and
// rereads are still running, and resizing the window after leaving the fleet page (issue 15, item 7: this panicked with "Tried to access a reactive
// value that has already been disposed"). The fixture fails the test on any page error or
// console error, which is how the panic shows.
import type { Page } from '@playwright/test';
import { test, expect } from './fixtures';
import { startFleet, type Fleet } from '../fleet';
import { mutate, nodes, row, signIn, waitForNodes } from './helpers';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 3 });
  // Settled: the tests change nodes at the version they read, and a node coming up is
  // changed by the server (inventory, acceptance, its first spec) within a second.
  await waitForNodes(fleet, 3, (n) => n.schedulable);
});
test.afterAll(async () => {
  await fleet?.stop();
});

/** Follows a link inside the app, as a click on one on the page would. */
async function followLink(page: Page, href: string) {
  await page.evaluate((href) => {
    const link = document.createElement('a');
    link.href = href;
    document.body.appendChild(link);
    link.click();
    link.remove();
  }, href);
}

/** Changes a node through the API: its events reach any page still following it. */
async function cordon(id: string, reason: string) {
  const [current] = (await nodes(fleet)).filter((n) => n.id === id);
  const op = current.cordoned
    ? 'mutation($id: ID!, $v: Int!) { uncordonNode(input: {id: $id, version: $v}) { node { version } } }'
    : `mutation($id: ID!, $v: Int!) { cordonNode(input: {id: $id, version: $v, reason: "${reason}"}) { node { version } } }`;
  await mutate(fleet, op, { id, v: current.version });
}

test('leaving a node page for any other page, mid-update, does not panic', async ({ page }) => {
  const [first, second] = await nodes(fleet);
  await signIn(page, fleet);
  for (const label of ['Fleet', 'Capacity', 'Reservations']) {
    await row(page, first.id).getByRole('link').click();
    await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);
    // A change the page is about to reread, and the page left before the reread lands.
    await cordon(first.id, `leaving for ${label}`);
    await page.getByRole('navigation').getByRole('link', { name: label, exact: true }).click();
    await expect(page.getByTestId('node-hostname')).toHaveCount(0);
    // Changes after the page is gone: a feed that outlived its page would deliver them.
    await cordon(first.id, `after leaving for ${label}`);
    await page.waitForTimeout(1_500);
    if (label !== 'Fleet') {
      await page.getByRole('navigation').getByRole('link', { name: 'Fleet', exact: true }).click();
    }
  }

  // Leaving while the page's own action is in flight: its task finishes after the page is gone.
  await row(page, second.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(second.hostname);
  await page.getByTestId('action-cordon').click();
  await page.getByTestId('action-reason').fill('leaving at once');
  await page.getByTestId('action-confirm').click();
  // The dialog covers the page until it is closed; the browser's back button does not wait.
  await page.goBack();
  await expect(page.getByTestId('node-hostname')).toHaveCount(0);
  await expect.poll(async () => (await nodes(fleet)).find((n) => n.id === second.id)?.cordoned).toBe(true);
  await page.waitForTimeout(1_500);

  // From one node's page straight to another's (the same route, new parameters), and back,
  // all inside the app (the router follows any link's click and the history).
  await row(page, first.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);
  await followLink(page, `/nodes/${second.id}`);
  await expect(page.getByTestId('node-hostname')).toHaveText(second.hostname);
  await cordon(first.id, 'after switching nodes');
  await page.goBack();
  await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);
  await page.goForward();
  await expect(page.getByTestId('node-hostname')).toHaveText(second.hostname);
  await page.waitForTimeout(1_500);
});

test('resizing the window after leaving the fleet page does not panic', async ({ page }) => {
  // The fleet page measures its table on every resize; its listener must leave with it (a
  // full-page screenshot of the node page resized the window and panicked).
  const [first] = await nodes(fleet);
  await signIn(page, fleet);
  await row(page, first.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);
  await page.setViewportSize({ width: 900, height: 700 });
  await page.setViewportSize({ width: 1280, height: 720 });
  await page.getByRole('navigation').getByRole('link', { name: 'Fleet', exact: true }).click();
  await expect(row(page, first.id)).toBeVisible();
  await page.setViewportSize({ width: 1000, height: 600 });
  await expect(row(page, first.id)).toBeVisible();
});

test('labels the inventory sets have no remove button; an operator label has one', async ({ page }) => {
  const [first] = await nodes(fleet);
  await mutate(fleet, 'mutation($id: ID!, $v: Int!) { labelNode(input: {id: $id, version: $v, set: [{key: "team", value: "ml"}]}) { node { version } } }', {
    id: first.id,
    v: first.version,
  });
  await signIn(page, fleet);
  await row(page, first.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(first.hostname);

  const mine = page.locator('[data-testid="label"][data-key="team"]');
  await expect(mine).toHaveText(/team=ml/);
  await expect(mine.locator('button.chip-x')).toHaveCount(1);

  const owned = page.locator('[data-testid="label"][data-owner="inventory"]');
  await expect(owned.first()).toBeVisible();
  await expect(owned.first()).toHaveAttribute('title', /set by inventory/);
  await expect(owned.locator('button.chip-x')).toHaveCount(0);
});
