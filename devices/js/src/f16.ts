/**
 * IEEE-754 binary16 <-> binary32, bit-exact, without `Float16Array` (not in Node 20 nor in Hermes):
 * docs/codec.md section 4. Narrowing rounds to nearest, ties to even, producing subnormals where they round so;
 * widening is exact.
 */

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** The bits of `x` as binary32 (`x` is first rounded to binary32, as `Math.fround` does). */
export function f32Bits(x: number): number {
  f32[0] = x;
  return u32[0]!;
}

/** The binary32 value with these bits. */
export function f32FromBits(bits: number): number {
  u32[0] = bits >>> 0;
  return f32[0]!;
}

/**
 * The binary16 bits of the binary32 value with bits `b`, rounded to nearest, ties to even. NaN gives 0x7e00 and
 * +-Inf 0x7c00 / 0xfc00; a finite value of magnitude >= 65520 rounds to +-Inf (0x7c00 / 0xfc00): the caller
 * refuses those (the encoder never writes a non-finite value).
 */
export function f16BitsFromF32Bits(b: number): number {
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  const mant = b & 0x7fffff;
  if (exp === 0xff) return sign | (mant !== 0 ? 0x7e00 : 0x7c00);
  if (exp >= 113) {
    // normal in binary16 (unbiased exponent >= -14), or overflow
    if (exp > 142) return sign | 0x7c00;
    let h = ((exp - 112) << 10) | (mant >>> 13);
    const rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest === 0x1000 && (h & 1) === 1)) h += 1; // a carry into the exponent is right, up to Inf
    return sign | h;
  }
  if (exp === 0) return sign; // a binary32 zero or subnormal (< 2^-126) rounds to zero
  // a binary16 subnormal or zero: value = m * 2^(exp - 150) with m the 24-bit significand; in units of 2^-24
  const m = mant | 0x800000;
  const shift = 126 - exp; // >= 14
  if (shift > 24) return sign; // below 2^-25: rounds to zero
  let h = m >>> shift;
  const rest = m & ((1 << shift) - 1);
  const half = 1 << (shift - 1);
  if (rest > half || (rest === half && (h & 1) === 1)) h += 1; // may reach 0x400, the smallest normal: right
  return sign | h;
}

/** The binary16 bits of `x` (first rounded to binary32). */
export function f16Bits(x: number): number {
  return f16BitsFromF32Bits(f32Bits(x));
}

/** The value of binary16 bits `h`, exactly (as a JS number; every binary16 value is a binary32 value). */
export function f16Value(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >>> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0x1f) return frac !== 0 ? NaN : sign * Infinity;
  if (exp === 0) return sign * frac * 2 ** -24; // sign * 0 keeps -0.0
  return sign * (1024 + frac) * 2 ** (exp - 25);
}
