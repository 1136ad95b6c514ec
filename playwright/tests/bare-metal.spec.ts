// Bare metal on the dashboard. The enrol form on a fleet with one Redfish pool and no machine:
// a BMC address the server refuses shows its typed error beside the field and creates nothing;
// an enrolment of a BMC that does not answer opens the new node's page, `enrolling`, its power
// unknown and its BMC unreachable once the Power controller has tried it; an inspection
// started from the panel is aborted with a reason; an ordinary node's page has no bare-metal
// panel. Then `dev --sim-metal 2`: a simulated machine's page shows its
// workflows' steps and logs as they progress, live, until it is `ready`, and powers it off and
// on again.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { mutate, nodes, signIn } from './helpers';
import type { Page } from '@playwright/test';
import net from 'node:net';

const PASSWORD = 's3cret-Redfish-pass';
// Nothing listens on the discard port: the BMC refuses every connection at once.
const SILENT_BMC = 'https://127.0.0.1:9';

/** Fills the enrol form (the one bare-metal site and its pool are chosen already). */
async function fillEnrolForm(page: Page, hostname: string, address: string) {
  await page.getByTestId('enrol-hostname').fill(hostname);
  await page.getByTestId('enrol-address').fill(address);
  await page.getByTestId('enrol-username').fill('admin');
  await page.getByTestId('enrol-password').fill(PASSWORD);
}

/** The password is in its input and nowhere else the browser keeps: not the address bar, not storage. */
async function expectPasswordNotKept(page: Page) {
  expect(page.url()).not.toContain(PASSWORD);
  const kept = await page.evaluate(() => JSON.stringify({ ...localStorage, ...sessionStorage }));
  expect(kept).not.toContain(PASSWORD);
}

