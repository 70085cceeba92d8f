/**
 * SecAgg+'s client side against pfl-edge's own (test/fixtures/secagg.json, written by make_fixtures.py): the same
 * key agreement, masks, masked input, Shamir shares and quantization, byte for byte; its sealed shares open
 * for their pair only; it never reveals both secrets of a neighbour.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { type Advert, SecAggError, SecureClient, agree, encodeMasked, fromHex, keyPair, openSealed, prg, quantize, split } from '../src/secagg.js';
import { toHex } from '../src/sha256.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const fx = JSON.parse(readFileSync(FIX + 'secagg.json', 'utf8'));
const subtle = globalThis.crypto.subtle as unknown as import('node:crypto').webcrypto.SubtleCrypto;
const random = (n: number): Uint8Array => globalThis.crypto.getRandomValues(new Uint8Array(n));
const ENC = new TextEncoder();

async function client(i: number): Promise<SecureClient> {
  const c = fx.clients[i];
  return new SecureClient(subtle, i, fx.round_id, fx.threshold, fx.size,
    await keyPair(subtle, fromHex(c.c_secret), fromHex(c.c_public)), await keyPair(subtle, fromHex(c.s_secret), fromHex(c.s_public)),
    fromHex(c.b), random);
}

const adverts = (skip: number): Map<number, Advert> => new Map((fx.clients as Array<Record<string, string>>)
  .map((c, j): [number, Advert] => [j, { c: fromHex(c['c_public']!), s: fromHex(c['s_public']!) }]).filter(([j]) => j !== skip));

test('key agreement and the masks\' generator are pfl-edge\'s', async () => {
  const c0 = await client(0);
  const key = await agree(subtle, c0.c, fromHex(fx.clients[1].c_public), ENC.encode(`pfl-secagg:c:${fx.round_id}`));
  assert.equal(toHex(key), fx.agree_c01);
  assert.deepEqual(Array.from(await prg(subtle, fromHex(fx.clients[0].b), 8)), fx.prg_b0);
  const fresh = await keyPair(subtle); // a generated pair: its raw secret re-imports to the same public key
  assert.deepEqual((await keyPair(subtle, fresh.secretRaw, fresh.publicRaw)).publicRaw, fresh.publicRaw);
  await assert.rejects(agree(subtle, c0.c, new Uint8Array(32), ENC.encode('x')), /low-order|unusable|invalid/i);
});

type Inbox = Map<number, [Uint8Array, Uint8Array]>;
const inbox0 = (): Inbox => new Map(Object.entries(fx.inbox0 as Record<string, { box: string; commits: string }>)
  .map(([j, b]) => [Number(j), [fromHex(b.box), fromHex(b.commits)]]));

test('the masked input is pfl-edge\'s, from the boxes pfl-edge sealed for it', async () => {
  const c0 = await client(0);
  c0.neighbours = adverts(0);
  const y = await c0.maskedInput(Uint32Array.from(fx.x0), inbox0());
  assert.deepEqual(Array.from(y), fx.y0);
  assert.equal(c0.accused.size, 0);
  assert.equal(toHex(await c0.commitment('b', 1, 0, c0.held.get(1)![0])), fx.commit_b_1_0);
});

test('a pair that does not open, or holds shares other than committed, is accused and not masked with', async () => {
  for (const how of ['box', 'commits']) {
    const tampered = inbox0();
    const [box, commits] = tampered.get(1)!;
    const bad = Uint8Array.from(how === 'box' ? box : commits);
    bad[20] = bad[20]! ^ 1;
    tampered.set(1, how === 'box' ? [bad, commits] : [box, bad]);
    const c0 = await client(0);
    c0.neighbours = adverts(0);
    const y = await c0.maskedInput(Uint32Array.from(fx.x0), tampered);
    assert.deepEqual([...c0.accused], [1]);
    assert.deepEqual([...c0.held.keys()], [2]);
    assert.notDeepEqual(Array.from(y), fx.y0); // the mask with 1 is left out
    assert.deepEqual(c0.complaint(), { c_secret: fx.clients[0].c_secret, accused: [1] });
  }
});

test('Shamir shares at fixed coefficients are pfl-edge\'s; its own boxes open for their pair only', async () => {
  const want = fx.shamir.shares as Record<string, string>;
  const got = split(fromHex(fx.shamir.secret), Object.keys(want).map(Number), fx.shamir.coeffs.slice(1).map(BigInt));
  for (const [x, share] of Object.entries(want)) assert.equal(toHex(got.get(Number(x))!), share);
  const c1 = await client(1);
  const boxes = new Map([...(await c1.shareKeys(adverts(1)))].map(([j, [b]]) => [j, b]));
  assert.deepEqual([...boxes.keys()], [0, 2]);
  const c0 = await client(0);
  const aad = (s: number, r: number) => new Uint8Array([...ENC.encode('pfl-secagg:' + fx.round_id), 0, 0, 0, s, 0, 0, 0, r]);
  const key = await agree(subtle, c0.c, fromHex(fx.clients[1].c_public), ENC.encode(`pfl-secagg:c:${fx.round_id}`));
  const body = await openSealed(subtle, key, boxes.get(0)!, aad(1, 0));
  assert.deepEqual(Array.from(body.subarray(0, 8)), [0, 0, 0, 1, 0, 0, 0, 0]);
  await assert.rejects(openSealed(subtle, key, boxes.get(0)!, aad(1, 2)), SecAggError); // another pair's
});

test('it reveals one secret of a neighbour, never both', async () => {
  const c0 = await client(0);
  c0.neighbours = adverts(0);
  await c0.maskedInput(Uint32Array.from(fx.x0), inbox0());
  const first = c0.unmask(new Set([0, 1]), new Set([2]));
  assert.deepEqual(first.map((s) => [s.about, s.kind]), [[1, 'b'], [2, 's']]);
  assert.throws(() => c0.unmask(new Set([0, 2]), new Set([1])), /revealed already/);
  assert.throws(() => c0.unmask(new Set([0]), new Set([1, 2])), SecAggError); // fewer survivors than the threshold
});

test('quantization and the masked payload are pfl-edge\'s', () => {
  const q = fx.quantize;
  assert.deepEqual(Array.from(quantize(q.x, q.bound, q.bits)), q.q);
  assert.deepEqual(Array.from(quantize(q.x, 0.7, 16)), q.q16);
  const vec = readFileSync(fileURLToPath(new URL('../../../../docs/masked-vectors/masked_round3.bin', import.meta.url)));
  assert.deepEqual(encodeMasked(Uint32Array.from([0, 1, 2 ** 32 - 1, 0x01020304]), 3), new Uint8Array(vec));
});
