/**
 * The optimiser step (src/sgd.ts): a hand-worked case, clipping and masks by hand, and bit-exactness against
 * pfl-edge's own `pfl_edge.sgd.SGD` on float32 arrays (test/fixtures/sgd.json: momentum, weight decay, clipping
 * before and after DisPFL's masks, Ditto's proximal term; three steps each).
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { SGD, lrAt, type TrainConfig } from '../src/sgd.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const close = (a: ArrayLike<number>, b: number[], tol = 1e-6): void => {
  assert.equal(a.length, b.length);
  for (let i = 0; i < b.length; i++) assert.ok(Math.abs(a[i]! - b[i]!) <= tol, `[${i}] ${a[i]} vs ${b[i]}`);
};
const cfg = (c: Partial<TrainConfig>): TrainConfig => ({
  epochs: 1, batchSize: 1, lr: 0.1, momentum: 0, weightDecay: 0, clipNorm: null, clipUnmasked: false, ...c,
});

test('SGD with momentum and weight decay, worked by hand', () => {
  const w = Float32Array.of(1, -2);
  const opt = new SGD(new Map([['w', w]]), cfg({ lr: 0.1, momentum: 0.9, weightDecay: 0.01 }));
  const g = Float32Array.of(0.5, 1.0);
  // step 1: d = g + 0.01 w = [0.51, 0.98]; buf = d; w -= 0.1 d
  opt.step(new Map([['w', g]]));
  close(w, [0.949, -2.098]);
  // step 2: d = g + 0.01 w = [0.50949, 0.97902]; buf = 0.9 [0.51, 0.98] + d = [0.96849, 1.86102]; w -= 0.1 buf
  opt.step(new Map([['w', g]]));
  close(w, [0.852151, -2.284102]);
  assert.deepEqual([...g], [0.5, 1.0], 'the caller\'s gradient is not changed');
});

test('clipping scales by clip_norm / (norm + 1e-6) over every tensor; masks before or after', () => {
  const a = Float32Array.of(0, 0);
  const b = Float32Array.of(0);
  new SGD(new Map([['a', a], ['b', b]]), cfg({ lr: 1, clipNorm: 1 })).step(new Map([['a', Float32Array.of(3, 0)], ['b', Float32Array.of(4)]]));
  close(a, [-0.6, 0]);
  close(b, [-0.8]);
  // below the bound: untouched
  const c = Float32Array.of(0);
  new SGD(new Map([['c', c]]), cfg({ lr: 1, clipNorm: 10 })).step(new Map([['c', Float32Array.of(3)]]));
  close(c, [-3]);
  // DisPFL: clip the whole gradient (norm 5), then mask the first element out; the weight stays 0 off the mask
  const m = Float32Array.of(1, 0);
  const unmasked = Float32Array.of(1, 1);
  new SGD(new Map([['w', unmasked]]), cfg({ lr: 1, clipNorm: 1, clipUnmasked: true }), new Map([['w', Float32Array.of(0, 1)]]))
    .step(new Map([['w', Float32Array.of(3, 4)]]));
  close(unmasked, [0, 1 - 0.8]);
  // mask first (norm 3), then clip: the kept element scaled to 1
  const masked = Float32Array.of(1, 1);
  new SGD(new Map([['w', masked]]), cfg({ lr: 1, clipNorm: 1, clipUnmasked: false }), new Map([['w', m]]))
    .step(new Map([['w', Float32Array.of(3, 4)]]));
  close(masked, [0, 0]);
});

test('the learning-rate schedule', () => {
  assert.equal(lrAt(0.1, 0.5, 1), 0.1);
  assert.equal(lrAt(0.1, 0.5, 3), 0.025);
  assert.equal(lrAt(0.1, 0.5, 0), 0.1, 'round 0 uses round 1\'s');
});

interface Case {
  config: { lr: number; momentum?: number; weight_decay?: number; clip_norm?: number; clip_unmasked?: boolean; prox?: number };
  w0: Record<string, number[]>;
  masks: Record<string, number[]>;
  anchor: Record<string, number[]>;
  grads: Record<string, number[]>[];
  after: Record<string, number[]>[];
}

const f32 = (bits: number[]): Float32Array => new Float32Array(Uint32Array.from(bits).buffer);

test('equal bit for bit to pfl_edge.sgd.SGD', () => {
  const cases: Case[] = JSON.parse(readFileSync(FIX + 'sgd.json', 'utf8')).cases;
  for (const c of cases) {
    const w = new Map(Object.entries(c.w0).map(([k, v]) => [k, f32(v)]));
    const masks = new Map(Object.entries(c.masks).map(([k, v]) => [k, f32(v)]));
    for (const [k, m] of masks) {
      const x = w.get(k)!;
      for (let i = 0; i < x.length; i++) x[i] = x[i]! * m[i]!;
    }
    const opt = new SGD(w, cfg({
      lr: c.config.lr, momentum: c.config.momentum ?? 0, weightDecay: c.config.weight_decay ?? 0,
      clipNorm: c.config.clip_norm ?? null, clipUnmasked: c.config.clip_unmasked ?? false, prox: c.config.prox ?? 0,
    }), masks, new Map(Object.entries(c.anchor).map(([k, v]) => [k, f32(v)])));
    c.grads.forEach((g, step) => {
      opt.step(new Map(Object.entries(g).map(([k, v]) => [k, f32(v)])));
      for (const [k, v] of w) {
        assert.deepEqual([...new Uint32Array(v.buffer)], c.after[step]![k], `${JSON.stringify(c.config)} step ${step + 1} ${k}`);
      }
    });
  }
});
