// Every browser test fails on a page error or a console error: a panic in the dashboard's wasm
// prints to the console and then traps (`unreachable`), which no assertion on the page would
// notice (issue 15: leaving a node page panicked for weeks while every test stayed green).
//
// Specs import `test` and `expect` from here instead of '@playwright/test'. The test's own
// context is watched by itself; a context a test opens with `browser.newContext()` is watched
// once passed to `pageErrors.watch`. A test that provokes an error on purpose (a refused
// token: the browser logs the 401) names it with `pageErrors.allow(/pattern/)`.
import { test as base, expect, type BrowserContext } from '@playwright/test';

export interface PageErrors {
  /** Watches another context's pages too. */
  watch(context: BrowserContext): void;
  /** Lets console errors matching `pattern` pass (page errors never pass). */
  allow(pattern: RegExp): void;
}

export const test = base.extend<{ pageErrors: PageErrors }>({
  pageErrors: [
    async ({ context }, use) => {
      const seen: string[] = [];
      const allowed: RegExp[] = [];
      const watch = (watched: BrowserContext) => {
        watched.on('weberror', (error) => seen.push(`page error: ${error.error().stack ?? error.error().message}`));
        watched.on('console', (message) => {
          if (message.type() !== 'error') return;
          const text = message.text();
          if (allowed.some((pattern) => pattern.test(text))) return;
          const where = message.location();
          seen.push(`console error: ${text} (${where.url}:${where.lineNumber})`);
        });
      };
      watch(context);
      await use({ watch, allow: (pattern) => allowed.push(pattern) });
      expect(seen, 'the dashboard logged errors or panicked').toEqual([]);
    },
    { auto: true },
  ],
});

export { expect };
