/**
 * pfl-edge's secure-aggregation vectors (docs/vectors/secagg, written by `python -m pfl_edge.secagg.vectors`; the
 * constructions in docs/secagg.md, "Byte for byte") against this device's client (src/secagg.ts,
 * src/securestep.ts): the same public keys, pairwise keys, sealed boxes, Shamir shares, masks, commitments and
 * quantization, byte for byte, and every message of a whole round (keys, sealed shares, the masked payload, the
 * unmask answer, complaints) made from the round's fixed secrets and draws exactly as pfl-edge made them.
 * What only the server does (combining shares, dequantizing, judging complaints, the graph) is pfl-edge's alone:
 * tests/pfl_edge/test_secagg_vectors.py.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { type Advert, type KeyPair, SecAggError, SecureClient, agree, encodeMasked, fromHex, keyPair, maxBits, openSealed,
  prg, quantize, seal, split } from '../src/secagg.js';
import { parseSecAggState } from '../src/securestep.js';
import { toHex } from '../src/sha256.js';

const DIR = fileURLToPath(new URL('../../../../docs/vectors/secagg/', import.meta.url));
type Json = any;
const load = (name: string): Json => JSON.parse(readFileSync(DIR + name, 'utf8'));
const subtle = globalThis.crypto.subtle as unknown as import('node:crypto').webcrypto.SubtleCrypto;
const ENC = new TextEncoder();
const PKCS8_X25519 = fromHex('302e020100300506032b656e04220420');

/** The public key of a raw X25519 secret, as the platform computes it (PKCS#8 in, JWK out). */
async function publicOf(secret: Uint8Array): Promise<Uint8Array> {
  const der = new Uint8Array(PKCS8_X25519.length + 32);
  der.set(PKCS8_X25519);
  der.set(secret, PKCS8_X25519.length);
  const key = await subtle.importKey('pkcs8', der, { name: 'X25519' }, true, ['deriveBits']);
  const jwk = await subtle.exportKey('jwk', key);
  return Uint8Array.from(Buffer.from(jwk.x!, 'base64url'));
}

async function pairOf(secretHex: string): Promise<KeyPair> {
  const secret = fromHex(secretHex);
  return keyPair(subtle, secret, await publicOf(secret));
}

test('X25519: the public key of each secret, and the small-order keys refused', async () => {
  const v = load('keys.json');
  for (const p of v.pairs) assert.equal(toHex(await publicOf(fromHex(p.secret))), p.public);
  const me = await pairOf(v.pairs[1].secret);
  for (const pub of v.refused_publics) {
    await assert.rejects(agree(subtle, me, fromHex(pub), ENC.encode('pfl-secagg:check')), SecAggError, pub);
  }
});

test('the pairwise keys: HKDF-SHA256 of the X25519 shared secret, info pfl-secagg:<kind>:<round id>', async () => {
  for (const c of load('agree.json').cases) {
    const info = ENC.encode(`pfl-secagg:${c.kind}:${c.round_id}`);
    assert.equal(toHex(info), c.info_hex);
    assert.equal(toHex(await agree(subtle, await pairOf(c.secret), fromHex(c.peer_public), info)), c.key);
  }
});

test('the sealed pair: 168 bytes that pfl-edge opens, and the boxes that must not open', async () => {
  const v = load('seal.json');
  for (const c of v.cases) {
    const sender = await pairOf(c.sender_c_secret);
    const receiver = await pairOf(c.receiver_c_secret);
    const info = ENC.encode(`pfl-secagg:c:${c.round_id}`);
    assert.equal(toHex(await agree(subtle, sender, receiver.publicRaw, info)), c.key);
    assert.equal(toHex(await agree(subtle, receiver, sender.publicRaw, info)), c.key);
    const sealed = await seal(subtle, fromHex(c.key), fromHex(c.plaintext), fromHex(c.aad), fromHex(c.nonce));
    assert.equal(sealed.length, 168);
    assert.equal(toHex(sealed), c.sealed);
    assert.equal(toHex(await openSealed(subtle, fromHex(c.key), fromHex(c.sealed), fromHex(c.aad))), c.plaintext);
  }
  for (const r of v.refused) {
    await assert.rejects(openSealed(subtle, fromHex(r.key), fromHex(r.sealed), fromHex(r.aad)), SecAggError, r.why);
  }
});

test('Shamir shares over GF(2^521 - 1) at the vectors\' coefficients', () => {
  const v = load('shamir.json');
  for (const c of v.cases) {
    const got = split(fromHex(c.secret), c.xs, c.coeffs.map((a: string) => BigInt('0x' + a)));
    assert.deepEqual(Object.fromEntries([...got].map(([x, s]) => [String(x), toHex(s)])), c.shares);
  }
});

test('the masks\' generator: AES-256-CTR keystream as little-endian uint32', async () => {
  for (const c of load('prg.json').cases) {
    const v = await prg(subtle, fromHex(c.seed), c.n);
    assert.deepEqual(Array.from(v.subarray(0, 16)), c.head);
    assert.deepEqual(Array.from(v.subarray(v.length - 4)), c.tail);
    const digest = new Uint8Array(await subtle.digest('SHA-256', new Uint8Array(v.buffer, v.byteOffset, v.byteLength)));
    assert.equal(toHex(digest), c.le_bytes_sha256); // a little-endian host's bytes: Node's platforms
  }
});

test('the commitments', async () => {
  for (const c of load('commit.json').cases) {
    const client = new SecureClient(subtle, 0, c.round_id, 2, 1, await pairOf('00'.repeat(32)), await pairOf('00'.repeat(32)),
      new Uint8Array(32), () => { throw new Error('draws nothing'); });
    assert.equal(toHex(await client.commitment(c.kind, c.dealer, c.holder, fromHex(c.share))), c.commitment);
  }
});

