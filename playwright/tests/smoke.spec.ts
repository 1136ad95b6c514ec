// The dashboard opens from the sign-in link `dev` prints, on a fleet of three nodes.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 3 });
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('the sign-in link opens the dashboard', async ({ page }) => {
  await expect
    .poll(async () => (await fleet.graphql('{ nodes(first: 10) { totalCount } }')).data?.nodes?.totalCount)
    .toBe(3);
  await page.goto(fleet.signInUrl);
  await expect(page).toHaveTitle(/Better Compute/);
  await page.screenshot({ path: screenshotPath('smoke'), fullPage: true });
});
