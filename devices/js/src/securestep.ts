/**
 * A secure round's steps over HTTP (pfl-edge's docs/protocol.md, "Secure aggregation"; the Python agent's
 * edge_runtime/secure.py): keys, sealed shares, the masked input (sent by the caller as the round's update),
 * the unmask shares. Between steps it asks `GET /v1/rounds/{t}/secagg`, backing off to a second, until the step
 * it waits for comes, the round moves past it, or the step's deadline and one more step's time have passed. Its
 * secrets live in memory only: a device restarted mid-round sits the round out.
 */
import type { webcrypto } from 'node:crypto';

import { HttpError, sleep, type Http } from './http.js';
import { type Advert, SecAggError, SecureClient, encodeMasked, fromHex, keyPair } from './secagg.js';
import { toHex } from './sha256.js';

type SubtleCrypto = webcrypto.SubtleCrypto;

export interface SecAggState {
  step: string;
  deadline: number;
  params: { degree: number; threshold: number; size: number } | null;
  neighbours: Array<{ index: number; c_public: string; s_public: string }>;
  inbox: Array<{ index: number; box: string; commits: string }>;
  survivors: number[];
  dropped: number[];
}

const STEPS = ['advertise', 'share', 'input', 'unmask', 'done'];
const HEX64 = /^[0-9a-f]{64}$/;

function int(v: unknown, what: string): number {
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 0) throw new SecAggError(`${what}: not a count`);
  return v;
}

/** The server's answer, checked (a malformed one is refused, never half-read). */
export function parseSecAggState(v: unknown): SecAggState {
  if (typeof v !== 'object' || v === null) throw new SecAggError('a secure round\'s state is not an object');
  const o = v as Record<string, unknown>;
  if (typeof o['step'] !== 'string' || !STEPS.includes(o['step'])) throw new SecAggError(`unknown step ${String(o['step'])}`);
  if (typeof o['deadline'] !== 'number' || !Number.isFinite(o['deadline'])) throw new SecAggError('deadline: not a time');
  const p = o['params'] as Record<string, unknown> | null | undefined;
  const list = (k: string): unknown[] => (Array.isArray(o[k]) ? (o[k] as unknown[]) : []);
  return {
    step: o['step'], deadline: o['deadline'],
    params: p ? { degree: int(p['degree'], 'degree'), threshold: int(p['threshold'], 'threshold'), size: int(p['size'], 'size') } : null,
    neighbours: list('neighbours').map((n) => {
      const x = n as Record<string, unknown>;
      if (!HEX64.test(String(x['c_public'])) || !HEX64.test(String(x['s_public']))) throw new SecAggError('a neighbour\'s key is not 32 bytes of hex');
      return { index: int(x['index'], 'index'), c_public: String(x['c_public']), s_public: String(x['s_public']) };
    }),
    inbox: list('inbox').map((n) => {
      const x = n as Record<string, unknown>;
      if (!/^[0-9a-f]{128}$/.test(String(x['commits']))) throw new SecAggError('a pair\'s commitments are not 64 bytes of hex');
      return { index: int(x['index'], 'index'), box: String(x['box']), commits: String(x['commits']) };
    }),
    survivors: list('survivors').map((x) => int(x, 'survivor')),
    dropped: list('dropped').map((x) => int(x, 'dropout')),
  };
}

export interface SecureRoundContext {
  http: Http;
  subtle: SubtleCrypto;
  random(n: number): Uint8Array;
  federation: string;
  slot: number;
  stepS: number;
  signal?: AbortSignal;
  log(level: 'info' | 'warn', msg: string): void;
}

/**
 * Round `t` with the quantized update `x`; `sendInput(payload)` uploads the masked input as the round's update
 * (false: refused or too late). True once it has sent what the unmask step asked.
 */
