/**
 * Beyond the vectors: round trips over many masks, the encoder's refusals, and hostile payloads (mutated bytes,
 * rewritten headers) that must be refused with a CodecError and nothing else, before anything big is allocated.
 */
import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import {
  CodecError, DEFAULT_MAX_BYTES, chooseMaskCoding, decode, encode, type Coding, type Decoded, type TensorIn,
} from '../src/codec.js';
import { dumps } from '../src/json.js';
import { nodeSha256 } from '../src/node.js';

const VECTORS = fileURLToPath(new URL('../../../../docs/vectors/', import.meta.url));
const opts = { sha256: nodeSha256 };

/** A small deterministic PRNG (mulberry32), so failures reproduce. */
function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Section 5.3 done the long way (explicit positions and gaps, every candidate k), to check chooseMaskCoding. */
function referenceChoice(mask: Uint8Array): [Coding, number, number] {
  const n = mask.length;
  let best: [Coding, number, number] = ['bitmap', 0, Math.ceil(n / 8)];
  for (const [coding, symbol] of [['rice1', 1], ['rice0', 0]] as const) {
    const p = [...mask.keys()].filter((i) => mask[i] === symbol);
    const c = p.length;
    let bits: number;
    let k = 0;
    if (c === 0) bits = 0;
    else if (2 * c >= n) {
      bits = p[c - 1]! + 1;
      if (bits >= n) continue;
    } else {
      const d = p.map((x, i) => (i === 0 ? x : x - p[i - 1]! - 1));
      const s = d.reduce((a, b) => a + b, 0);
      let centre = 0;
      while (c * (2 ** (centre + 1) - 1) <= s) centre++;
      let bestBits = Infinity;
      for (let kk = Math.max(0, centre - 1); kk <= Math.min(62, centre + 1); kk++) {
        const b = c * (kk + 1) + d.reduce((a, x) => a + Math.floor(x / 2 ** kk), 0);
        if (b < bestBits) [bestBits, k] = [b, kk];
      }
      bits = bestBits;
    }
    if (Math.ceil(bits / 8) < best[2]) best = [coding, k, Math.ceil(bits / 8)];
  }
  return best;
}

function assertSame(d: Decoded, tensors: TensorIn[]): void {
  assert.deepEqual([...d.tensors.keys()], tensors.map((t) => t.name));
  for (const t of tensors) {
    const got = d.tensors.get(t.name)!;
    assert.deepEqual(got.shape, [...t.shape]);
    for (let i = 0; i < got.data.length; i++) {
      const sent = t.mask ? Boolean(t.mask[i]) : true;
      assert.ok(Object.is(got.data[i], sent ? Math.fround(t.data[i]!) : 0), `${t.name}[${i}]`);
      if (t.mask) assert.equal(got.mask![i], sent ? 1 : 0);
    }
  }
}

