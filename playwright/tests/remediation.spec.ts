// Remediation and clear rules on the node page (issue 15, item 8), on `dev --sim 20
// --sim-mixed` with its GPUs failing in service soon after start: health remediation fixes
// two nodes and gives up on one (maintenance on, GpuNeedsPerson). Each condition and reason
// shows what clears it; a condition can be cleared by hand only with a reason.
import { test, expect } from './fixtures';
import { startFleet, screenshotPath, type Fleet } from '../fleet';
import { row, signIn } from './helpers';

let fleet: Fleet;
test.beforeAll(async () => {
  fleet = await startFleet({ sim: 20, mixed: true, faultsAfterSecs: 30 });
});
test.afterAll(async () => {
  await fleet?.stop();
});

interface Remediated {
  id: string;
  hostname: string;
  /** Through acceptance and its first spec: the server no longer changes it by itself. */
  settled: boolean;
  statuses: string[];
  conditions: { type: string; status: string; clearWhen: { kind: string; description: string } }[];
  reasons: { reason: string; clearWhen: { description: string } }[];
}

async function remediated(): Promise<Remediated[]> {
  const answer = await fleet.graphql(`{ nodes(first: 1000) { nodes {
    id hostname provisionState observedGeneration remediationAttempts { status }
    conditions { type status clearWhen { kind description } }
    schedulability { reasons { reason clearWhen { description } } } } } }`);
  if (answer.errors) throw new Error(JSON.stringify(answer.errors));
  return answer.data.nodes.nodes.map((n: any) => ({
    id: n.id,
    hostname: n.hostname,
    settled: n.provisionState === 'ADOPTED' && n.observedGeneration >= 1,
    statuses: n.remediationAttempts.map((a: any) => a.status),
    conditions: n.conditions,
    reasons: n.schedulability.reasons,
  }));
}

test('each reason and condition shows its clear rule; clearing by hand needs a reason', async ({ page }) => {
  // The node that reports 7 of 8 GPUs: GpuCountMismatch, cleared by a report without it.
  // Once it is through acceptance, so that the page the test clicks in is not redrawn by
  // the node's own bring-up.
  let mismatch: Remediated | undefined;
  await expect
    .poll(async () => {
      mismatch = (await remediated()).find(
        (n) => n.settled && n.conditions.some((c) => c.type === 'GpuCountMismatch' && c.status === 'TRUE'),
      );
      return mismatch !== undefined;
    }, { timeout: 60_000 })
    .toBe(true);
  const target = mismatch!;
  const condition = target.conditions.find((c) => c.type === 'GpuCountMismatch')!;
  const reason = target.reasons.find((r) => r.reason === 'GpuCountMismatch')!;

  await signIn(page, fleet);
  await row(page, target.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(target.hostname);
  const reasonRule = page.locator('[data-testid="reason-row"][data-reason="GpuCountMismatch"] [data-testid="reason-clear-rule"]');
  await expect(reasonRule).toContainText(reason.clearWhen.description);
  const conditionRow = page.locator('[data-testid="condition-row"][data-type="GpuCountMismatch"]');
  await expect(conditionRow.getByTestId('condition-clear-rule')).toHaveAttribute('data-kind', condition.clearWhen.kind);
  await expect(conditionRow.getByTestId('condition-clear-rule')).toContainText(condition.clearWhen.description);

  // Its timeline: the condition and the reason it keeps, each a lane of its own.
  await expect(page.locator('[data-testid="lane"][data-lane="condition GpuCountMismatch"] [data-testid="segment"][data-value="true"]')).toHaveCount(1);
  await expect(page.locator('[data-testid="lane"][data-lane="reason GpuCountMismatch"] [data-testid="segment"]')).toHaveCount(1);

  // By hand: refused without a reason, recorded with one (as the operator).
  await conditionRow.getByTestId('condition-clear').click();
  await conditionRow.getByTestId('condition-clear-confirm').click();
  await expect(page.getByTestId('clear-error')).toContainText('Say why');
  await conditionRow.getByTestId('condition-clear-reason').fill('reseated the GPU');
  await conditionRow.getByTestId('condition-clear-confirm').click();
  await expect(
    page.locator('[data-testid="event-row"][data-type="node.condition_changed"]').filter({ hasText: 'GpuCountMismatch=false' }).first(),
  ).toContainText('user:');
});

test('remediation attempts show step, action, commands, status and times', async ({ page }) => {
  let treated: Remediated | undefined;
  await expect
    .poll(async () => {
      treated = (await remediated()).find((n) => n.statuses.length > 0);
      return treated !== undefined;
    }, { timeout: 80_000 })
    .toBe(true);
  await signIn(page, fleet);
  await row(page, treated!.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(treated!.hostname);
  const attempts = page.getByTestId('remediation-row');
  await expect(attempts.first()).toBeVisible();
  await expect(attempts.first()).toContainText(/1 of \d/);
  await expect(attempts.first()).toContainText(/gpu\.reset|node\.reboot/);
  await expect(page.getByTestId('remediation-outcome')).toBeVisible();
  // Its commands run: an action command appears, then its status moves on live.
  await expect(attempts.first()).toContainText('action cmd_', { timeout: 60_000 });
});

test('remediation that gives up says so: maintenance on, GpuNeedsPerson', async ({ page }) => {
  // The ladder: reset, then reboots 120 s apart, each verified, before it gives up.
  test.setTimeout(480_000);
  let gaveUp: Remediated | undefined;
  await expect
    .poll(async () => {
      gaveUp = (await remediated()).find((n) => n.statuses.includes('GAVE_UP'));
      return gaveUp !== undefined;
    }, { timeout: 450_000, intervals: [5_000] })
    .toBe(true);
  await signIn(page, fleet);
  await row(page, gaveUp!.id).getByRole('link').click();
  await expect(page.getByTestId('node-hostname')).toHaveText(gaveUp!.hostname);
  await expect(page.getByTestId('remediation-outcome')).toHaveAttribute('data-outcome', 'bad');
  await expect(page.getByTestId('remediation-outcome')).toContainText('GpuNeedsPerson');
  await expect(page.locator('[data-testid="remediation-row"][data-status="GAVE_UP"]')).toHaveCount(1);
  await expect(page.locator('[data-testid="condition-row"][data-type="GpuNeedsPerson"]')).toBeVisible();
  await expect(page.locator('dd[data-fact="Maintenance"]')).toContainText('yes');
  await page.screenshot({ path: screenshotPath('remediation-gave-up'), fullPage: true });
});
