/**
 * The `synthetic` data set (pfl_edge/data/synthetic.py; docs/determinism.md, "The synthetic data set"): 10 classes
 * of 1x28x28 model inputs, a smooth prototype per class plus noise, made from the documented MT19937 and IEEE-754
 * double arithmetic in a stated order, each input rounded to binary32 once, so that it equals pfl-edge's bit for bit.
 * Platform-neutral (typed arrays only).
 *
 * One generator, `MT19937(SYNTHETIC_SEED)`, draws in this order:
 * 1. the prototypes: 10 x 7 x 7 coarse values `AMP * (2u - 1)` (u its binary32 draws widened to double), upsampled
 *    bilinearly to 28 x 28 (half-pixel centres, edges clamped) as
 *    `(1 - wy) * ((1 - wx) * a + wx * b) + wy * ((1 - wx) * c + wx * d)`;
 * 2. the train split (6000), then 3. the test split (2000), each: labels `(arange(n) mod 10)[randperm(n)]`, then
 *    sample by sample and pixel by pixel (row-major) four draws and `x = f32(proto[y] + NOISE * (u1 + u2 + u3 + u4 - 2))`.
 */
import { MT19937 } from './rng.js';

export const SYNTHETIC_SEED = 20261129;
/** train, test */
export const SYNTHETIC_SIZES: readonly [number, number] = [6000, 2000];
export const SYNTHETIC_CLASSES = 10;
export const SYNTHETIC_CHANNELS = 1;
export const SYNTHETIC_SIDE = 28;
const COARSE = 7;
/** 1.25 * sqrt(3) as doubles compute it (this literal defines it): coarse values of standard deviation 1.25 */
const AMP = 2.1650635094610964;
/** the double nearest 1.5 * sqrt(3): sums of four uniforms (variance 1/3) scaled to std 1.5 */
const NOISE = 2.598076211353316;
const PIXELS = SYNTHETIC_SIDE * SYNTHETIC_SIDE;
/** binary32 draws of MT19937's `rand`: `(u & (2^24 - 1)) * 2^-24` */
const U24 = 2 ** -24;

export interface SyntheticSplit {
  /** [n, 1, 28, 28] model inputs, row-major */
  x: Float32Array;
  /** labels in [0, 10) */
  y: Int32Array;
  n: number;
}

export interface SyntheticSet {
  name: 'synthetic';
  channels: number;
  size: number;
  numClasses: number;
  /** [10, 28, 28] the class prototypes in double (pfl_edge.data.synthetic.prototypes) */
  prototypes: Float64Array;
  train: SyntheticSplit;
  test: SyntheticSplit;
}

/** Bilinear 7 -> 28 taps, half-pixel centres: `src = max((d + 0.5) / 4 - 0.5, 0)`, `i0 = floor(src)`,
 * `i1 = min(i0 + 1, 6)`, `w = src - i0` (every w a multiple of 1/8, exact). */
function taps(): { i0: Int32Array; i1: Int32Array; w: Float64Array } {
  const i0 = new Int32Array(SYNTHETIC_SIDE);
  const i1 = new Int32Array(SYNTHETIC_SIDE);
  const w = new Float64Array(SYNTHETIC_SIDE);
  const scale = SYNTHETIC_SIDE / COARSE; // 4, as SIDE // COARSE
  for (let d = 0; d < SYNTHETIC_SIDE; d++) {
    const src = Math.max((d + 0.5) / scale - 0.5, 0);
    const f = Math.floor(src);
    i0[d] = f;
    i1[d] = Math.min(f + 1, COARSE - 1);
    w[d] = src - f;
  }
  return { i0, i1, w };
}

/** The prototypes [10, 28, 28] in double, drawn from `g` (its first 490 draws). */
export function syntheticPrototypes(g: MT19937): Float64Array {
  const u = g.rand(SYNTHETIC_CLASSES * COARSE * COARSE);
  const coarse = new Float64Array(u.length);
  for (let i = 0; i < u.length; i++) coarse[i] = AMP * (2.0 * u[i]! - 1.0);
  const { i0, i1, w } = taps();
  const out = new Float64Array(SYNTHETIC_CLASSES * PIXELS);
  for (let k = 0; k < SYNTHETIC_CLASSES; k++) {
    const base = k * COARSE * COARSE;
    for (let r = 0; r < SYNTHETIC_SIDE; r++) {
      const row0 = base + i0[r]! * COARSE;
      const row1 = base + i1[r]! * COARSE;
      const wy = w[r]!;
      for (let col = 0; col < SYNTHETIC_SIDE; col++) {
        const c0 = i0[col]!;
        const c1 = i1[col]!;
        const wx = w[col]!;
        const a = coarse[row0 + c0]!;
        const b = coarse[row0 + c1]!;
        const c = coarse[row1 + c0]!;
        const d = coarse[row1 + c1]!;
        out[k * PIXELS + r * SYNTHETIC_SIDE + col] = (1.0 - wy) * ((1.0 - wx) * a + wx * b) + wy * ((1.0 - wx) * c + wx * d);
      }
    }
  }
  return out;
}

/** One split of n samples drawn from `g` (labels, then four draws per pixel, sample by sample). */
function split(g: MT19937, protos: Float64Array, n: number): SyntheticSplit {
  const perm = g.randperm(n);
  const y = new Int32Array(n);
  for (let i = 0; i < n; i++) y[i] = perm[i]! % SYNTHETIC_CLASSES;
  const x = new Float32Array(n * PIXELS);
  for (let s = 0; s < n; s++) {
    const proto = y[s]! * PIXELS;
    const out = s * PIXELS;
    for (let p = 0; p < PIXELS; p++) {
      // four binary32 draws, each a multiple of 2^-24 below 1: their sum (and minus 2) is exact in any order
      const u1 = (g.nextU32() & 0xffffff) * U24;
      const u2 = (g.nextU32() & 0xffffff) * U24;
      const u3 = (g.nextU32() & 0xffffff) * U24;
      const u4 = (g.nextU32() & 0xffffff) * U24;
      x[out + p] = Math.fround(protos[proto + p]! + NOISE * (u1 + u2 + u3 + u4 - 2.0));
    }
  }
  return { x, y, n };
}

/** `pfl_edge.data.synthetic.make_synthetic()`: the prototypes, then train (6000), then test (2000), from one generator
 * seeded `SYNTHETIC_SEED`. About 25 MB of binary32 inputs; the same in every federation (cache it). */
export function makeSynthetic(): SyntheticSet {
  const g = new MT19937(SYNTHETIC_SEED);
  const prototypes = syntheticPrototypes(g);
  const train = split(g, prototypes, SYNTHETIC_SIZES[0]);
  const test = split(g, prototypes, SYNTHETIC_SIZES[1]);
  return {
    name: 'synthetic', channels: SYNTHETIC_CHANNELS, size: SYNTHETIC_SIDE, numClasses: SYNTHETIC_CLASSES, prototypes, train, test,
  };
}
