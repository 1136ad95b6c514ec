// Browser tests of the dashboard in Debian's Chromium (/usr/bin/chromium; CHROMIUM_PATH elsewhere):
// Playwright's own browser downloads do not work on these machines. Each test file starts its
// own server and simulated fleet (fleet.ts); one worker, since the machines have 2 cores.
import { defineConfig } from '@playwright/test';

export default defineConfig({
  testDir: './tests',
  outputDir: './test-results',
  timeout: 90_000,
  expect: { timeout: 20_000 },
  workers: 1,
  fullyParallel: false,
  retries: 0,
  forbidOnly: !!process.env.CI,
  reporter: 'list',
  use: {
    browserName: 'chromium',
    // Screenshots only where a test takes one (into test-results/screenshots/).
    screenshot: 'off',
    video: 'off',
    trace: 'off',
    launchOptions: {
      executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
      // Quiet on a closed network: no sandbox (root in CI), no GPU, no background traffic.
      args: [
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync',
      ],
    },
  },
});
