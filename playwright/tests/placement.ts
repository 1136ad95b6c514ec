// What the placement specs share: a tenant that may reserve in the dev pool, and reserving,
// reading and releasing through the API (the UI under test does the rest).
import { expect, type Page } from '@playwright/test';
import type { Fleet } from '../fleet';
import { mutate } from './helpers';

/** What the `dev --sim` fleet offers: 8 simulated H100s per node, in pool `dev-gpu`. */
export const GPUS_PER_NODE = 8;
export const GPU_MODEL = 'NVIDIA H100 80GB HBM3';

export interface ApiReservation {
  id: string;
  state: string;
  version: number;
  reason: string | null;
  allocations: { nodeId: string; atoms: string[]; active: boolean }[];
}

const FIELDS = 'id state version reason allocations { nodeId atoms active }';

/** The id of the dev pool. */
export async function devPool(fleet: Fleet): Promise<string> {
  const data = await mutate(fleet, '{ pools { nodes { id name } } }');
  const pool = data.pools.nodes.find((p: any) => p.name === 'dev-gpu');
  if (!pool) throw new Error('no dev-gpu pool');
  return pool.id;
}

/** A new tenant offered the dev pool (a platform pool), so that it may reserve there. */
export async function tenantOfDevPool(fleet: Fleet, name: string): Promise<string> {
  const tenant = await mutate(fleet, 'mutation($name: String!) { createTenant(input: {name: $name}) { tenant { id } } }', { name });
  const tenantId = tenant.createTenant.tenant.id;
  await mutate(fleet, 'mutation($input: OfferPoolInput!) { offerPool(input: $input) { tenantId } }', {
    input: { poolId: await devPool(fleet), tenantId },
  });
  return tenantId;
}

/** A reservation made through the API, as the server answered it. */
export async function reserve(
  fleet: Fleet,
  tenantId: string,
  shape: { gpusPerNode: number; nodeCount?: number },
): Promise<ApiReservation> {
  const data = await mutate(
    fleet,
    `mutation($input: CreateReservationInput!) { createReservation(input: $input) { reservation { ${FIELDS} } } }`,
    { input: { tenantId, poolId: await devPool(fleet), nodeCount: 1, ...shape } },
  );
  return data.createReservation.reservation;
}

export async function reservation(fleet: Fleet, id: string): Promise<ApiReservation> {
  const data = await mutate(fleet, `query($id: ID!) { reservation(id: $id) { ${FIELDS} } }`, { id });
  return data.reservation;
}

/** Releases a reservation at the version it has now. */
export async function release(fleet: Fleet, id: string): Promise<ApiReservation> {
  const { version } = await reservation(fleet, id);
  const data = await mutate(
    fleet,
    `mutation($input: ReleaseReservationInput!) { releaseReservation(input: $input) { reservation { ${FIELDS} } } }`,
    { input: { id, version } },
  );
  return data.releaseReservation.reservation;
}

/** Waits until the API reports the reservation in `state`. */
export async function waitForState(fleet: Fleet, id: string, state: string) {
  await expect.poll(async () => (await reservation(fleet, id)).state, { timeout: 30_000 }).toBe(state);
}

export function reservationRow(page: Page, id: string) {
  return page.locator(`[data-testid="reservation-row"][data-reservation="${id}"]`);
}

/** A `datetime-local` value (the browser's and this process's zone: the same machine). */
export function localInput(at: Date): string {
  const pad = (n: number) => String(n).padStart(2, '0');
  return `${at.getFullYear()}-${pad(at.getMonth() + 1)}-${pad(at.getDate())}T${pad(at.getHours())}:${pad(at.getMinutes())}`;
}
