/**
 * The pfl-edge payload format, version 1: decode and encode, written from docs/codec.md (the normative spec).
 *
 * Section numbers below are those of docs/codec.md; check names (D1 ... M5) are those of its section 7, in the
 * order it gives. The decoder trusts nothing: every check on the prefix, the trailer and the header runs before
 * anything sized by the payload is allocated, and the decoded tensors together take at most `maxBytes` bytes
 * (plus one byte per element for a sparse tensor's mask).
 *
 * Plain typed arrays only (no Node API): the same file runs in a React Native app. SHA-256 comes through the
 * `sha256` option (default: the plain TypeScript one of ./sha256.ts; on Node pass `nodeSha256` from ./node.ts).
 */

import { f16BitsFromF32Bits, f16Value, f32Bits } from './f16.js';
import { JInt, JObject, JsonError, dumps, parse, pyRepr, type Dumpable, type JValue } from './json.js';
import { sha256 as jsSha256, type Sha256 } from './sha256.js';
import { Utf8Error, codePointLength, decodeUtf8 } from './utf8.js';

// ------------------------------------------------------------------------------------------------ constants

/** "PFLE" (section 1). */
export const MAGIC = Uint8Array.of(0x50, 0x46, 0x4c, 0x45);
export const FORMAT_VERSION = 1;
/** magic (4) + version (1) + header length (4). */
export const PREFIX_BYTES = 9;
export const TRAILER_BYTES = 32;
/** The smallest payload: prefix and trailer around an empty header and no data (section 1). */
export const FIXED_BYTES = PREFIX_BYTES + TRAILER_BYTES;
/** Section 7: the default `max_bytes` (256 MiB). */
export const DEFAULT_MAX_BYTES = 268435456;
/** The largest `maxBytes` this decoder takes: every byte and bit index then stays a safe 32-bit quantity. */
export const MAX_MAX_BYTES = 2 ** 32 - 1;
/** Section 7: the header limit without expected tensors (1 MiB). */
export const MAX_HEADER_BYTES = 1048576;
export const MAX_DIMS = 64;
export const MAX_RICE_K = 62;
/** docs/protocol.md: the protocol never uses a round above this (the codec itself takes any round >= 0). */
export const MAX_ROUND = 1000000;

export type Dtype = 'f4' | 'f2';
export type Coding = 'bitmap' | 'rice1' | 'rice0';

const VALUE_SIZE: Record<Dtype, 2 | 4> = { f4: 4, f2: 2 };
const I64_MAX = (1n << 63n) - 1n;

// ------------------------------------------------------------------------------------------------ errors

/** The check of section 7 that refused a payload, or `encode` for a refusal of the encoder. */
export type Check =
  | 'D1' | 'D2' | 'D3' | 'D4' | 'D5' | 'D6' | 'D7' | 'D8' | 'D9' | 'D10'
  | 'H1' | 'H2' | 'H3' | 'H4' | 'H5' | 'H6'
  | 'E1' | 'E2' | 'E3' | 'E4' | 'E5' | 'E6' | 'E7' | 'E8' | 'E9' | 'E10'
  | 'E11' | 'E12' | 'E13' | 'E14' | 'E15' | 'E16' | 'E17' | 'E18'
  | 'V1' | 'M1' | 'M2' | 'M3' | 'M4' | 'M5'
  | 'encode';

/**
 * A payload refused (or a value the encoder will not write). `check` names the check of docs/codec.md section 7;
 * the message follows the wording of that section (and of pfl-edge's `CodecError`), so the substrings the negative
 * vectors name are found in it.
 */
export class CodecError extends Error {
  constructor(
    readonly check: Check,
    message: string,
  ) {
    super(message);
    this.name = 'CodecError';
  }
}

function refuse(check: Check, message: string): never {
  throw new CodecError(check, message);
}

// ------------------------------------------------------------------------------------------------ types

export interface DecodedTensor {
  readonly name: string;
  /** outermost first; `[]` for a scalar */
  readonly shape: number[];
  /** how the values were sent; `data` is binary32 either way */
  readonly dtype: Dtype;
  /** every element, row-major; +0.0 where a sparse tensor's mask is 0 */
  readonly data: Float32Array;
  /** a sparse tensor's mask, one byte (0 or 1) per element in flat index order; null for a dense one */
  readonly mask: Uint8Array | null;
  /** the mask's coding; null for a dense tensor */
  readonly coding: Coding | null;
  /** the Rice parameter as sent (0 for bitmap and dense) */
  readonly k: number;
  /** the number of values sent (n for a dense tensor) */
  readonly ones: number;
}

