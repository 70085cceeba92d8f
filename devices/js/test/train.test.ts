/**
 * Local training and evaluation (src/train.ts) with a gradient program written in JS (softmax regression): the
 * batch schedule is torch's randperm from the stream, a partial batch is padded to the program's fixed size with
 * copies of its first sample at weight 0, the loss falls, and evaluation scores logits in float64.
 */
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { MT19937 } from '../src/rng.js';
import { type GradientProgram, type Samples, batchGradients, epochBatches, evaluate, scoreLogits, trainLocal } from '../src/train.js';

const FEATURES = 4;
const CLASSES = 3;

/** Softmax regression as a gradient program: loss = sum(weight * ce) / max(sum(weight), 1). */
function softmaxProgram(batchSize: number, seen: { x: Float32Array; y: BigInt64Array; w: Float32Array }[] = []): GradientProgram {
  return {
    batchSize, keys: ['W', 'b'], trainable: ['W', 'b'], inputShape: [FEATURES],
    async run(x, y, weight, weights) {
      seen.push({ x: x.slice(), y: y.slice(), w: weight.slice() });
      const W = weights.get('W')!;
      const b = weights.get('b')!;
      const gW = new Float64Array(W.length);
      const gb = new Float64Array(b.length);
      let loss = 0;
      let total = 0;
      for (let i = 0; i < batchSize; i++) total += weight[i]!;
      const denom = Math.max(total, 1);
      for (let i = 0; i < batchSize; i++) {
        const z = Array.from({ length: CLASSES }, (_, c) => b[c]! + Array.from({ length: FEATURES }, (_, j) => W[c * FEATURES + j]! * x[i * FEATURES + j]!).reduce((s, v) => s + v, 0));
        const top = Math.max(...z);
        const e = z.map((v) => Math.exp(v - top));
        const s = e.reduce((p, v) => p + v, 0);
        const label = Number(y[i]);
        loss += (weight[i]! * (Math.log(s) + top - z[label]!)) / denom;
        for (let c = 0; c < CLASSES; c++) {
          const d = (weight[i]! * (e[c]! / s - (c === label ? 1 : 0))) / denom;
          gb[c] = gb[c]! + d;
          for (let j = 0; j < FEATURES; j++) gW[c * FEATURES + j] = gW[c * FEATURES + j]! + d * x[i * FEATURES + j]!;
        }
      }
      return { loss, grads: new Map([['W', Float32Array.from(gW)], ['b', Float32Array.from(gb)]]) };
    },
  };
}

function toyData(n: number, seed: number): Samples {
  const g = new MT19937(seed);
  const x = new Float32Array(n * FEATURES);
  const y = new Int32Array(n);
  for (let i = 0; i < n; i++) {
    y[i] = i % CLASSES;
    for (let j = 0; j < FEATURES; j++) x[i * FEATURES + j] = (j === y[i] ? 2 : 0) + (g.nextU32() / 2 ** 32 - 0.5);
  }
  return { x, y, n, sampleSize: FEATURES };
}

test('epoch batches: a fresh randperm per epoch, the last batch partial', () => {
  const b = epochBatches(10, 2, 4, new MT19937(5));
  assert.deepEqual(b.map((x) => x.length), [4, 4, 2, 4, 4, 2]);
  const g = new MT19937(5);
  const p1 = g.randperm(10);
  const p2 = g.randperm(10);
  assert.deepEqual([...b[0]!, ...b[1]!, ...b[2]!], [...p1]);
  assert.deepEqual([...b[3]!, ...b[4]!, ...b[5]!], [...p2]);
});

test('a partial batch is padded with its first sample at weight 0', async () => {
  const seen: { x: Float32Array; y: BigInt64Array; w: Float32Array }[] = [];
  const prog = softmaxProgram(4, seen);
  const data = toyData(6, 1);
  const weights = new Map([['W', new Float32Array(CLASSES * FEATURES)], ['b', new Float32Array(CLASSES)]]);
  await batchGradients(prog, weights, data, [5, 2]);
  const s = seen[0]!;
  assert.deepEqual([...s.w], [1, 1, 0, 0]);
  assert.deepEqual([...s.y], [2n, 2n, 2n, 2n]);
  for (const pad of [2, 3]) assert.deepEqual([...s.x.subarray(pad * FEATURES, (pad + 1) * FEATURES)], [...data.x.subarray(5 * FEATURES, 6 * FEATURES)]);
  await assert.rejects(batchGradients(prog, weights, data, [0, 1, 2, 3, 4]), RangeError);
});

test('padding changes nothing: the same gradients as an unpadded program', async () => {
  const data = toyData(3, 2);
  const W = new Float32Array(CLASSES * FEATURES).map((_, i) => 0.1 * Math.sin(i));
  const weights = new Map([['W', W], ['b', Float32Array.of(0.1, -0.2, 0.05)]]);
  const padded = await batchGradients(softmaxProgram(8), weights, data, [0, 1, 2]);
  const exact = await batchGradients(softmaxProgram(3), weights, data, [0, 1, 2]);
  assert.ok(Math.abs(padded.loss - exact.loss) < 1e-12);
  for (const k of ['W', 'b']) assert.deepEqual([...padded.grads.get(k)!], [...exact.grads.get(k)!]);
});

test('local training lowers the loss and evaluation counts right answers', async () => {
  const data = toyData(60, 3);
  const weights = new Map([['W', new Float32Array(CLASSES * FEATURES)], ['b', new Float32Array(CLASSES)]]);
  const cfg = { epochs: 3, batchSize: 8, lr: 0.5, momentum: 0.9, weightDecay: 0, clipNorm: 10, clipUnmasked: false };
  const first = await trainLocal(softmaxProgram(8), weights, data, { ...cfg, epochs: 1 }, new MT19937(1));
  const later = await trainLocal(softmaxProgram(8), weights, data, cfg, new MT19937(2));
  assert.equal(first.steps, 8);
  assert.equal(later.steps, 24);
  assert.equal(later.samples, 180);
  assert.ok(later.loss < first.loss, `${later.loss} < ${first.loss}`);
  const inference = {
    numClasses: CLASSES,
    async logits(x: Float32Array, n: number, w: ReadonlyMap<string, Float32Array>) {
      const out = new Float32Array(n * CLASSES);
      for (let i = 0; i < n; i++) for (let c = 0; c < CLASSES; c++) {
        let z = w.get('b')![c]!;
        for (let j = 0; j < FEATURES; j++) z += w.get('W')![c * FEATURES + j]! * x[i * FEATURES + j]!;
        out[i * CLASSES + c] = z;
      }
      return out;
    },
  };
  const r = await evaluate(inference, weights, data, 7);
  assert.ok(r.accuracy > 0.9, String(r.accuracy));
  assert.ok(r.loss > 0 && r.loss < 0.5, String(r.loss));
});

test('scoring logits: arg-max and the mean cross-entropy in natural log', () => {
  const logits = Float32Array.of(0, 0, 1, 2, 0, 0);
  const r = scoreLogits(logits, [2, 1], 2, 3);
  assert.equal(r.correct, 1);
  const ce = (z: number[], y: number): number => Math.log(z.reduce((s, v) => s + Math.exp(v), 0)) - z[y]!;
  assert.ok(Math.abs(r.loss - (ce([0, 0, 1], 2) + ce([2, 0, 0], 1))) < 1e-12);
});
