// What the browser tests share beyond the fleet itself: reading nodes through the API and
// signing a page in.
import { expect, type Page } from '@playwright/test';
import type { Fleet } from '../fleet';

export interface ApiNode {
  id: string;
  hostname: string;
  version: number;
  cordoned: boolean;
  schedulable: boolean;
  conditions: string[];
}

/** Every node, as the API has it now. */
export async function nodes(fleet: Fleet): Promise<ApiNode[]> {
  const answer = await fleet.graphql(`{ nodes(first: 1000) { edges { node {
    id hostname version cordoned conditions { type status } schedulability { schedulable } } } } }`);
  if (answer.errors) throw new Error(JSON.stringify(answer.errors));
  return answer.data.nodes.edges.map(({ node }: any) => ({
    id: node.id,
    hostname: node.hostname,
    version: node.version,
    cordoned: node.cordoned,
    schedulable: node.schedulability.schedulable,
    conditions: node.conditions.filter((c: any) => c.status === 'TRUE').map((c: any) => c.type),
  }));
}

export async function node(fleet: Fleet, id: string): Promise<ApiNode> {
  const found = (await nodes(fleet)).find((n) => n.id === id);
  if (!found) throw new Error(`no node ${id}`);
  return found;
}

/** Waits until the fleet has `count` nodes that satisfy `ok` (the API's view). */
export async function waitForNodes(fleet: Fleet, count: number, ok: (n: ApiNode) => boolean = () => true) {
  await expect
    .poll(async () => (await nodes(fleet)).filter(ok).length, { timeout: 60_000 })
    .toBeGreaterThanOrEqual(count);
}

/** Opens the dashboard through the sign-in link and waits for the live feed. */
export async function signIn(page: Page, fleet: Fleet) {
  await page.goto(fleet.signInUrl);
  await expect(page.getByTestId('live-state')).toHaveText('Live');
}

/** A GraphQL mutation that must succeed. */
export async function mutate(fleet: Fleet, query: string, variables?: Record<string, unknown>) {
  const answer = await fleet.graphql(query, variables);
  if (answer.errors) throw new Error(`${query}: ${JSON.stringify(answer.errors)}`);
  return answer.data;
}

export function row(page: Page, id: string) {
  return page.locator(`[data-testid="fleet-row"][data-node="${id}"]`);
}
