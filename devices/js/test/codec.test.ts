/**
 * The golden vectors of docs/vectors against this codec (as tests/pfl_edge/test_golden_vectors.py checks them
 * against pfl-edge's): every positive vector decodes to its .json and re-encodes to the same bytes; every negative
 * vector of index.json is refused by the check its `about` names, with a message holding its `error`. Both lists come
 * from index.json ({format, positive, negative}), which must list every .bin of the folder once.
 */
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readFileSync, readdirSync } from 'node:fs';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { CodecError, chooseMaskCoding, decode, encode, toEncodeInput, type DecodeOptions, type TensorIn } from '../src/codec.js';
import { f32Bits } from '../src/f16.js';
import { nodeSha256 } from '../src/node.js';
import { sha256 as jsSha256 } from '../src/sha256.js';

// dist/test/ -> devices/js/ -> the repository root
const VECTORS = fileURLToPath(new URL('../../../../docs/vectors/', import.meta.url));

interface VectorTensor {
  name: string;
  shape: number[];
  dtype: 'f4' | 'f2';
  coding: 'bitmap' | 'rice1' | 'rice0' | null;
  k?: number;
  ones?: number;
  mask_nbytes?: number;
  mask_ones?: number[];
  values: number[];
  f32_bits: string[];
  f16_bits?: string[];
}

interface Vector {
  model: string;
  round: number;
  payload_bytes: number;
  payload_sha256: string;
  tensors: VectorTensor[];
}

interface Positive {
  name: string;
  file: string;
  json: string;
  about: string;
}

interface Negative {
  name: string;
  file: string;
  about: string;
  error: string;
  decode_args: { expected?: Record<string, number[]>; model_id?: string; max_bytes?: number; allow_missing?: boolean };
}

interface Index {
  format: string;
  positive: Positive[];
  negative: Negative[];
}

const INDEX: Index = JSON.parse(readFileSync(VECTORS + 'index.json', 'utf8'));
const POSITIVE = INDEX.positive.map((p) => p.name);
const NEGATIVE = INDEX.negative;

const bin = (file: string): Uint8Array => new Uint8Array(readFileSync(VECTORS + file));
const content = (name: string): Vector => JSON.parse(readFileSync(VECTORS + name + '.json', 'utf8'));
const hex32 = (x: number): string => f32Bits(x).toString(16).padStart(8, '0');
const numel = (shape: number[]): number => shape.reduce((a, b) => a * b, 1);

function fromJson(v: Vector): TensorIn[] {
  return v.tensors.map((t) => {
    const sent = t.f32_bits.map((b) => {
      const u = new Uint32Array([parseInt(b, 16)]);
      return new Float32Array(u.buffer)[0]!;
    });
    const n = numel(t.shape);
    if (t.coding === null) return { name: t.name, shape: t.shape, data: Float32Array.from(sent) };
    const data = new Float32Array(n);
    const mask = new Uint8Array(n);
    t.mask_ones!.forEach((i, j) => {
      mask[i] = 1;
      data[i] = sent[j]!;
    });
    return { name: t.name, shape: t.shape, data, mask };
  });
}

function decodeArgs(a: Negative['decode_args']): DecodeOptions {
  const out: DecodeOptions = { sha256: nodeSha256 };
  if (a.expected !== undefined) out.expected = a.expected;
  if (a.model_id !== undefined) out.modelId = a.model_id;
  if (a.max_bytes !== undefined) out.maxBytes = a.max_bytes;
  if (a.allow_missing !== undefined) out.allowMissing = a.allow_missing;
  for (const key of Object.keys(a)) {
    assert.ok(['expected', 'model_id', 'max_bytes', 'allow_missing'].includes(key), `unknown decode_args key ${key}`);
  }
  return out;
}

test('the vectors are there', (t) => {
  assert.ok(POSITIVE.length >= 15, `${POSITIVE.length} positive vectors`);
  assert.ok(NEGATIVE.length >= 20, `${NEGATIVE.length} negative vectors`);
  const codings = new Set(POSITIVE.flatMap((n) => content(n).tensors.map((t) => t.coding)));
  assert.deepEqual([...codings].sort(), ['bitmap', null, 'rice0', 'rice1'].sort());
  t.diagnostic(`vectors: ${POSITIVE.length} positive, ${NEGATIVE.length} negative`);
});

test('index.json lists every vector once', () => {
  assert.equal(INDEX.format, 'pfl-edge-vectors/1');
  const listed = [...INDEX.positive, ...INDEX.negative].map((e) => e.file);
  assert.equal(new Set(listed).size, listed.length, 'a .bin is listed twice');
  assert.deepEqual([...listed].sort(), readdirSync(VECTORS).filter((f) => f.endsWith('.bin')).sort());
  for (const p of INDEX.positive) {
    assert.equal(p.file, p.name + '.bin');
    assert.equal(p.json, p.name + '.json');
    assert.equal((JSON.parse(readFileSync(VECTORS + p.json, 'utf8')) as { vector: string }).vector, p.name);
  }
});