test.describe('enrolment by BMC', () => {
  let fleet: Fleet;
  test.beforeAll(async () => {
    fleet = await startFleet({ sim: 0 });
    const { createSite } = await mutate(
      fleet,
      `mutation($input: CreateSiteInput!) { createSite(input: $input) { site { id } } }`,
      { input: { name: 'lab', kind: 'PLATFORM' } },
    );
    await mutate(fleet, `mutation($input: CreatePoolInput!) { createPool(input: $input) { pool { id } } }`, {
      input: {
        siteId: createSite.site.id,
        name: 'lab-metal',
        kind: 'METAL_HOST',
        drivers: [{ key: 'power', value: 'redfish' }],
      },
    });
    // A pool without a power driver is no place for a machine enrolled by its BMC.
    await mutate(fleet, `mutation($input: CreatePoolInput!) { createPool(input: $input) { pool { id } } }`, {
      input: { siteId: createSite.site.id, name: 'lab-daemons', kind: 'METAL_HOST' },
    });
  });
  test.afterAll(async () => {
    await fleet?.stop();
  });

  test('a BMC address that is not https is refused beside the field, and nothing is created', async ({ page }) => {
    await signIn(page, fleet);
    await page.getByRole('link', { name: 'Enrol' }).click();
    await expect(page.getByTestId('enrol-site')).toHaveValue(/^site_/);
    // Only the Redfish pool is offered, and being the site's only one it is chosen.
    const pool = page.getByTestId('enrol-pool');
    await expect(pool.locator('option')).toHaveText(['Choose…', 'lab-metal']);
    await expect(pool).toHaveValue(/^pool_/);

    await fillEnrolForm(page, 'metal-lab-1', 'http://127.0.0.1:9');
    await page.getByTestId('enrol-submit').click();
    const refusal = page.locator('[data-testid="field-error"][data-field="address"]');
    await expect(refusal).toHaveAttribute('data-code', 'BAD_USER_INPUT');
    await expect(refusal).toContainText('is plain http');

    await page.getByTestId('enrol-address').fill('garbage');
    await page.getByTestId('enrol-submit').click();
    await expect(refusal).toContainText('is not a URL');
    await expect(page.getByTestId('enrol')).toBeVisible();
    await page.screenshot({ path: screenshotPath('bare-metal-enrol-refused'), fullPage: true });

    // The form's own check: one kind of identifier cannot tell machines apart.
    await page.getByTestId('enrol-address').fill(SILENT_BMC);
    await page.getByTestId('enrol-macs').fill('3c:ec:ef:00:12:34');
    await page.getByTestId('enrol-submit').click();
    await expect(page.locator('[data-testid="field-error"][data-field="identifiers"]')).toContainText(
      'at least two kinds',
    );
    await expect(refusal).toHaveCount(0);

    expect(await nodes(fleet)).toEqual([]);
    await expectPasswordNotKept(page);
  });

  test('an enrolled machine whose BMC does not answer is enrolling, power unknown, BMC unreachable', async ({ page }) => {
    await signIn(page, fleet);
    await page.getByRole('link', { name: 'Enrol' }).click();
    await expect(page.getByTestId('enrol-pool')).toHaveValue(/^pool_/);
    await fillEnrolForm(page, 'metal-lab-2', SILENT_BMC);
    await page.getByTestId('enrol-tls').selectOption({ label: 'Do not check (labs only)' });
    await page.getByTestId('enrol-macs').fill('3c:ec:ef:00:12:34, 3c:ec:ef:00:12:35');
    await page.getByTestId('enrol-serial').fill('LAB-0002');
    await page.getByTestId('enrol-submit').click();

    await expect(page).toHaveURL(/\/nodes\/node_/);
    await expect(page.getByTestId('node-hostname')).toHaveText('metal-lab-2');
    await expect(page.locator('[data-fact="Provision state"]')).toHaveText('enrolling');
    const panel = page.getByTestId('bare-metal');
    await expect(panel.getByTestId('power-state')).toHaveAttribute('data-power', 'UNKNOWN');
    await expect(panel.getByTestId('bmc-address')).toContainText(SILENT_BMC);
    await expect(panel).toContainText('certificate not checked');
    await expect(panel.getByTestId('no-workflow')).toBeVisible();
    // The Power controller tries the BMC at its next tick (5 s): refused, which no event
    // records yet (one failure is no outage), so the page reads it on its poll.
    const reachability = panel.getByTestId('bmc-reachable');
    await expect(reachability).toHaveAttribute('data-reachable', 'false', { timeout: 30_000 });
    await expect(reachability).toContainText('unreachable');
    await expect(panel.getByTestId('power-state')).toHaveText('power unknown');
    await expect(panel).not.toContainText(PASSWORD);
    await expectPasswordNotKept(page);
    await page.screenshot({ path: screenshotPath('bare-metal-enrolled'), fullPage: true });

    const [enrolled] = await nodes(fleet);
    expect(enrolled.hostname).toBe('metal-lab-2');
    expect(page.url()).toContain(enrolled.id);
  });

  test('inspection started from the panel is aborted with a reason, at the version shown', async ({ page }) => {
    // A BMC that accepts connections and never answers: each of the workflow's requests
    // waits for the BMC request timeout (10 s), so the inspection is still running when
    // the operator aborts it.
    const held: net.Socket[] = [];
    const silent = net.createServer((socket) => held.push(socket));
    await new Promise<void>((resolve) => silent.listen(0, '127.0.0.1', resolve));
    const port = (silent.address() as net.AddressInfo).port;
    try {
      await signIn(page, fleet);
      await page.getByRole('link', { name: 'Enrol' }).click();
      await expect(page.getByTestId('enrol-pool')).toHaveValue(/^pool_/);
      await fillEnrolForm(page, 'metal-lab-3', `https://127.0.0.1:${port}`);
      await page.getByTestId('enrol-submit').click();
      await expect(page.getByTestId('node-hostname')).toHaveText('metal-lab-3');
      const panel = page.getByTestId('bare-metal');

      // Enrolling: the panel offers the move that starts the inspection.
      const inspect = panel.locator('[data-testid="provision-move"][data-move="INSPECT"]');
      await inspect.click();
      const version = Number((await page.getByTestId('node-version').textContent())!.replace('version ', ''));
      await expect(page.getByTestId('move-confirm')).toHaveText(`Inspect at version ${version}`);
      await page.getByTestId('move-confirm').click();
      await expect(page.getByTestId('move-dialog')).toHaveCount(0);

      const workflow = panel.getByTestId('workflow');
      await expect(workflow).toHaveAttribute('data-kind', 'INSPECT');
      await expect(workflow).toHaveAttribute('data-status', 'RUNNING');
      await expect(page.locator('[data-fact="Provision state"]')).toHaveText('inspecting');
      await expect(workflow.getByTestId('workflow-step').first()).toHaveAttribute('data-kind', 'BOOT_NETWORK_ONCE');
      await expect(panel.getByTestId('provision-move')).toHaveCount(0);

      await panel.getByTestId('workflow-abort').click();
      // No reason, no abort.
      await page.getByTestId('abort-confirm').click();
      await expect(page.getByTestId('abort-error')).toContainText('Say why');
      await page.getByTestId('abort-reason').fill('wrong rack, cabling first');
      await page.screenshot({ path: screenshotPath('bare-metal-abort'), fullPage: true });
      await page.getByTestId('abort-confirm').click();
      await expect(page.getByTestId('abort-dialog')).toHaveCount(0);

      await expect(workflow).toHaveAttribute('data-status', 'ABORTED');
      await expect(panel.getByTestId('workflow-summary')).toContainText('wrong rack, cabling first');
      await expect(page.locator('[data-fact="Provision state"]')).toHaveText('failed (from inspecting)');
      await expect(page.locator('[data-fact="Maintenance"]')).toContainText('yes');
      // Failed: recovering starts the inspection over.
      await expect(panel.locator('[data-testid="provision-move"][data-move="RECOVER"]')).toBeVisible();
    } finally {
      for (const socket of held) socket.destroy();
      await new Promise((resolve) => silent.close(resolve));
    }
  });

  test('an ordinary node has no bare-metal panel', async ({ page }) => {
    const site = await fleet.graphql(`{ sites { nodes { id name } } }`);
    const siteId = site.data.sites.nodes.find((s: any) => s.name === 'lab').id;
    const { enrollNode } = await mutate(
      fleet,
      `mutation($input: EnrollNodeInput!) { enrollNode(input: $input) { node { id } } }`,
      { input: { hostname: 'plain-1', siteId } },
    );
    await signIn(page, fleet);
    await page.goto(`${fleet.url}/nodes/${enrollNode.node.id}`);
    await expect(page.getByTestId('node-hostname')).toHaveText('plain-1');
    await expect(page.getByTestId('event-row').first()).toBeVisible();
    // Its bare-metal view was read (and says no driver, no BMC) by now; give it a moment more.
    await page.waitForTimeout(1_500);
    await expect(page.getByTestId('bare-metal')).toHaveCount(0);
  });
});