describe('round trips', () => {
  test('masks of every density and size decode to themselves, in the canonical coding', () => {
    const rand = rng(31);
    const seen = new Set<string>();
    for (let trial = 0; trial < 400; trial++) {
      const n = trial < 40 ? trial : Math.floor(rand() ** 2 * 5000);
      const density = [0, 1, 0.001, 0.01, 0.05, 0.2, 0.5, 0.8, 0.95, 0.99, 0.999, rand()][trial % 12]!;
      const mask = Uint8Array.from({ length: n }, () => (rand() < density ? 1 : 0));
      if (trial % 7 === 0 && n > 10) mask.fill(1, n >> 1); // long runs
      const data = Float32Array.from({ length: n }, () => (rand() - 0.5) * 100);
      const dtype = trial % 5 === 0 ? 'f2' : 'f4';
      const t: TensorIn = { name: `t${trial}`, shape: [n], data: dtype === 'f2' ? data.map((x) => x / 64) : data, mask };
      const want = referenceChoice(mask);
      const choice = chooseMaskCoding(mask, n);
      assert.deepEqual([choice.coding, choice.k, choice.nbytes], want, `trial ${trial}, n ${n}`);
      seen.add(choice.coding);
      const payload = encode({ model: 'm', round: trial, tensors: [t], dtype }, opts);
      const d = decode(payload, opts);
      assert.equal(d.tensors.get(t.name)!.coding, choice.coding);
      if (dtype === 'f4') assertSame(d, [t]);
      else assert.deepEqual(d.tensors.get(t.name)!.mask, mask);
      // decode -> encode is the identity on bytes
      const again = encode({ model: 'm', round: trial, dtype, tensors: [...d.tensors.values()] }, opts);
      assert.deepEqual(again, payload);
    }
    assert.deepEqual([...seen].sort(), ['bitmap', 'rice0', 'rice1']);
  });

  test('names and model ids outside ASCII, and many tensors', () => {
    const tensors: TensorIn[] = [
      { name: 'é\u{1f600}"\\\n', shape: [2], data: [1, -0] },
      { name: 'w', shape: [], data: [5] },
      { name: '\\u0077', shape: [0, 4], data: [] },
      { name: 'sparse', shape: [3, 0], data: [], mask: [] },
    ];
    for (let i = 0; i < 200; i++) tensors.push({ name: `layer.${i}.weight`, shape: [1, 2], data: [i, -i], mask: [1, i % 2] });
    const payload = encode({ model: 'ünï/ç0de', round: 1000000, tensors }, opts);
    const d = decode(payload, opts);
    assert.equal(d.model, 'ünï/ç0de');
    assert.equal(d.round, 1000000);
    assertSame(d, tensors);
  });

  test('the TypeScript SHA-256 by default', () => {
    const payload = encode({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [3], data: [1, 2, 3] }] });
    assert.deepEqual(payload, encode({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [3], data: [1, 2, 3] }] }, opts));
    assert.equal(decode(payload).tensors.get('x')!.data[2], 3);
  });
});

describe('the encoder refuses', () => {
  const refused = (input: Parameters<typeof encode>[0], what: RegExp): void =>
    assert.throws(() => encode(input, opts), (err: unknown) => err instanceof CodecError && err.check === 'encode' && what.test(err.message));
  test('what it must not write', () => {
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [2], data: [1, NaN] }] }, /NaN or Inf/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [2], data: [1, Infinity] }] }, /NaN or Inf/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [1], data: [3.5e38 * 10] }] }, /NaN or Inf/); // rounds to Inf in f32
    refused({ model: 'm', round: 0, dtype: 'f2', tensors: [{ name: 'x', shape: [1], data: [65520] }] }, /rounds to Inf/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [1], data: [1] }, { name: 'x', shape: [1], data: [1] }] }, /twice/);
    refused({ model: 'm', round: -1, tensors: [] }, /round/);
    refused({ model: 'm', round: 1.5, tensors: [] }, /round/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [3], data: [1, 2] }] }, /2 values/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [2], data: [1, 2], mask: [1] }] }, /mask/);
    refused({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [-1], data: [] }] }, /shape/);
    // NaN where the mask is 0 is not sent, so not refused
    const d = decode(encode({ model: 'm', round: 0, tensors: [{ name: 'x', shape: [2], data: [NaN, 1], mask: [0, 1] }] }, opts), opts);
    assert.deepEqual([...d.tensors.get('x')!.data], [0, 1]);
    assert.equal(decode(encode({ model: 'm', round: 0, dtype: 'f2', tensors: [{ name: 'x', shape: [1], data: [65519] }] }, opts), opts).tensors.get('x')!.data[0], 65504);
  });
});

// ------------------------------------------------------------------------------------------------ hostile input

/** Rebuilds a payload around a header object and data (correct trailer): a header the encoder would never write. */
function craft(header: unknown, data: Uint8Array = new Uint8Array(0), rawHeader?: string): Uint8Array {
  const text = rawHeader ?? dumps(header as never);
  const h = new TextEncoder().encode(text);
  const body = new Uint8Array(9 + h.length + data.length);
  body.set([0x50, 0x46, 0x4c, 0x45, 1]);
  new DataView(body.buffer).setUint32(5, h.length, true);
  body.set(h, 9);
  body.set(data, 9 + h.length);
  const out = new Uint8Array(body.length + 32);
  out.set(body);
  out.set(nodeSha256(body), body.length);
  return out;
}

