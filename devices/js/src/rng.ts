/**
 * The federation's random streams, drawn exactly as pfl-edge draws them, so that a device takes its slot's samples
 * and batches bit for bit as the simulator does (platform-neutral: typed arrays and BigInt only).
 *
 * - `deriveSeed(seed, label, ...index)`: a stream's 63-bit seed, the first 8 bytes (little-endian) of
 *   SHA-256(`"<seed>:<label>:<i>:..."`) with the top bit cleared (`pfl_edge.seeding.derive_seed`).
 * - `MT19937`: torch's CPU generator (a 32-bit Mersenne Twister seeded with `init_genrand(seed mod 2^32)`):
 *   `randperm(n)` (Fisher-Yates over `arange(n)`, swapping `r[i]` with `r[i + u_i mod (n - i)]`) and `rand(n)`;
 *   the batches of local training, the regrowth screen's batch, the initial masks.
 * - `NumpyGenerator`: numpy's `default_rng(seed)` (`SeedSequence` -> `PCG64`), the methods the deal uses:
 *   `permutation`, `choice(a, size, replace=False)`, `integers(0, high, n)`, `random(n)`.
 */
import type { Sha256 } from './sha256.js';

// ------------------------------------------------------------------------------------------------ seeds

const MASK63 = (1n << 63n) - 1n;

/** `pfl_edge.seeding.derive_seed`: the 63-bit seed of stream `label`/`index` of run seed `seed`. */
export function deriveSeed(sha256: Sha256, seed: bigint | number, label: string, ...index: number[]): bigint {
  const text = [BigInt(seed).toString(), label, ...index.map((i) => BigInt(i).toString())].join(':');
  const digest = sha256(new TextEncoder().encode(text));
  let v = 0n;
  for (let i = 7; i >= 0; i--) v = (v << 8n) | BigInt(digest[i]!);
  return v & MASK63;
}

/** The named streams (`pfl_edge.seeding.Stream`). */
export const Stream = {
  PARTITION: 'partition',
  INIT: 'init',
  PARTICIPANTS: 'participants',
  TOPOLOGY: 'topology',
  MASK: 'mask',
  TRAIN: 'train',
  FINETUNE: 'finetune',
  REGROW: 'regrow',
  REGROW_RANDOM: 'regrow-random',
  PERSONAL: 'personal',
  HOLDOUT: 'holdout',
} as const;

// ------------------------------------------------------------------------------------------------ MT19937

/** torch's CPU generator: MT19937 seeded by `init_genrand(seed mod 2^32)`. */
export class MT19937 {
  private readonly mt = new Uint32Array(624);
  private mti = 624;

  constructor(seed: bigint | number) {
    const s = Number(BigInt(seed) & 0xffffffffn);
    const mt = this.mt;
    mt[0] = s >>> 0;
    for (let i = 1; i < 624; i++) {
      const prev = mt[i - 1]! ^ (mt[i - 1]! >>> 30);
      mt[i] = (Math.imul(1812433253, prev) + i) >>> 0;
    }
    this.mti = 624;
  }

  /** The next 32-bit output. */
  nextU32(): number {
    const mt = this.mt;
    if (this.mti >= 624) {
      for (let k = 0; k < 624; k++) {
        const y = (mt[k]! & 0x80000000) | (mt[(k + 1) % 624]! & 0x7fffffff);
        mt[k] = mt[(k + 397) % 624]! ^ (y >>> 1) ^ (y & 1 ? 0x9908b0df : 0);
      }
      this.mti = 0;
    }
    let y = mt[this.mti++]!;
    y ^= y >>> 11;
    y ^= (y << 7) & 0x9d2c5680;
    y ^= (y << 15) & 0xefc60000;
    y ^= y >>> 18;
    return y >>> 0;
  }

  /** `torch.randperm(n, generator=g)` for n < (2^32 - 1) / 20. */
  randperm(n: number): Int32Array {
    if (!Number.isSafeInteger(n) || n < 0 || n >= Math.floor((2 ** 32 - 1) / 20)) {
      throw new RangeError(`randperm of ${n} is out of the range drawn like torch`);
    }
    const out = new Int32Array(n);
    for (let i = 0; i < n; i++) out[i] = i;
    if (n < 2) return out;
    for (let i = 0; i < n - 1; i++) {
      const j = i + (this.nextU32() % (n - i));
      const t = out[i]!;
      out[i] = out[j]!;
      out[j] = t;
    }
    return out;
  }