test.describe('simulated bare-metal machines', () => {
  const MACHINES = 2;
  let fleet: Fleet;
  test.beforeAll(async () => {
    fleet = await startFleet({ sim: 0, simMetal: MACHINES });
  });
  test.afterAll(async () => {
    await fleet?.stop();
  });

  test('a machine walks its workflows to ready live, and powers off and on', async ({ page }) => {
    test.setTimeout(300_000);
    let id = '';
    await expect
      .poll(async () => (id = (await nodes(fleet)).find((n) => n.hostname === 'metal-0001')?.id ?? ''), {
        timeout: 60_000,
      })
      .not.toBe('');

    await signIn(page, fleet);
    await page.goto(`${fleet.url}/nodes/${id}`);
    await expect(page.getByTestId('node-hostname')).toHaveText('metal-0001');
    const panel = page.getByTestId('bare-metal');
    await expect(panel).toBeVisible();
    await expect(panel.getByTestId('bmc-address')).toContainText('https://');

    // The workflows progress on the page, never reloaded: steps succeed one after another,
    // each with its log.
    const workflow = panel.getByTestId('workflow');
    await expect(workflow.getByTestId('workflow-step').first()).toBeVisible({ timeout: 60_000 });
    await expect(workflow.locator('[data-testid="workflow-step"][data-status="SUCCEEDED"]').first()).toBeVisible({
      timeout: 120_000,
    });
    await expect(workflow.getByTestId('workflow-log-line').first()).toBeVisible();

    await expect(page.locator('[data-fact="Provision state"]')).toHaveText('ready', { timeout: 240_000 });
    await expect(workflow).toHaveAttribute('data-kind', 'COMMISSION');
    await expect(workflow).toHaveAttribute('data-status', 'SUCCEEDED');
    await expect(workflow.locator('[data-testid="workflow-step"]:not([data-status="SUCCEEDED"])')).toHaveCount(0);
    await expect(panel.locator('[data-testid="past-workflow"][data-kind="INSPECT"]')).toHaveAttribute(
      'data-status',
      'SUCCEEDED',
    );
    await expect(panel.getByTestId('bmc-reachable')).toHaveAttribute('data-reachable', 'true');
    const power = panel.getByTestId('power-state');

    // Commissioning ends by powering the machine off. Powered on, off and on again from the
    // panel; the page follows each as the Power controller reads it through the BMC.
    await expect(power).toHaveAttribute('data-power', 'OFF');
    await page.screenshot({ path: screenshotPath('bare-metal-ready'), fullPage: true });
    await panel.getByTestId('power-on').click();
    await expect(power).toHaveAttribute('data-power', 'ON', { timeout: 60_000 });
    await expect(power).toHaveText('power on');
    await panel.getByTestId('power-off').click();
    await expect(power).toHaveAttribute('data-power', 'OFF', { timeout: 60_000 });
    await expect(power).toHaveText('power off');
    await panel.getByTestId('power-on').click();
    await expect(power).toHaveAttribute('data-power', 'ON', { timeout: 60_000 });
    await expect(panel.getByTestId('bare-metal-error')).toHaveCount(0);
  });
});