const f64 = (h: string): number => new DataView(fromHex(h).buffer).getFloat64(0, false);

test('the quantizer and its default bits', () => {
  const v = load('quantize.json');
  for (const c of [...v.cases, ...v.ties]) {
    assert.deepEqual(Array.from(quantize(c.x, c.bound, c.bits)), c.q, `bound ${c.bound}, bits ${c.bits}`);
  }
  for (const c of [...v.cases, v.infinite]) {
    const x = c.x_f64.map(f64);
    if (c.x !== undefined) assert.deepEqual(x, c.x); // JSON's decimals are the float64s
    assert.deepEqual(Array.from(quantize(x, c.bound, c.bits)), c.q, `bound ${c.bound}, bits ${c.bits}`);
  }
  for (const c of v.max_bits) assert.equal(maxBits(c.clients), c.bits, `${c.clients} clients`);
});

/** A device of round.json with its fixed secrets, drawing its coefficients and nonces from the vector. */
async function device(v: Json, slot: number): Promise<SecureClient> {
  const d = v.devices[String(slot)];
  const draws: Uint8Array[] = [...d.coeffs_b, ...d.coeffs_s].map((h: string) => fromHex(h));
  for (const j of Object.keys(d.nonces).map(Number).sort((a, b) => a - b)) draws.push(fromHex(d.nonces[String(j)]));
  const random = (n: number): Uint8Array => {
    const next = draws.shift();
    assert.ok(next !== undefined && next.length === n, `a draw of ${n} bytes the vector does not hold`);
    return next;
  };
  return new SecureClient(subtle, slot, `${v.federation}:${v.round}`, v.params.threshold, v.params.size,
    await pairOf(d.c_secret), await pairOf(d.s_secret), fromHex(d.b), random);
}

const neighbours = (state: Json): Map<number, Advert> => new Map(state.neighbours.map((n: Json): [number, Advert] =>
  [n.index, { c: fromHex(n.c_public), s: fromHex(n.s_public) }]));
const inbox = (state: Json): Map<number, [Uint8Array, Uint8Array]> => new Map(state.inbox.map(
  (s: Json): [number, [Uint8Array, Uint8Array]] => [s.index, [fromHex(s.box), fromHex(s.commits)]]));

describe('a whole round (round.json): every message this device sends is pfl-edge\'s', () => {
  const v = load('round.json');
  const m = v.messages;
  const slots: number[] = Object.keys(v.devices).map(Number);

  test('the server\'s answers parse', () => {
    const states = [m.advertise.state, m.done.state, ...['share', 'input', 'unmask'].flatMap((s) => Object.values(m[s].state))];
    for (const s of states as Json[]) {
      const { round: _round, ...rest } = s;
      assert.deepEqual(parseSecAggState(s), rest);
    }
  });

  test('keys, sealed shares, masked inputs and unmask answers', async () => {
    assert.equal(v.quantizer.bits, maxBits(v.quantizer.clients));
    for (const i of slots) {
      const d = v.devices[String(i)];
      const client = await device(v, i);
      assert.deepEqual({ c_public: toHex(client.c.publicRaw), s_public: toHex(client.s.publicRaw) }, m.advertise.keys[String(i)]);
      assert.deepEqual(Array.from(quantize(d.update, v.quantizer.bound, v.quantizer.bits)), d.x);
      const dealt = await client.shareKeys(neighbours(m.share.state[String(i)]));
      // the body as runSecureRound posts it
      assert.deepEqual({ shares: [...dealt].map(([j, [b, h]]) => ({ index: j, box: toHex(b), commits: toHex(h) })) },
        m.share.shares[String(i)], `device ${i}'s SecAggShares`);
      if (i === v.drops_after_sharing) continue;
      const y = await client.maskedInput(Uint32Array.from(d.x), inbox(m.input.state[String(i)]));
      assert.equal(client.accused.size, 0);
      assert.deepEqual(Array.from(y), m.input.masked[String(i)].y, `device ${i}'s masked input`);
      assert.equal(toHex(encodeMasked(y, v.round)), m.input.masked[String(i)].payload);
      const at = m.unmask.state[String(i)];
      assert.deepEqual({ shares: client.unmask(new Set(at.survivors), new Set(at.dropped)) }, m.unmask.unmask[String(i)],
        `device ${i}'s SecAggUnmask`);
    }
  });

  test('the survivors\' masks cancel: the sum of their masked inputs less their self-masks and the drop-out\'s', () => {
    // what only the server computes; here: the survivors' plain sum is the vector's unmasked sum
    const sum = new Uint32Array(v.params.size);
    for (const i of v.survivors) v.devices[String(i)].x.forEach((q: number, k: number) => { sum[k] = (sum[k]! + q) >>> 0; });
    assert.deepEqual(Array.from(sum), v.sum);
  });
});

test('complaints (complaint.json): the pair it cannot open or check is accused, a good one is not', async () => {
  const rnd = load('round.json');
  for (const c of load('complaint.json').cases) {
    const client = await device(rnd, c.holder);
    client.neighbours = neighbours(c.state);
    await client.maskedInput(Uint32Array.from(rnd.devices[String(c.holder)].x), inbox(c.state));
    assert.deepEqual([...client.accused], c.accused_by_holder ? [c.dealer] : [], c.what);
    if (c.accused_by_holder) assert.deepEqual(client.complaint(), c.complaint);
  }
});