  /** `torch.rand(n, generator=g)` in float32: `(u & (2^24 - 1)) * 2^-24`. */
  rand(n: number): Float32Array {
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = (this.nextU32() & 0xffffff) * 2 ** -24;
    return out;
  }
}

/** `pfl_edge.seeding.mt_stream`: the MT19937 of stream `name`/`index` of run seed `seed`. */
export function mtStream(sha256: Sha256, seed: bigint | number, name: string, ...index: number[]): MT19937 {
  return new MT19937(deriveSeed(sha256, seed, name, ...index));
}

// ------------------------------------------------------------------------------------------------ numpy

const M32 = 0xffffffffn;
const M64 = (1n << 64n) - 1n;
const M128 = (1n << 128n) - 1n;

/** numpy's `SeedSequence(entropy).generate_state(nWords, uint32)` (no spawn key, pool size 4). */
export function seedSequenceState(entropy: bigint, nWords: number): Uint32Array {
  if (entropy < 0n) throw new RangeError('entropy must be non-negative');
  const words: number[] = [];
  if (entropy === 0n) words.push(0);
  for (let x = entropy; x > 0n; x >>= 32n) words.push(Number(x & M32));
  let hashConst = 0x43b0d7e5;
  const hashmix = (value: number): number => {
    value = (value ^ hashConst) >>> 0;
    hashConst = Math.imul(hashConst, 0x931e8875) >>> 0;
    value = Math.imul(value, hashConst) >>> 0;
    return (value ^ (value >>> 16)) >>> 0;
  };
  const mix = (x: number, y: number): number => {
    let r = (Math.imul(0xca01f9dd, x) - Math.imul(0x4973f715, y)) >>> 0;
    r = (r ^ (r >>> 16)) >>> 0;
    return r;
  };
  const pool = new Uint32Array(4);
  for (let i = 0; i < 4; i++) pool[i] = hashmix(i < words.length ? words[i]! : 0);
  for (let s = 0; s < 4; s++) {
    for (let d = 0; d < 4; d++) if (s !== d) pool[d] = mix(pool[d]!, hashmix(pool[s]!));
  }
  for (let s = 4; s < words.length; s++) {
    for (let d = 0; d < 4; d++) pool[d] = mix(pool[d]!, hashmix(words[s]!));
  }
  const out = new Uint32Array(nWords);
  let hc = 0x8b51f9dd;
  for (let i = 0; i < nWords; i++) {
    let v = (pool[i % 4]! ^ hc) >>> 0;
    hc = Math.imul(hc, 0x58f38ded) >>> 0;
    v = Math.imul(v, hc) >>> 0;
    out[i] = (v ^ (v >>> 16)) >>> 0;
  }
  return out;
}

const PCG_MULT = (2549297995355413924n << 64n) + 4865540595714422341n;

/** numpy's PCG64 (XSL-RR 128/64) with its 32-bit draws taken as halves of a 64-bit one, low half first. */
export class PCG64 {
  private state: bigint;
  private readonly inc: bigint;
  private hasU32 = false;
  private u32 = 0;

  constructor(seed: bigint) {
    const w = seedSequenceState(seed, 8); // generate_state(4, uint64): pairs of uint32, little-endian
    const u64 = (i: number): bigint => (BigInt(w[2 * i + 1]!) << 32n) | BigInt(w[2 * i]!);
    const initstate = (u64(0) << 64n) | u64(1);
    const initseq = (u64(2) << 64n) | u64(3);
    this.inc = ((initseq << 1n) | 1n) & M128;
    this.state = 0n;
    this.step();
    this.state = (this.state + initstate) & M128;
    this.step();
  }

  private step(): void {
    this.state = (this.state * PCG_MULT + this.inc) & M128;
  }

  nextU64(): bigint {
    this.step();
    const s = this.state;
    const x = ((s >> 64n) ^ s) & M64;
    const rot = s >> 122n;
    return ((x >> rot) | (x << ((64n - rot) & 63n))) & M64;
  }

  nextU32(): number {
    if (this.hasU32) {
      this.hasU32 = false;
      return this.u32;
    }
    const v = this.nextU64();
    this.hasU32 = true;
    this.u32 = Number(v >> 32n);
    return Number(v & M32);
  }

  nextDouble(): number {
    return Number(this.nextU64() >> 11n) * (1.0 / 9007199254740992.0);
  }
}

/** numpy's `Generator` (`default_rng(seed)`), the methods a deal draws with. */
export class NumpyGenerator {
  readonly bits: PCG64;

  constructor(seed: bigint | number) {
    this.bits = new PCG64(BigInt(seed));
  }