describe('positive vectors', () => {
  for (const name of POSITIVE) {
    test(`${name} decodes to its .json`, () => {
      const payload = bin(name + '.bin');
      const want = content(name);
      assert.equal(payload.length, want.payload_bytes);
      assert.equal(createHash('sha256').update(payload).digest('hex'), want.payload_sha256);
      for (const sha256 of [nodeSha256, jsSha256]) {
        const d = decode(payload, { sha256 });
        assert.equal(d.model, want.model);
        assert.equal(d.round, want.round);
        assert.deepEqual([...d.tensors.keys()], want.tensors.map((t) => t.name));
        for (const t of want.tensors) {
          const got = d.tensors.get(t.name)!;
          assert.deepEqual(got.shape, t.shape);
          assert.equal(got.dtype, t.dtype);
          assert.equal(got.coding, t.coding);
          assert.equal(got.data.length, numel(t.shape));
          let sent: number[];
          if (t.coding === null) {
            assert.equal(got.mask, null);
            sent = [...got.data];
          } else {
            assert.equal(got.k, t.k);
            assert.equal(got.ones, t.ones);
            assert.equal(t.mask_ones!.length, t.ones);
            const onesAt = [...got.mask!.keys()].filter((i) => got.mask![i] === 1);
            assert.deepEqual(onesAt, t.mask_ones);
            assert.ok([...got.mask!].every((b) => b === 0 || b === 1));
            // +0.0 (bits 00000000) outside the mask
            const outside = [...got.data].filter((_, i) => got.mask![i] === 0).map(hex32);
            assert.deepEqual(outside, outside.map(() => '00000000'));
            sent = t.mask_ones!.map((i) => got.data[i]!);
            // the coding the encoder would choose for this mask is the one sent (section 5.3)
            const choice = chooseMaskCoding(got.mask!, got.data.length);
            assert.deepEqual([choice.coding, choice.k, choice.nbytes], [t.coding, t.k, t.mask_nbytes]);
          }
          assert.deepEqual(sent.map(hex32), t.f32_bits);
          // values are exact doubles; Object.is keeps -0.0 apart from +0.0
          sent.forEach((v, i) => assert.ok(Object.is(v, t.values[i]), `${t.name}[${i}]: ${v} != ${t.values[i]}`));
        }
      }
    });

    test(`${name} re-encodes to the same bytes`, () => {
      const payload = bin(name + '.bin');
      const want = content(name);
      const f2 = want.tensors.every((t) => t.dtype === 'f2');
      for (const sha256 of [nodeSha256, jsSha256]) {
        const fromJsonBytes = encode({ model: want.model, round: want.round, dtype: f2 ? 'f2' : 'f4', tensors: fromJson(want) }, { sha256 });
        assert.deepEqual(fromJsonBytes, payload, 'encode(the .json) differs from the .bin');
        const again = encode(toEncodeInput(decode(payload, { sha256 })), { sha256 });
        assert.deepEqual(again, payload, 'encode(decode(.bin)) differs from the .bin');
      }
    });
  }

  test('f16 vectors: the wire bits are the documented f16_bits', () => {
    for (const name of POSITIVE) {
      const want = content(name);
      const payload = bin(name + '.bin');
      const hlen = new DataView(payload.buffer, payload.byteOffset).getUint32(5, true);
      const d = decode(payload, { sha256: nodeSha256 });
      const hdr = JSON.parse(new TextDecoder().decode(payload.subarray(9, 9 + hlen))) as { tensors: [string, number[], string, number, number][] };
      for (const [i, t] of want.tensors.entries()) {
        if (t.dtype !== 'f2') continue;
        const [, , dtype, offset, nbytes] = hdr.tensors[i]!;
        assert.equal(dtype, 'f2');
        const view = new DataView(payload.buffer, payload.byteOffset + 9 + hlen + offset, nbytes);
        const wire = Array.from({ length: nbytes / 2 }, (_, j) => view.getUint16(2 * j, true).toString(16).padStart(4, '0'));
        assert.deepEqual(wire, t.f16_bits, `${name}/${t.name}`);
        assert.ok(d.tensors.has(t.name));
      }
    }
  });
});

describe('negative vectors', () => {
  for (const neg of NEGATIVE) {
    test(`${neg.name} is refused (${neg.about.split(':')[0]})`, () => {
      const payload = bin(neg.file);
      for (const sha256 of [nodeSha256, jsSha256]) {
        assert.throws(
          () => decode(payload, { ...decodeArgs(neg.decode_args), sha256 }),
          (err: unknown) => {
            assert.ok(err instanceof CodecError, `not a CodecError: ${String(err)}`);
            assert.equal(err.check, neg.about.split(':')[0], `refused by ${err.check}: ${err.message}`);
            assert.ok(err.message.includes(neg.error), `message ${JSON.stringify(err.message)} lacks ${JSON.stringify(neg.error)}`);
            return true;
          },
        );
      }
    });
  }

  test('every check of codec.md section 7 has a negative vector', () => {
    const doc = readFileSync(VECTORS + '../codec.md', 'utf8');
    const section = doc.split('## 7.')[1]!.split('## 8.')[0]!;
    const checks = new Set([...section.matchAll(/^\| ([DHEVM]\d+) \|/gm)].map((m) => m[1]!));
    assert.ok(checks.size >= 40);
    assert.deepEqual([...checks].sort(), [...new Set(NEGATIVE.map((n) => n.about.split(':')[0]!))].sort());
  });
});