function refusedBy(payload: Uint8Array, check: string, options: Parameters<typeof decode>[1] = {}): void {
  assert.throws(() => decode(payload, { ...opts, ...options }), (err: unknown) => {
    assert.ok(err instanceof CodecError, String(err));
    assert.equal(err.check, check, err.message);
    return true;
  });
}

describe('hostile payloads', () => {
  test('an empty shape whose other dimensions multiply past 2^63 - 1 (codec.md section 7, "Computing n")', () => {
    const shape = [...Array(8).fill(2 ** 28), 0];
    refusedBy(craft({ model: 'm', round: 0, tensors: [['w', shape, 'f4', 0, 0]] }), 'E3');
    // eight times 2^28 is 2^224; seven times 2^9 is 2^63: the limit is inclusive of 2^63 - 1 only
    refusedBy(craft({ model: 'm', round: 0, tensors: [['w', [...Array(7).fill(512), 0], 'f4', 0, 0]] }), 'E3');
    const ok = decode(craft({ model: 'm', round: 0, tensors: [['w', [...Array(6).fill(512), 0], 'f4', 0, 0]] }), opts);
    assert.equal(ok.tensors.get('w')!.data.length, 0);
  });

  test('huge declared tensors are refused by the header checks, before anything is allocated', () => {
    // dense: 2^28 * 2^28 elements but 0 bytes of data
    refusedBy(craft({ model: 'm', round: 0, tensors: [['w', [2 ** 28, 2 ** 28], 'f4', 0, 0]] }), 'E6');
    // a sparse tensor sending nothing needs no data, only decode room: bounded by max_bytes (E18)
    const empty = (n: number): Uint8Array => craft({ model: 'm', round: 0, tensors: [['w', [n], 'f4', 0, 0, 'rice1', 0, 0, 0]] });
    refusedBy(empty(DEFAULT_MAX_BYTES / 4 + 1), 'E18');
    refusedBy(empty(1000), 'E18', { maxBytes: 3999 });
    assert.equal(decode(empty(1000), { ...opts, maxBytes: 4000 }).tensors.get('w')!.data.length, 1000);
    // the sum over entries counts
    refusedBy(craft({ model: 'm', round: 0, tensors: [['a', [600], 'f4', 0, 0, 'rice1', 0, 0, 0], ['b', [600], 'f4', 0, 0, 'rice1', 0, 0, 0]] }), 'E18', { maxBytes: 4000 });
    // numbers past 2^53 and past 2^64 stay exact
    refusedBy(craft(null, undefined, '{"model":"m","round":0,"tensors":[["w",[1],"f4",18446744073709551616,4]]}'), 'E17');
    refusedBy(craft(null, undefined, '{"model":"m","round":9007199254740993,"tensors":[]}'), 'H4');
    refusedBy(craft(null, undefined, '{"model":"m","round":1e2,"tensors":[]}'), 'H4');
    refusedBy(craft(null, undefined, '{"model":"m","round":true,"tensors":[]}'), 'H4');
    refusedBy(craft(null, undefined, '{"model":"m","round":0,"tensors":[["w",[true],"f4",0,4]]}'), 'E3');
    refusedBy(craft(null, undefined, '{"model":"m","round":0,"tensors":[["w",[1.0],"f4",0,4]]}'), 'E3');
    refusedBy(craft(null, undefined, '[' .repeat(100000) + ']'.repeat(100000)), 'H1');
    refusedBy(craft(null, undefined, '{"model":"m","round":0,"tensors":[]} x'), 'H1');
    refusedBy(craft(null, undefined, '{"model":"m","round":0,"tensors":[],"model":"m"}'), 'H1');
    refusedBy(craft(null, undefined, '{"model":"m","round":0}'), 'H2');
    refusedBy(craft(null, undefined, '[]'), 'H2');
    // a header just under the limit without expected tensors is read; over it, refused at D6
    const pad = (len: number): string => '{"model":"m","round":0,"tensors":[]}'.padEnd(len, ' ');
    assert.equal(decode(craft(null, undefined, pad(1048576)), opts).tensors.size, 0);
    refusedBy(craft(null, undefined, pad(1048577)), 'D6');
  });

  test('Rice: the stream\'s structure (M3, M4) is checked before the positions (M5), as pfl-edge does', () => {
    /** a rice1 tensor of n = 100 elements, k = 0, c codewords, with this bit stream (padded with one-bits) */
    const rice = (c: number, bits: string): Uint8Array => {
      const nb = Math.ceil(bits.length / 8);
      const padded = bits.padEnd(8 * nb, '1');
      const stream = Uint8Array.from({ length: nb }, (_, i) => parseInt(padded.slice(8 * i, 8 * i + 8), 2));
      const data = new Uint8Array(4 * c + nb);
      data.set(stream, 4 * c);
      return craft({ model: 'm', round: 0, tensors: [['x', [100], 'f4', 0, 4 * c, 'rice1', 0, c, nb]] }, data);
    };
    refusedBy(rice(2, '1'.repeat(100) + '0' + '111'), 'M3'); // a quotient past the end, then too few codewords
    refusedBy(rice(2, '1'.repeat(100) + '000'), 'M4'); // a quotient past the end, then a codeword too many
    refusedBy(rice(2, '1'.repeat(50) + '0' + '1'.repeat(50) + '00'), 'M4'); // a position past the end, zero padding
    refusedBy(rice(2, '1'.repeat(40) + '0' + '1'.repeat(59) + '0'), 'M5'); // positions 40 and 100
    const ok = decode(rice(2, '1'.repeat(40) + '0' + '1'.repeat(58) + '0'), opts); // positions 40 and 99
    assert.deepEqual([...ok.tensors.get('x')!.mask!.keys()].filter((i) => ok.tensors.get('x')!.mask![i]), [40, 99]);
  });

  test('decoding options: expected tensors, model id, allow_missing', () => {
    const payload = new Uint8Array(readFileSync(VECTORS + 'example_a.bin'));
    const expected = { w: [2, 1], b: [1], v: [3] };
    assert.equal(decode(payload, { ...opts, expected, allowMissing: true }).tensors.size, 2);
    refusedBy(payload, 'D10', { expected });
    assert.equal(decode(payload, { ...opts, expected: new Map(Object.entries(expected)), allowMissing: true, modelId: 'cnn/10/1x28/deep0' }).round, 3);
    assert.throws(() => decode(payload, { maxBytes: 2 ** 40 }), RangeError);
  });

  test('mutated vectors are refused with a CodecError or decode cleanly, never anything else', () => {
    const rand = rng(7);
    const files = readdirSync(VECTORS).filter((f) => f.endsWith('.bin'));
    let refused = 0;
    let accepted = 0;
    for (const file of files) {
      const original = new Uint8Array(readFileSync(VECTORS + file));
      for (let trial = 0; trial < 60; trial++) {
        const p = original.slice(0, Math.max(41, original.length - (trial % 10 === 9 ? Math.floor(rand() * 8) : 0)));
        const flips = 1 + Math.floor(rand() * 3);
        for (let f = 0; f < flips; f++) {
          const at = Math.floor(rand() * (p.length - 32));
          p[at] = trial % 3 === 0 ? p[at]! ^ (1 << Math.floor(rand() * 8)) : Math.floor(rand() * 256);
        }
        p.set(nodeSha256(p.subarray(0, p.length - 32)), p.length - 32); // a correct trailer: reach the later checks
        try {
          decode(p, { ...opts, maxBytes: 1 << 20 });
          accepted++;
        } catch (err) {
          assert.ok(err instanceof CodecError, `${file} trial ${trial}: ${String(err)}`);
          refused++;
        }
      }
    }
    assert.ok(refused > accepted, `${refused} refused, ${accepted} accepted`);
  });
});