  /** `random_interval(max)`: a value in [0, max] by masked rejection (what `shuffle` draws with). */
  private interval(max: number): number {
    if (max === 0) return 0;
    if (max > 0xffffffff) throw new RangeError('intervals above 2^32 are not drawn here');
    let mask = max;
    mask |= mask >>> 1;
    mask |= mask >>> 2;
    mask |= mask >>> 4;
    mask |= mask >>> 8;
    mask |= mask >>> 16;
    mask >>>= 0;
    for (;;) {
      const v = (this.bits.nextU32() & mask) >>> 0;
      if (v <= max) return v;
    }
  }

  /** `random_bounded_uint64(0, rng)` without masking: Lemire's method on 32-bit draws (rng < 2^32 - 1). */
  bounded(rng: number): number {
    if (rng === 0) return 0;
    if (rng >= 0xffffffff) throw new RangeError('bounds of 2^32 and above are not drawn here');
    const excl = rng + 1;
    let m = BigInt(this.bits.nextU32()) * BigInt(excl);
    let left = Number(m & M32);
    if (left < excl) {
      const threshold = (0xffffffff - rng) % excl;
      while (left < threshold) {
        m = BigInt(this.bits.nextU32()) * BigInt(excl);
        left = Number(m & M32);
      }
    }
    return Number(m >> 32n);
  }

  /** `shuffle` of a 1-D array, in place. */
  shuffle(a: { length: number; [i: number]: number }): void {
    for (let i = a.length - 1; i >= 1; i--) {
      const j = this.interval(i);
      const t = a[i]!;
      a[i] = a[j]!;
      a[j] = t;
    }
  }

  /** `permutation(n)` (an int) or `permutation(array)` (a shuffled copy of a 1-D array). */
  permutation(x: number | ArrayLike<number>): Float64Array {
    let out: Float64Array;
    if (typeof x === 'number') {
      out = new Float64Array(x);
      for (let i = 0; i < x; i++) out[i] = i;
    } else {
      out = Float64Array.from(x);
    }
    this.shuffle(out);
    return out;
  }

  private shuffleInt(data: Float64Array, n: number, first: number): void {
    for (let i = n - 1; i >= first; i--) {
      const j = this.bounded(i);
      const t = data[i]!;
      data[i] = data[j]!;
      data[j] = t;
    }
  }

  /** `choice(a, size, replace=False)` of a 1-D array `a` (`shuffle=True`, no `p`). */
  choiceNoReplace(a: ArrayLike<number>, size: number): Float64Array {
    const pop = a.length;
    if (size > pop) throw new RangeError('cannot take a larger sample than the population without replacement');
    if (size < 0) throw new RangeError('negative size');
    let idx: Float64Array;
    if (pop > 10000 && size > Math.floor(pop / 50)) {
      // tail shuffle: the last `size` elements of a partially shuffled arange(pop)
      const all = new Float64Array(pop);
      for (let i = 0; i < pop; i++) all[i] = i;
      this.shuffleInt(all, pop, Math.max(pop - size, 1));
      idx = all.slice(pop - size);
    } else {
      // Floyd's algorithm, then a shuffle of the chosen ones
      idx = new Float64Array(size);
      const seen = new Set<number>();
      for (let j = pop - size; j < pop; j++) {
        const v = this.bounded(j);
        if (!seen.has(v)) {
          seen.add(v);
          idx[j - pop + size] = v;
        } else {
          seen.add(j);
          idx[j - pop + size] = j;
        }
      }
      this.shuffleInt(idx, size, 1);
    }
    const out = new Float64Array(size);
    for (let i = 0; i < size; i++) out[i] = a[idx[i]!]!;
    return out;
  }

  /** `integers(0, high, n)` (int64, `endpoint=False`), for high <= 2^32 - 1. */
  integers(high: number, n: number): Float64Array {
    const out = new Float64Array(n);
    const rng = high - 1;
    for (let i = 0; i < n; i++) out[i] = rng === 0 ? 0 : this.bounded(rng);
    return out;
  }

  /** `random(n)`: doubles in [0, 1). */
  random(n: number): Float64Array {
    const out = new Float64Array(n);
    for (let i = 0; i < n; i++) out[i] = this.bits.nextDouble();
    return out;
  }
}

/** `pfl_edge.seeding.numpy_rng`: the numpy generator of stream `label`/`index` of run seed `seed`. */
export function numpyStream(sha256: Sha256, seed: bigint | number, label: string, ...index: number[]): NumpyGenerator {
  return new NumpyGenerator(deriveSeed(sha256, seed, label, ...index));
}
