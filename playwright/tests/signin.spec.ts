// Signing in: with a pasted token, with the link `dev` prints, refusing a forged token, and
// signing out.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { signIn } from './helpers';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 3 });
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('a pasted token signs in, and signing out returns to the form', async ({ page }) => {
  await page.goto(fleet.url);
  await expect(page).toHaveTitle(/Better Compute/);
  await page.getByTestId('token-input').fill(fleet.token);
  await page.screenshot({ path: screenshotPath('sign-in'), fullPage: true });
  await page.getByTestId('sign-in').click();
  await expect(page.getByTestId('who')).toContainText('dev-admin (admin)');
  await expect(page.getByTestId('live-state')).toHaveText('Live');

  // A reload stays signed in (the token is kept in local storage).
  await page.reload();
  await expect(page.getByTestId('who')).toContainText('dev-admin');

  await page.getByTestId('sign-out').click();
  await expect(page.getByTestId('token-input')).toBeVisible();
  await page.reload();
  await expect(page.getByTestId('token-input')).toBeVisible();
});

test('a forged token is refused with the server\'s reason', async ({ page, pageErrors }) => {
  // The refusal this test is about: the browser logs the 401 of the sign-in request.
  pageErrors.allow(/status of 401/);
  await page.goto(fleet.url);
  // The real token's header and claims with someone else's signature.
  const [header, claims] = fleet.token.split('.');
  await page.getByTestId('token-input').fill(`${header}.${claims}.c2lnbmVkIGJ5IHNvbWVvbmUgZWxzZQ`);
  await page.getByTestId('sign-in').click();
  await expect(page.getByTestId('sign-in-error')).toContainText('refused');
  await expect(page.getByTestId('who')).toHaveCount(0);
});

test('the link dev prints signs in and leaves no token in the address bar', async ({ page }) => {
  await signIn(page, fleet);
  await expect(page.getByTestId('who')).toContainText('dev-admin');
  expect(page.url()).not.toContain('token');
});