export interface Decoded {
  readonly model: string;
  readonly round: number;
  /** in header order */
  readonly tensors: Map<string, DecodedTensor>;
}

export interface DecodeOptions {
  /** refuse payloads larger than this, and tensors that would decode to more (default 256 MiB) */
  maxBytes?: number;
  /** the receiver's model: tensor name -> shape; bounds the header and must match (checks H6, D6, D10) */
  expected?: ReadonlyMap<string, readonly number[]> | Readonly<Record<string, readonly number[]>>;
  /** the receiver's model id (check D9) */
  modelId?: string;
  /** with `expected`: a payload may leave expected tensors out (a base part, a neighbour's model) */
  allowMissing?: boolean;
  /** SHA-256 for the trailer (default: the TypeScript one) */
  sha256?: Sha256;
}

export interface TensorIn {
  readonly name: string;
  readonly shape: readonly number[];
  /** n values, row-major (rounded to binary32 first if they are not already) */
  readonly data: ArrayLike<number>;
  /** n entries, truthy = sent; present makes the tensor sparse */
  readonly mask?: ArrayLike<number | boolean> | null;
}

export interface EncodeInput {
  readonly model: string;
  readonly round: number;
  /** in the order to send them (the sender's state_dict order) */
  readonly tensors: Iterable<TensorIn>;
  /** how values are stored, for every tensor (default f4) */
  readonly dtype?: Dtype;
}

export interface EncodeOptions {
  sha256?: Sha256;
}

// ------------------------------------------------------------------------------------------------ helpers

const LITTLE_ENDIAN_HOST = new Uint8Array(Uint32Array.of(1).buffer)[0] === 1;

const ceilDiv8 = (x: bigint): bigint => (x + 7n) / 8n;
const bitLength = (x: bigint): number => (x === 0n ? 0 : x.toString(2).length);

