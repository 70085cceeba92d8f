/**
 * DisPFL's sparse machinery (src/dispfl.ts) against pfl-edge's own (`pfl_edge.sparse`, test/fixtures/sparse.json):
 * ERK densities and counts on the cnn's tensors, the initial masks from a slot's stream, the prune rate, and
 * prune-and-regrow by gradient (ties at both cuts going to the lower index) and at random.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { erkDensities, initMasks, maskOnes, pruneRate, pruneRegrow, selectSmallest } from '../src/dispfl.js';
import { nodeSha256 } from '../src/node.js';
import { MT19937, mtStream } from '../src/rng.js';
import { toHex } from '../src/sha256.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const fx = JSON.parse(readFileSync(FIX + 'sparse.json', 'utf8'));
const shapes = new Map<string, number[]>(Object.entries(fx.shapes));
const digest = (a: ArrayLike<number>): string => {
  const b = new BigInt64Array(a.length);
  for (let i = 0; i < a.length; i++) b[i] = BigInt(a[i]!);
  return toHex(nodeSha256(new Uint8Array(b.buffer)));
};

test('ERK densities and counts', () => {
  for (const e of fx.erk) {
    const d = erkDensities(shapes, e.density);
    for (const [k, v] of d) assert.equal(v, e.densities[k], `${e.density} ${k}`);
    assert.deepEqual(Object.fromEntries(maskOnes(shapes, d)), e.ones);
  }
});

test('initial masks from the slot\'s mask stream', () => {
  for (const m of fx.masks) {
    const masks = initMasks(shapes, erkDensities(shapes, m.density), mtStream(nodeSha256, m.seed, 'mask', m.slot));
    for (const [k, mask] of masks) {
      const ones: number[] = [];
      mask.forEach((v, i) => { if (v) ones.push(i); });
      assert.equal(digest(ones), m.digests[k], k);
    }
  }
});

test('the prune rate', () => {
  for (const [a, t, T, r] of fx.rates) assert.equal(pruneRate(a, t, T), r);
});

test('prune and regrow, by gradient and at random', () => {
  const f32 = (bits: number[]): Float32Array => new Float32Array(Uint32Array.from(bits).buffer);
  for (const r of fx.regrow) {
    const mask = Uint8Array.from(r.mask);
    const score = r.mode === 'gradient' ? { grads: f32(r.g) } : { gen: new MT19937(r.seed) };
    const got = pruneRegrow(f32(r.w), mask, r.alpha, score);
    assert.deepEqual([...got], r.new, r.mode);
    assert.equal(got.reduce((a, b) => a + b, 0), mask.reduce((a, b) => a + b, 0), 'the count of ones is kept');
  }
  assert.deepEqual([...selectSmallest(Float64Array.of(3, 1, 2, 1, 1), 2)], [1, 3], 'ties: the lower indices');
});
