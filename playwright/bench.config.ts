// The dashboard benchmark (bench/), run by hand: `npx playwright test -c bench.config.ts`.
// It is not a test (it asserts nothing about time) and the test command does not run it.
import { defineConfig } from '@playwright/test';
import base from './playwright.config';

export default defineConfig({
  ...base,
  testDir: './bench',
  testMatch: '**/*.bench.ts',
  timeout: 30 * 60_000,
  expect: { timeout: 10 * 60_000 },
});