/** Python's repr of a tuple of ints, as pfl-edge writes shapes in D10's message. */
const tupleRepr = (shape: readonly number[]): string =>
  shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(', ')})`;

const listRepr = (shape: readonly number[]): string => `[${shape.join(', ')}]`;

const bytesRepr = (b: Uint8Array): string => {
  let s = "b'";
  for (const x of b) {
    if (x === 0x27 || x === 0x5c) s += '\\' + String.fromCharCode(x);
    else if (x >= 0x20 && x < 0x7f) s += String.fromCharCode(x);
    else s += '\\x' + x.toString(16).padStart(2, '0');
  }
  return s + "'";
};

const isInt = (v: JValue): v is JInt => v instanceof JInt;

function expectedMap(e: DecodeOptions['expected']): Map<string, readonly number[]> | null {
  if (e === undefined) return null;
  if (e instanceof Map) return new Map(e);
  return new Map(Object.entries(e as Record<string, readonly number[]>));
}

function checkMaxBytes(maxBytes: number): void {
  if (!Number.isSafeInteger(maxBytes) || maxBytes < 0 || maxBytes > MAX_MAX_BYTES) {
    throw new RangeError(`maxBytes must be an integer 0 ... ${MAX_MAX_BYTES}, not ${maxBytes}`);
  }
}

function bytesEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i]! ^ b[i]!;
  return diff === 0;
}

/** An entry of the header after checks E1 ... E15 (section 2.1); sizes still exact bigints. */
interface Entry {
  name: string;
  shape: number[];
  n: bigint;
  dtype: Dtype;
  offset: bigint;
  nbytes: bigint;
  coding: Coding | null;
  k: number;
  ones: bigint;
  maskNbytes: bigint;
}

// ------------------------------------------------------------------------------------------------ decode

/** Decodes a payload (section 7: every check in order); throws {@link CodecError} on any fault. */
export function decode(payload: Uint8Array, options: DecodeOptions = {}): Decoded {
  const maxBytes = options.maxBytes ?? DEFAULT_MAX_BYTES;
  checkMaxBytes(maxBytes);
  const expected = expectedMap(options.expected);
  const hash = options.sha256 ?? jsSha256;
  const size = payload.length;

  // prefix and trailer: D1 ... D7
  if (size > maxBytes) refuse('D1', `payload of ${size} bytes is over the limit of ${maxBytes} bytes`);
  if (size < FIXED_BYTES) refuse('D2', `payload truncated: ${size} bytes, shorter than the fixed ${FIXED_BYTES}`);
  if (!bytesEqual(payload.subarray(0, 4), MAGIC)) {
    refuse('D3', `not a pfl-edge payload: starts with ${bytesRepr(payload.subarray(0, 4))}, not b'PFLE'`);
  }
  const version = payload[4]!;
  if (version !== FORMAT_VERSION) {
    refuse('D4', `unsupported payload format version ${version}; this build reads version ${FORMAT_VERSION}`);
  }
  const hlen = (payload[5]! | (payload[6]! << 8) | (payload[7]! << 16) | (payload[8]! << 24)) >>> 0;
  if (PREFIX_BYTES + hlen + TRAILER_BYTES > size) {
    refuse('D5', `payload truncated: header of ${hlen} bytes does not fit in ${size} bytes`);
  }
  let headerLimit = MAX_HEADER_BYTES;
  if (expected !== null) {
    headerLimit = 4096;
    for (const [name, shape] of expected) headerLimit += 256 + 6 * codePointLength(name) + 21 * shape.length;
  }
  if (hlen > headerLimit) {
    const forWhat = expected !== null ? `the ${expected.size} expected tensors` : 'any header';
    refuse('D6', `malformed header: ${hlen} bytes, over the limit of ${headerLimit} for ${forWhat}`);
  }
  const body = payload.subarray(0, size - TRAILER_BYTES);
  if (!bytesEqual(hash(body), payload.subarray(size - TRAILER_BYTES))) {
    refuse('D7', 'payload corrupt or truncated: sha256 does not match');
  }

  // the header: H1 ... H6
  const header = parseHeader(payload.subarray(PREFIX_BYTES, PREFIX_BYTES + hlen));
  const model = header.get('model')!;
  if (typeof model !== 'string') refuse('H3', 'malformed header: model is not a string');
  const roundValue = header.get('round')!;
  if (!isInt(roundValue) || roundValue.value < 0n) {
    refuse('H4', `malformed header: round ${pyRepr(roundValue)} is not a non-negative integer`);
  }
  const roundBig = (roundValue as JInt).value;
  if (roundBig > BigInt(Number.MAX_SAFE_INTEGER)) {
    // docs/codec.md 2.4 allows a decoder to refuse what it cannot hold; the protocol never goes past 1000000
    refuse('H4', `malformed header: round ${roundBig} is not a non-negative integer this decoder holds (over 2^53 - 1)`);
  }
  const listed = header.get('tensors')!;
  if (!Array.isArray(listed)) refuse('H5', 'malformed header: tensors is not a list');
  const entriesIn = listed as JValue[];
  if (expected !== null && entriesIn.length > expected.size) {
    const names = entriesIn
      .map((e) => (Array.isArray(e) && typeof e[0] === 'string' ? e[0] : null))
      .filter((x): x is string => x !== null && !expected.has(x));
    refuse('H6', `payload holds unexpected tensors ${pyRepr([...new Set(names)].sort())} ` +
      `(${entriesIn.length} listed, ${expected.size} expected)`);
  }

  // each entry: E1 ... E18
  const entries: Entry[] = [];
  const seen = new Set<string>();
  let end = 0n;
  let decodedBytes = 0n;
  for (const raw of entriesIn) {
    const e = checkEntry(raw, maxBytes);
    if (seen.has(e.name)) refuse('E16', `malformed header: tensor ${pyRepr(e.name)} appears twice`);
    if (e.offset !== end) {
      refuse('E17', `malformed header: tensor ${pyRepr(e.name)} starts at byte ${e.offset} of data, expected ${end}`);
    }
    decodedBytes += 4n * e.n;
    if (decodedBytes > BigInt(maxBytes)) {
      refuse('E18', `malformed header: the tensors would decode to over ${maxBytes} bytes (max_bytes)`);
    }
    seen.add(e.name);
    end = e.offset + e.nbytes + e.maskNbytes;
    entries.push(e);
  }

  // the whole payload: D8 ... D10
  const dataStart = PREFIX_BYTES + hlen;
  const data = payload.subarray(dataStart, size - TRAILER_BYTES);
  if (end !== BigInt(data.length)) {
    refuse('D8', `malformed header: tensors cover ${end} bytes of data, the payload holds ${data.length}`);
  }
  if (options.modelId !== undefined && model !== options.modelId) {
    refuse('D9', `payload is for model ${pyRepr(model as string)}, expected ${pyRepr(options.modelId)}`);
  }
  if (expected !== null) {
    const unexpected = entries.map((e) => e.name).filter((x) => !expected.has(x));
    if (unexpected.length > 0) refuse('D10', `payload holds unexpected tensors ${pyRepr(unexpected.sort())}`);
    if (!options.allowMissing) {
      const missing = [...expected.keys()].filter((x) => !seen.has(x));
      if (missing.length > 0) refuse('D10', `payload is missing tensors ${pyRepr(missing.sort())}`);
    }
    for (const e of entries) {
      const want = expected.get(e.name)!;
      if (want.length !== e.shape.length || want.some((d, i) => d !== e.shape[i])) {
        refuse('D10', `tensor ${pyRepr(e.name)} has shape ${tupleRepr(e.shape)}, expected ${tupleRepr(want)}`);
      }
    }
  }

  // each tensor: V1, M1 ... M5. From here every size is a safe number: n <= maxBytes / 4, offsets <= size.
  const tensors = new Map<string, DecodedTensor>();
  for (const e of entries) {
    const n = Number(e.n);
    const ones = Number(e.ones);
    const at = Number(e.offset);
    const sent = readValues(data, at, e.coding === null ? n : ones, e.dtype);
    if (sent === null) refuse('V1', `tensor ${pyRepr(e.name)} holds NaN or Inf`);
    const values = sent as Float32Array;
    if (e.coding === null) {
      tensors.set(e.name, { name: e.name, shape: e.shape, dtype: e.dtype, data: values, mask: null, coding: null, k: 0, ones: n });
      continue;
    }
    const streamAt = at + Number(e.nbytes);
    const stream = data.subarray(streamAt, streamAt + Number(e.maskNbytes));
    const mask = new Uint8Array(n);
    if (e.coding === 'bitmap') decodeBitmap(stream, n, ones, mask, e.name);
    else decodeRice(stream, e.coding === 'rice1' ? ones : n - ones, e.k, n, e.coding === 'rice1', mask, e.name);
    const full = new Float32Array(n);
    for (let i = 0, j = 0; i < n; i++) if (mask[i] === 1) full[i] = values[j++]!;
    tensors.set(e.name, { name: e.name, shape: e.shape, dtype: e.dtype, data: full, mask, coding: e.coding, k: e.k, ones });
  }
  return { model: model as string, round: Number(roundBig), tensors };
}

/** H1 and H2: the header is UTF-8 JSON, one object with exactly model, round and tensors. */
function parseHeader(bytes: Uint8Array): Map<string, JValue> {
  let text: string;
  try {
    text = decodeUtf8(bytes);
  } catch (err) {
    if (err instanceof Utf8Error) refuse('H1', `malformed header: not JSON (${err.message})`);
    throw err;
  }
  let value: JValue;
  try {
    value = parse(text!);
  } catch (err) {
    if (err instanceof JsonError) {
      refuse('H1', err.kind === 'syntax' ? `malformed header: not JSON (${err.message})` : `malformed header: ${err.message}`);
    }
    throw err;
  }
  const keys = value! instanceof JObject ? [...value.entries.keys()] : [];
  if (!(value! instanceof JObject) || keys.length !== 3 || !['model', 'round', 'tensors'].every((k) => keys.includes(k))) {
    refuse('H2', 'malformed header: expected an object with exactly the fields model, round and tensors');
  }
  return (value! as JObject).entries;
}

/** E1 ... E15 for one entry (section 2.1 and the limits of section 7). */
function checkEntry(raw: JValue, maxBytes: number): Entry {
  if (!Array.isArray(raw) || (raw.length !== 5 && raw.length !== 9)) {
    refuse('E1', 'malformed header: a tensor entry must be a list of 5 or 9 fields');
  }
  const fields = raw as JValue[];
  const [nameV, shapeV, dtypeV, offsetV, nbytesV] = fields as [JValue, JValue, JValue, JValue, JValue];
  if (typeof nameV !== 'string') refuse('E2', `malformed header: tensor name ${pyRepr(nameV)} is not a string`);
  const name = nameV as string;
  const t = `tensor ${pyRepr(name)}`;

  // E3: the shape, and n computed exactly (docs/codec.md section 7, "Computing n")
  const badShape = (why = ''): never => refuse('E3', `malformed header: ${t} has an invalid shape ${pyRepr(shapeV)}${why}`);
  if (!Array.isArray(shapeV) || shapeV.length > MAX_DIMS) badShape();
  const shape: number[] = [];
  let n = 1n;
  let nonZero = 1n;
  for (const d of shapeV as JValue[]) {
    if (!isInt(d) || d.value < 0n || d.value > BigInt(maxBytes)) badShape();
    const dim = (d as JInt).value;
    shape.push(Number(dim));
    n *= dim;
    if (dim !== 0n) nonZero *= dim;
  }
  if (nonZero > I64_MAX) badShape(': its non-zero dimensions multiply past 2^63 - 1');

  if (dtypeV !== 'f4' && dtypeV !== 'f2') {
    refuse('E4', `malformed header: ${t} has value dtype ${pyRepr(dtypeV)}, expected 'f4' or 'f2'`);
  }
  const dtype = dtypeV as Dtype;
  const size = BigInt(VALUE_SIZE[dtype]);
  if (!isInt(offsetV) || offsetV.value < 0n) refuse('E5', `malformed header: ${t} has an invalid offset ${pyRepr(offsetV)}`);
  if (!isInt(nbytesV) || nbytesV.value < 0n) refuse('E5', `malformed header: ${t} has an invalid length ${pyRepr(nbytesV)}`);
  const offset = (offsetV as JInt).value;
  const nbytes = (nbytesV as JInt).value;

  if (fields.length === 5) {
    if (nbytes !== n * size) {
      refuse('E6', `malformed header: dense ${t} of shape ${listRepr(shape)} needs ${n * size} bytes, header says ${nbytes}`);
    }
    return { name, shape, n, dtype, offset, nbytes, coding: null, k: 0, ones: n, maskNbytes: 0n };
  }

  const [codingV, kV, onesV, maskV] = fields.slice(5) as [JValue, JValue, JValue, JValue];
  if (codingV !== 'bitmap' && codingV !== 'rice1' && codingV !== 'rice0') {
    refuse('E7', `malformed header: ${t} has mask coding ${pyRepr(codingV)}, expected 'bitmap', 'rice1' or 'rice0'`);
  }
  const coding = codingV as Coding;
  const kMax = coding === 'bitmap' ? 0n : BigInt(MAX_RICE_K);
  if (!isInt(kV) || kV.value < 0n || kV.value > kMax) refuse('E8', `malformed header: ${t} has an invalid Rice parameter ${pyRepr(kV)}`);
  const k = Number((kV as JInt).value);
  if (!isInt(onesV) || onesV.value < 0n || onesV.value > n) {
    refuse('E9', `malformed header: ${t} has an invalid count of ones ${pyRepr(onesV)}`);
  }
  const ones = (onesV as JInt).value;
  if (nbytes !== ones * size) {
    refuse('E10', `malformed header: ${t} has ${ones} ones in its mask but ${nbytes} bytes of ${dtype} values`);
  }
  if (!isInt(maskV) || maskV.value < 0n) refuse('E11', `malformed header: ${t} has an invalid mask length ${pyRepr(maskV)}`);
  const maskNbytes = (maskV as JInt).value;

  const bitmapBytes = ceilDiv8(n);
  if (coding === 'bitmap') {
    if (maskNbytes !== bitmapBytes) {
      refuse('E12', `malformed header: ${t} has a bitmap of ${maskNbytes} bytes, expected ${bitmapBytes}`);
    }
  } else {
    const c = coding === 'rice1' ? ones : n - ones;
    const bk = BigInt(k);
    if (c === 0n) {
      if (maskNbytes !== 0n) {
        refuse('E13', `malformed header: ${t} has a mask stream of ${maskNbytes} bytes where no codeword is expected`);
      }
    } else {
      const kLimit = bitLength(n / c) + 1;
      if (k > kLimit) {
        refuse('E14', `malformed header: ${t} has Rice parameter ${k} for ${c} codewords over ${n} elements; at most ${kLimit}`);
      }
      const least = ceilDiv8(c * (bk + 1n));
      const most1 = ceilDiv8(c * (bk + 1n) + ((n - c) >> bk));
      const most = most1 < bitmapBytes ? most1 : bitmapBytes;
      if (maskNbytes < least) {
        refuse('E15', `malformed header: ${t}: a mask stream of ${maskNbytes} bytes is too short for ${c} codewords with k=${k} (at least ${least})`);
      }
      if (maskNbytes > most) {
        refuse('E15', `malformed header: ${t}: a mask stream of ${maskNbytes} bytes for ${c} codewords with k=${k}; at most ${most} bytes fit`);
      }
    }
  }
  return { name, shape, n, dtype, offset, nbytes, coding, k, ones, maskNbytes };
}

/** `count` values from `data` at `at` as binary32; null if one is NaN or +-Inf (check V1). */
function readValues(data: Uint8Array, at: number, count: number, dtype: Dtype): Float32Array | null {
  const out = new Float32Array(count);
  if (dtype === 'f4') {
    const bits = new Uint32Array(out.buffer);
    if (LITTLE_ENDIAN_HOST) {
      new Uint8Array(out.buffer).set(data.subarray(at, at + 4 * count));
    } else {
      const view = new DataView(data.buffer, data.byteOffset + at, 4 * count);
      for (let i = 0; i < count; i++) bits[i] = view.getUint32(4 * i, true);
    }
    for (let i = 0; i < count; i++) if ((bits[i]! & 0x7f800000) === 0x7f800000) return null;
    return out;
  }
  for (let i = 0; i < count; i++) {
    const h = data[at + 2 * i]! | (data[at + 2 * i + 1]! << 8);
    if ((h & 0x7c00) === 0x7c00) return null;
    out[i] = f16Value(h);
  }
  return out;
}

const bitAt = (stream: Uint8Array, i: number): number => (stream[i >>> 3]! >>> (7 - (i & 7))) & 1;

/** Section 5.1, checks M1 and M2. */
function decodeBitmap(stream: Uint8Array, n: number, ones: number, mask: Uint8Array, name: string): void {
  for (let i = n; i < 8 * stream.length; i++) {
    if (bitAt(stream, i) === 1) refuse('M1', `tensor ${pyRepr(name)}: bitmap has bits set past the end of the tensor`);
  }
  let count = 0;
  for (let i = 0; i < n; i++) {
    const b = bitAt(stream, i);
    mask[i] = b;
    count += b;
  }
  if (count !== ones) refuse('M2', `tensor ${pyRepr(name)}: bitmap has ${count} ones but ${ones} values were sent`);
}

/**
 * Section 5.2, "Decoding a Rice mask", checks M3 ... M5: the c positions of the coded symbol (1 for rice1, 0 for
 * rice0) from the remainder stream (c*k bits), the quotient stream (unary) and the one-bit padding. In the order of
 * the section's pseudo-code, which is pfl-edge's: first the stream's structure (c codewords, M3; nothing but one-bit
 * padding after them, M4), then the positions (M5).
 */
function decodeRice(stream: Uint8Array, c: number, k: number, n: number, rice1: boolean, mask: Uint8Array, name: string): void {
  const t = `tensor ${pyRepr(name)}`;
  if (!rice1) mask.fill(1);
  if (c === 0) return; // E13 made sure the stream is empty
  const total = 8 * stream.length;
  const fewer = (): never => refuse('M3', `${t}: mask stream holds fewer than the ${c} codewords the values need`);
  if (c * k > total) fewer();
  // the structure: c zero-bits after the remainders, then only one-bits to the end of that byte
  let pos = c * k;
  for (let i = 0; i < c; i++) {
    while (pos < total && bitAt(stream, pos) === 1) pos++;
    if (pos >= total) fewer();
    pos++;
  }
  let paddedWithOnes = Math.ceil(pos / 8) === stream.length;
  for (let i = pos; paddedWithOnes && i < total; i++) if (bitAt(stream, i) === 0) paddedWithOnes = false;
  if (!paddedWithOnes) refuse('M4', `${t}: mask stream holds more than the ${c} codewords the values need`);
  // the positions: p[i] = p[i-1] + q[i] * 2^k + r[i] + 1, each < n
  const pastEnd = (): never => refuse('M5', `${t}: mask stream points past the end of the tensor`);
  const step = 2 ** k;
  const qMax = Math.floor((n - 1) / step); // (n - 1) >> k: a larger quotient alone points past the end
  const symbol = rice1 ? 1 : 0;
  let last = -1;
  pos = c * k;
  for (let i = 0; i < c; i++) {
    let q = 0;
    while (bitAt(stream, pos) === 1) {
      q++;
      pos++;
    }
    pos++;
    if (q > qMax) pastEnd();
    let r = 0;
    for (let j = i * k, stop = i * k + k; j < stop; j++) r = r * 2 + bitAt(stream, j);
    last = last + q * step + r + 1;
    if (last >= n) pastEnd();
    mask[last] = symbol;
  }
}

// ------------------------------------------------------------------------------------------------ encode

/** The coding, k and stream length the encoder picks for a mask (section 5.3), with the coded positions' stats. */
export interface MaskChoice {
  coding: Coding;
  k: number;
  nbytes: number;
}

/** Section 5.3: the canonical coding of a mask of n bits (smallest byte length; bitmap, then rice1, then rice0). */
export function chooseMaskCoding(mask: ArrayLike<number | boolean>, n: number): MaskChoice {
  let best: MaskChoice = { coding: 'bitmap', k: 0, nbytes: Math.ceil(n / 8) };
  for (const coding of ['rice1', 'rice0'] as const) {
    const symbol = coding === 'rice1';
    let c = 0;
    let sum = 0; // S = sum of the gaps
    let prev = -1;
    for (let i = 0; i < n; i++) {
      if (Boolean(mask[i]) === symbol) {
        sum += i - prev - 1;
        prev = i;
        c++;
      }
    }
    let bits: number;
    let k = 0;
    if (c === 0) {
      bits = 0;
    } else if (2 * c >= n) {
      bits = prev + 1;
      if (bits >= n) continue;
    } else {
      let centre = 0; // the largest j >= 0 with c * (2^j - 1) <= S
      while (c * (2 ** (centre + 1) - 1) <= sum) centre++;
      const ks: number[] = [];
      for (let kk = Math.max(0, centre - 1); kk <= Math.min(MAX_RICE_K, centre + 1); kk++) ks.push(kk);
      const cost = ks.map((kk) => c * (kk + 1));
      const steps = ks.map((kk) => 2 ** kk);
      prev = -1;
      for (let i = 0; i < n; i++) {
        if (Boolean(mask[i]) === symbol) {
          const d = i - prev - 1;
          for (let j = 0; j < ks.length; j++) cost[j]! += Math.floor(d / steps[j]!);
          prev = i;
        }
      }
      let at = 0;
      for (let j = 1; j < ks.length; j++) if (cost[j]! < cost[at]!) at = j; // a tie keeps the smaller k
      bits = cost[at]!;
      k = ks[at]!;
    }
    const nbytes = Math.ceil(bits / 8);
    if (nbytes < best.nbytes) best = { coding, k, nbytes };
  }
  return best;
}

class BitWriter {
  readonly bytes: Uint8Array;
  private pos = 0;
  constructor(nbytes: number) {
    this.bytes = new Uint8Array(nbytes);
  }
  bit(b: number): void {
    if (b) this.bytes[this.pos >>> 3]! |= 0x80 >>> (this.pos & 7);
    this.pos++;
  }
  /** `width` bits of `value`, most significant first */
  bits(value: number, width: number): void {
    for (let j = width - 1; j >= 0; j--) this.bit(Math.floor(value / 2 ** j) % 2);
  }
  /** one-bits up to a whole byte (Rice padding) */
  padOnes(): void {
    while (this.pos % 8 !== 0) this.bit(1);
  }
}

/** The coded mask (section 5): bitmap with zero padding, or the Rice remainder and quotient streams. */
export function encodeMask(mask: ArrayLike<number | boolean>, n: number, choice: MaskChoice): Uint8Array {
  const w = new BitWriter(choice.nbytes);
  if (choice.coding === 'bitmap') {
    for (let i = 0; i < n; i++) w.bit(mask[i] ? 1 : 0);
    return w.bytes;
  }
  const symbol = choice.coding === 'rice1';
  const step = 2 ** choice.k;
  for (const pass of ['remainders', 'quotients'] as const) {
    let prev = -1;
    for (let i = 0; i < n; i++) {
      if (Boolean(mask[i]) !== symbol) continue;
      const d = i - prev - 1;
      prev = i;
      if (pass === 'remainders') {
        w.bits(d % step, choice.k);
      } else {
        for (let q = Math.floor(d / step); q > 0; q--) w.bit(1);
        w.bit(0);
      }
    }
  }
  w.padOnes();
  return w.bytes;
}

function numel(shape: readonly number[], name: string): number {
  if (shape.length > MAX_DIMS) refuse('encode', `tensor ${pyRepr(name)} has ${shape.length} dimensions, at most ${MAX_DIMS}`);
  let n = 1;
  for (const d of shape) {
    if (!Number.isSafeInteger(d) || d < 0) refuse('encode', `tensor ${pyRepr(name)} has an invalid shape [${shape.join(', ')}]`);
    n *= d;
  }
  if (!Number.isSafeInteger(n)) refuse('encode', `tensor ${pyRepr(name)} is too large`);
  return n;
}

/**
 * Encodes tensors into one payload, byte for byte as pfl-edge's encoder (sections 2.2, 3, 4, 5.3, 6). A tensor
 * with a mask is sent sparse: only the values where the mask is set, and the mask in its canonical coding.
 * Refuses (CodecError, check `encode`) NaN/Inf among the values sent, f2 values that round to Inf, duplicate
 * names, a bad round or shape, data or mask of the wrong length.
 */
export function encode(input: EncodeInput, options: EncodeOptions = {}): Uint8Array {
  const hash = options.sha256 ?? jsSha256;
  const dtype = input.dtype ?? 'f4';
  if (dtype !== 'f4' && dtype !== 'f2') refuse('encode', `value dtype ${pyRepr(String(dtype))} is not 'f4' or 'f2'`);
  if (typeof input.model !== 'string') refuse('encode', 'the model id is not a string');
  if (!Number.isSafeInteger(input.round) || input.round < 0) refuse('encode', `round ${input.round} is not a non-negative integer`);
  const size = VALUE_SIZE[dtype];

  const entries: Dumpable[] = [];
  const chunks: Uint8Array[] = [];
  const names = new Set<string>();
  let offset = 0;
  for (const t of input.tensors) {
    if (typeof t.name !== 'string') refuse('encode', `tensor name ${String(t.name)} is not a string`);
    if (names.has(t.name)) refuse('encode', `tensor ${pyRepr(t.name)} appears twice`);
    names.add(t.name);
    const n = numel(t.shape, t.name);
    if (t.data.length !== n) refuse('encode', `tensor ${pyRepr(t.name)} has ${t.data.length} values for shape [${t.shape.join(', ')}]`);
    const mask = t.mask ?? null;
    if (mask !== null && mask.length !== n) refuse('encode', `tensor ${pyRepr(t.name)} has a mask of ${mask.length} entries, not ${n}`);

    let count = n;
    if (mask !== null) {
      count = 0;
      for (let i = 0; i < n; i++) if (mask[i]) count++;
    }
    const values = new Uint8Array(count * size);
    const view = new DataView(values.buffer);
    for (let i = 0, j = 0; i < n; i++) {
      if (mask !== null && !mask[i]) continue;
      const x = Math.fround(t.data[i]!);
      if (!Number.isFinite(x)) refuse('encode', `tensor ${pyRepr(t.name)} holds NaN or Inf`);
      if (size === 4) {
        view.setFloat32(4 * j, x, true);
      } else {
        const h = f16BitsFromF32Bits(f32Bits(x));
        if ((h & 0x7c00) === 0x7c00) refuse('encode', `tensor ${pyRepr(t.name)} holds ${x}, which rounds to Inf in f2`);
        view.setUint16(2 * j, h, true);
      }
      j++;
    }
    chunks.push(values);
    const shape = t.shape.map((d) => d);
    if (mask === null) {
      entries.push([t.name, shape, dtype, offset, values.length]);
      offset += values.length;
      continue;
    }
    const choice = chooseMaskCoding(mask, n);
    const stream = encodeMask(mask, n, choice);
    chunks.push(stream);
    entries.push([t.name, shape, dtype, offset, values.length, choice.coding, choice.k, count, stream.length]);
    offset += values.length + stream.length;
  }

  const headerText = dumps({ model: input.model, round: input.round, tensors: entries });
  const total = PREFIX_BYTES + headerText.length + offset + TRAILER_BYTES;
  const out = new Uint8Array(total);
  out.set(MAGIC, 0);
  out[4] = FORMAT_VERSION;
  new DataView(out.buffer).setUint32(5, headerText.length, true);
  for (let i = 0; i < headerText.length; i++) out[PREFIX_BYTES + i] = headerText.charCodeAt(i); // pure ASCII
  let at = PREFIX_BYTES + headerText.length;
  for (const c of chunks) {
    out.set(c, at);
    at += c.length;
  }
  out.set(hash(out.subarray(0, at)), at);
  return out;
}

/** A decoded payload as encoder input (to re-encode it: same dtype for all tensors assumed). */
export function toEncodeInput(d: Decoded): EncodeInput {
  const dtypes = new Set([...d.tensors.values()].map((t) => t.dtype));
  return {
    model: d.model,
    round: d.round,
    dtype: dtypes.size === 1 && dtypes.has('f2') ? 'f2' : 'f4',
    tensors: [...d.tensors.values()].map((t) => ({ name: t.name, shape: t.shape, data: t.data, mask: t.mask })),
  };
}