export async function runSecureRound(ctx: SecureRoundContext, t: number, x: Uint32Array,
  sendInput: (payload: Uint8Array) => Promise<boolean>): Promise<boolean> {
  const path = (what = ''): string => `/v1/rounds/${t}/secagg${what ? '/' + what : ''}`;
  const state = async (): Promise<SecAggState> => parseSecAggState(await ctx.http.getJson(path()));
  const post = async (what: string, body: unknown): Promise<SecAggState | null> => {
    try {
      return parseSecAggState(await ctx.http.postJson(path(what), body));
    } catch (e) {
      // 409: not its step; 422: named for a forged message (a false complaint): out of the round
      if (!(e instanceof HttpError) || (e.status !== 409 && e.status !== 422)) throw e;
      ctx.log('warn', `round ${t}: the server took no ${what} message of this device: ${e.message}`);
      return null;
    }
  };
  const wait = async (at: SecAggState | null, until: string[]): Promise<SecAggState | null> => {
    if (at === null) return null;
    let giveUp = Date.now() + Math.max(at.deadline * 1e3 - Date.now(), 0) + ctx.stepS * 1e3;
    let pause = 50;
    while (!until.includes(at.step)) {
      if (Date.now() > giveUp) return null;
      await sleep(pause, ctx.signal);
      pause = Math.min(2 * pause, 1000);
      at = await state();
      if (!until.includes(at.step)) giveUp = Math.max(giveUp, at.deadline * 1e3 + ctx.stepS * 1e3);
    }
    return at;
  };
  const out = (why: string, at: SecAggState | null): boolean => {
    ctx.log('warn', `round ${t}: secure aggregation goes on without this device: ${why} (step ${at?.step ?? 'none'})`);
    return false;
  };
  const c = await keyPair(ctx.subtle);
  const s = await keyPair(ctx.subtle);
  let at = await wait(await post('keys', { c_public: toHex(c.publicRaw), s_public: toHex(s.publicRaw) }),
    ['share', 'input', 'unmask', 'done']);
  if (at === null || at.step !== 'share' || at.params === null || !at.neighbours.length) {
    return out('the round moved past its share step without this device', at);
  }
  if (at.params.size !== x.length) throw new SecAggError(`the server's secure round sums ${at.params.size} values; this device's base has ${x.length}`);
  if (at.params.threshold <= at.params.degree / 2) throw new SecAggError('a threshold of half the degree or less would let the server unmask an input');
  const client = new SecureClient(ctx.subtle, ctx.slot, `${ctx.federation}:${t}`, at.params.threshold, at.params.size, c, s,
    ctx.random(32), (n) => ctx.random(n));
  const nbrs = new Map<number, Advert>(at.neighbours.map((n) => [n.index, { c: fromHex(n.c_public), s: fromHex(n.s_public) }]));
  const dealt = await client.shareKeys(nbrs);
  at = await wait(await post('shares', { shares: [...dealt].map(([j, [b, h]]) => ({ index: j, box: toHex(b), commits: toHex(h) })) }),
    ['input', 'unmask', 'done']);
  if (at === null || at.step !== 'input') return out('the round moved past its input step without this device', at);
  const y = await client.maskedInput(x, new Map(at.inbox.map((b) => [b.index, [fromHex(b.box), fromHex(b.commits)]])));
  if (client.accused.size) { // a pair that does not open or check: the server judges, this device stays
    const complaint = client.complaint();
    ctx.log('warn', `round ${t}: the pairs of ${complaint.accused.join(', ')} do not open or check; complaining before the input`);
    if ((await post('complaint', complaint)) === null) return out('the server took no complaint', at);
  }
  if (!(await sendInput(encodeMasked(y, t)))) return false;
  at = await wait(await state(), ['unmask', 'done']);
  if (at === null || at.step !== 'unmask') return out('the round closed before its unmask step reached this device', at);
  await post('unmask', { shares: client.unmask(new Set(at.survivors), new Set(at.dropped)) });
  return true;
}
