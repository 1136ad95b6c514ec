// The reservations page on `dev --sim 3` (24 GPUs): a reservation created in the form waits
// for capacity and is placed live when it frees up; releasing from the list; the filters; and
// a release that meets a move of the reservation shows what moved and retries.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { signIn, waitForNodes } from './helpers';
import {
  GPUS_PER_NODE,
  release,
  reservation,
  reservationRow,
  reserve,
  tenantOfDevPool,
  waitForState,
} from './placement';

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

test('a reservation created in the form waits, is placed live, and is released from the list', async ({ page }) => {
  // Two of the three nodes are taken: a gang of two whole nodes must wait.
  const blocker = await reserve(fleet, tenantId, { gpusPerNode: GPUS_PER_NODE, nodeCount: 2 });
  expect(blocker.state).toBe('PLACED');

  await signIn(page, fleet);
  await page.getByRole('link', { name: 'Reservations' }).click();
  await expect(page.getByTestId('reservations-live')).toHaveText('live');
  await expect(reservationRow(page, blocker.id)).toHaveAttribute('data-state', 'PLACED');

  await page.getByTestId('reservation-new').click();
  const dialog = page.getByTestId('reservation-dialog');
  await dialog.getByTestId('reservation-tenant').selectOption({ label: 'acme' });
  await dialog.getByTestId('reservation-pool').selectOption({ label: 'dev-gpu' });
  await dialog.getByTestId('reservation-gpus').fill(String(GPUS_PER_NODE));
  await dialog.getByTestId('reservation-nodes').fill('2');
  await dialog.getByTestId('reservation-policy').selectOption({ label: 'spread (emptiest node first)' });
  await dialog.getByTestId('reservation-tolerations').fill('gpu-burn');
  await dialog.getByTestId('reservation-expires').fill('2');
  await dialog.getByTestId('reservation-expires-unit').selectOption({ label: 'hours' });
  await dialog.getByTestId('reservation-create').click();

  const created = dialog.getByTestId('reservation-created');
  await expect(created).toHaveAttribute('data-state', 'PENDING');
  const id = (await created.getAttribute('data-reservation'))!;
  await expect(created).toContainText(`${id} is pending`);
  await dialog.getByRole('button', { name: 'Close' }).click();

  const row = reservationRow(page, id);
  await expect(row).toHaveAttribute('data-state', 'PENDING');
  await expect(row.locator('td[data-col="tenant"]')).toHaveText('acme');
  await expect(row.locator('td[data-col="pool"]')).toHaveText('dev-gpu');
  await expect(row.locator('td[data-col="shape"]')).toHaveText(`2 × ${GPUS_PER_NODE} GPUs`);
  await expect(row.locator('td[data-col="policy"]')).toHaveText('spread');
  await expect(row.locator('td[data-col="reason"]')).not.toBeEmpty();
  const stored = await fleet.graphql(`query($id: ID!) { reservation(id: $id) { tolerations expiresAt policy } }`, { id });
  expect(stored.data.reservation.tolerations).toEqual(['gpu-burn']);
  expect(stored.data.reservation.policy).toBe('SPREAD');
  const expiresIn = Date.parse(stored.data.reservation.expiresAt) - Date.now();
  expect(expiresIn).toBeGreaterThan(110 * 60_000);
  expect(expiresIn).toBeLessThanOrEqual(120 * 60_000);

  // Capacity frees up elsewhere: the page, never reloaded, shows the gang placed.
  await release(fleet, blocker.id);
  await expect(reservationRow(page, blocker.id)).toHaveAttribute('data-state', 'RELEASED');
  await expect(row).toHaveAttribute('data-state', 'PLACED', { timeout: 30_000 });
  await expect(row.locator('td[data-col="state"]')).toHaveText('placed');
  await expect(row.locator('td[data-col="nodes"] a')).toHaveCount(2);
  await page.screenshot({ path: screenshotPath('reservations'), fullPage: true });

  // Released from the list, at the version shown.
  await row.getByTestId('reservation-release').click();
  await page.getByTestId('release-confirm').click();
  await expect(page.getByTestId('release-outcome')).toHaveText(`${id} is released.`);
  await page.getByTestId('release-dialog').getByRole('button', { name: 'Close' }).click();
  await expect(row).toHaveAttribute('data-state', 'RELEASED');
  await expect(row.getByTestId('reservation-release')).toHaveCount(0);
  expect((await reservation(fleet, id)).state).toBe('RELEASED');
});

test('filters by state and pool, kept live', async ({ page }) => {
  const placed = await reserve(fleet, tenantId, { gpusPerNode: 1 });
  expect(placed.state).toBe('PLACED');
  await signIn(page, fleet);
  await page.goto(`${fleet.url}/reservations`);
  await expect(page.getByTestId('reservations-live')).toHaveText('live');
  const rows = page.getByTestId('reservation-row');
  const count = page.getByTestId('reservations-count');
  await expect(count).toHaveText('3 of 3 reservations');

  await page.getByTestId('filter-reservation-state').selectOption('PLACED');
  await expect(count).toHaveText('1 of 1 reservations');
  await expect(rows).toHaveCount(1);
  await expect(reservationRow(page, placed.id)).toBeVisible();
  // A reservation that leaves the filtered state leaves the list, live.
  await release(fleet, placed.id);
  await expect(rows).toHaveCount(0);
  await expect(page.getByTestId('reservations-empty')).toBeVisible();

  await page.getByTestId('filter-reservation-state').selectOption('RELEASED');
  await expect(count).toHaveText('3 of 3 reservations');
  await page.getByTestId('filter-reservation-pool').selectOption({ label: 'dev-gpu' });
  await expect(count).toHaveText('3 of 3 reservations');
  await page.getByTestId('filter-reservation-state').selectOption('FAILED');
  await expect(rows).toHaveCount(0);
  await page.getByTestId('filter-reservation-state').selectOption('');
  await expect(rows).toHaveCount(3);
});

test('a release that meets a move shows what changed, and retries at the current version', async ({ page }) => {
  const everything = await reserve(fleet, tenantId, { gpusPerNode: GPUS_PER_NODE, nodeCount: NODES });
  expect(everything.state).toBe('PLACED');
  const waiting = await reserve(fleet, tenantId, { gpusPerNode: GPUS_PER_NODE });
  expect(waiting.state).toBe('PENDING');

  await signIn(page, fleet);
  await page.goto(`${fleet.url}/reservations`);
  await reservationRow(page, waiting.id).getByTestId('reservation-release').click();
  await expect(page.getByTestId('release-dialog')).toContainText(`version ${waiting.version}`);

  // While the dialog is open the reservation is placed (a new version).
  await release(fleet, everything.id);
  await waitForState(fleet, waiting.id, 'PLACED');

  await page.getByTestId('release-confirm').click();
  const conflict = page.getByTestId('release-conflict');
  await expect(conflict).toBeVisible();
  await expect(conflict.getByTestId('conflict-change').first()).toHaveText('State: pending → placed');
  await page.screenshot({ path: screenshotPath('reservation-conflict'), fullPage: true });
  await page.getByTestId('release-retry').click();
  await expect(page.getByTestId('release-outcome')).toHaveText(`${waiting.id} is released.`);
  expect((await reservation(fleet, waiting.id)).state).toBe('RELEASED');
});
