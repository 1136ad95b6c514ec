// GraphiQL at /graphql: it signs in from a `#token=` link as the dashboard does, loads
// nothing from outside the server, introspects the schema with graphql-js's standard query
// (deeper than the API's own depth limit) and shows the schema's documentation.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 0 });
});
test.afterAll(async () => {
  await fleet?.stop();
});

test('GraphiQL signs in and shows the documentation of NodeDetail', async ({ page }) => {
  const elsewhere: string[] = [];
  page.on('request', (request) => {
    if (!request.url().startsWith(fleet.url)) elsewhere.push(request.url());
  });
  const introspected = page.waitForResponse(
    (response) =>
      response.url() === `${fleet.url}/graphql` &&
      response.request().method() === 'POST' &&
      (response.request().postData() ?? '').includes('__schema'),
  );

  await page.goto(`${fleet.url}/graphql#token=${fleet.token}`);
  // The token leaves the address bar at once.
  await expect.poll(() => page.url()).toBe(`${fleet.url}/graphql`);
  const introspection = await introspected;
  expect(introspection.status()).toBe(200);
  const answer = await introspection.json();
  expect(answer.errors).toBeUndefined();

  await page.getByRole('button', { name: 'Show Documentation Explorer' }).click();
  const docs = page.locator('.graphiql-doc-explorer');
  await docs.getByRole('combobox').fill('NodeDetail');
  await page.getByRole('option', { name: 'NodeDetail', exact: true }).click();
  await expect(docs.getByText(/A machine of the fleet/)).toBeVisible();
  await expect(docs.getByText(/Whether the node's hardware key is trusted/)).toBeVisible();
  await page.screenshot({ path: screenshotPath('graphiql-node-detail') });

  expect(elsewhere).toEqual([]);
});

test('GraphiQL without a token says where one goes', async ({ browser, pageErrors }) => {
  // A fresh context: no token in local storage from the test above.
  const context = await browser.newContext();
  pageErrors.watch(context);
  // The refusal this test is about: the browser logs the 401 of GraphiQL's first request.
  pageErrors.allow(/status of 401/);
  const page = await context.newPage();
  const refused = page.waitForResponse(
    (response) => response.url() === `${fleet.url}/graphql` && response.request().method() === 'POST',
  );
  await page.goto(`${fleet.url}/graphql`);
  expect((await refused).status()).toBe(401);
  await page.getByRole('button', { name: /^headers$/i }).click();
  await expect(page.getByText('Bearer <token>')).toBeVisible();
  await context.close();
});
