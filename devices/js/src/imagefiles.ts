/**
 * Image files as `DecodedImage`s (./images.ts): PNG (8-bit grey, grey + alpha, RGB, RGBA; grey of 1, 2 or 4 bits
 * and palettes of 1 to 8 bits, expanded as Pillow expands them; not interlaced) and binary PGM/PPM (`P5`/`P6`,
 * maxval 255). Anything else (JPEG, GIF, BMP, WebP, 16-bit or interlaced PNG, ...) is refused with an
 * `ImageDataError` naming the file: convert it to PNG. The format is read from the file's bytes, not its name, as
 * Pillow does. Platform-neutral: the caller passes zlib's `inflate` (Node: `zlib.inflateSync`).
 */
import { type DecodedImage, ImageDataError } from './images.js';

export type Inflate = (deflated: Uint8Array) => Uint8Array;

const PNG_SIGNATURE = [137, 80, 78, 71, 13, 10, 26, 10];

let crcTable: Uint32Array | null = null;
function crc32(bytes: Uint8Array, from: number, to: number): number {
  if (crcTable === null) {
    crcTable = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      crcTable[n] = c >>> 0;
    }
  }
  let c = 0xffffffff;
  for (let i = from; i < to; i++) c = crcTable[(c ^ bytes[i]!) & 0xff]! ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** The format, from the first bytes, for messages; null: not one this device knows. */
export function sniffFormat(b: Uint8Array): string | null {
  const at = (i: number, s: number[]): boolean => s.every((v, j) => b[i + j] === v);
  if (at(0, PNG_SIGNATURE)) return 'PNG';
  if (b[0] === 0x50 && b[1] !== undefined && b[1] >= 0x31 && b[1] <= 0x37) return `PNM P${String.fromCharCode(b[1])}`;
  if (at(0, [0xff, 0xd8, 0xff])) return 'JPEG';
  if (at(0, [0x47, 0x49, 0x46, 0x38])) return 'GIF';
  if (at(0, [0x42, 0x4d])) return 'BMP';
  if (at(0, [0x52, 0x49, 0x46, 0x46]) && at(8, [0x57, 0x45, 0x42, 0x50])) return 'WebP';
  return null;
}

/** Decodes an image file's bytes; `name` is for messages. */
export function decodeImageFile(bytes: Uint8Array, name: string, inflate: Inflate, label = 0): DecodedImage {
  const format = sniffFormat(bytes);
  const fail = (why: string): never => {
    throw new ImageDataError(`cannot read image ${name}: ${why}`);
  };
  if (format === 'PNG') return { ...decodePng(bytes, inflate, fail), label, name };
  if (format === 'PNM P5' || format === 'PNM P6') return { ...decodePnm(bytes, fail), label, name };
  if (format === null) return fail('not a PNG, PGM or PPM file (this device reads those; convert the image to PNG)');
  return fail(`${format} is not read by this device (it reads PNG, binary PGM and PPM; convert the image to PNG)`);
}

type Fail = (why: string) => never;
type Pixels = Omit<DecodedImage, 'label' | 'name'>;

function decodePng(b: Uint8Array, inflate: Inflate, fail: Fail): Pixels {
  const view = new DataView(b.buffer, b.byteOffset, b.byteLength);
  let pos = 8;
  let ihdr: { w: number; h: number; depth: number; type: number } | null = null;
  let palette: Uint8Array | null = null;
  const idat: Uint8Array[] = [];
  let ended = false;
  while (!ended) {
    if (pos + 12 > b.length) fail('truncated PNG file');
    const len = view.getUint32(pos);
    const type = String.fromCharCode(b[pos + 4]!, b[pos + 5]!, b[pos + 6]!, b[pos + 7]!);
    if (len > 0x7fffffff || pos + 12 + len > b.length) fail(`truncated PNG file (chunk ${type})`);
    const data = b.subarray(pos + 8, pos + 8 + len);
    if (crc32(b, pos + 4, pos + 8 + len) !== view.getUint32(pos + 8 + len)) fail(`broken PNG file (CRC of chunk ${type})`);
    pos += 12 + len;
    if (ihdr === null && type !== 'IHDR') fail('broken PNG file (no IHDR first)');
    switch (type) {
      case 'IHDR': {
        if (len !== 13) fail('broken PNG file (IHDR)');
        const d = new DataView(data.buffer, data.byteOffset, 13);
        ihdr = { w: d.getUint32(0), h: d.getUint32(4), depth: data[8]!, type: data[9]! };
        if (data[10] !== 0 || data[11] !== 0) fail('unknown PNG compression or filter method');
        if (data[12] !== 0) fail('an interlaced (Adam7) PNG is not read by this device; save it without interlacing');
        break;
      }
      case 'PLTE':
        palette = data;
        break;
      case 'IDAT':
        idat.push(data);
        break;
      case 'IEND':
        ended = true;
        break;
      default:
        break; // ancillary chunks (tRNS, gAMA, text, ...) change no pixel of L or RGB, as in Pillow
    }
  }
  const { w, h, depth, type } = ihdr!;
  if (w === 0 || h === 0 || w > 1 << 16 || h > 1 << 16) fail(`a PNG of ${w} x ${h} pixels`);
  const samplesPer = ({ 0: 1, 2: 3, 3: 1, 4: 2, 6: 4 } as Record<number, number>)[type];
  if (samplesPer === undefined) fail(`unknown PNG colour type ${type}`);
  const okDepth = type === 0 ? [1, 2, 4, 8, 16] : type === 3 ? [1, 2, 4, 8] : [8, 16];
  if (!okDepth.includes(depth)) fail(`bit depth ${depth} is not valid for PNG colour type ${type}`);
  if (depth === 16) fail('a 16-bit PNG is not read by this device; save it with 8 bits per channel');
  if (type === 3 && palette === null) fail('a palette PNG without its palette');
  const bitsPerPixel = samplesPer! * depth;
  const stride = Math.ceil((w * bitsPerPixel) / 8);
  const bpp = Math.max(1, bitsPerPixel / 8);
  let raw: Uint8Array;
  try {
    let total = 0;
    for (const c of idat) total += c.length;
    const all = new Uint8Array(total);
    let o = 0;
    for (const c of idat) {
      all.set(c, o);
      o += c.length;
    }
    raw = inflate(all);
  } catch (e) {
    return fail(`broken PNG file (${(e as Error).message})`);
  }
  if (raw.length < h * (stride + 1)) fail('truncated PNG image data');
  // undo the filters, row by row
  const rows = new Uint8Array(h * stride);
  for (let y = 0; y < h; y++) {
    const f = raw[y * (stride + 1)]!;
    const src = y * (stride + 1) + 1;
    const cur = y * stride;
    const prev = cur - stride;
    for (let i = 0; i < stride; i++) {
      const x = raw[src + i]!;
      const a = i >= bpp ? rows[cur + i - bpp]! : 0;
      const up = y > 0 ? rows[prev + i]! : 0;
      const c = y > 0 && i >= bpp ? rows[prev + i - bpp]! : 0;
      let v: number;
      switch (f) {
        case 0: v = x; break;
        case 1: v = x + a; break;
        case 2: v = x + up; break;
        case 3: v = x + ((a + up) >>> 1); break;
        case 4: {
          const p = a + up - c;
          const pa = Math.abs(p - a);
          const pb = Math.abs(p - up);
          const pc = Math.abs(p - c);
          v = x + (pa <= pb && pa <= pc ? a : pb <= pc ? up : c);
          break;
        }
        default: return fail(`broken PNG file (filter type ${f})`);
      }
      rows[cur + i] = v & 0xff;
    }
  }
  if (depth === 8 && type !== 3) return { width: w, height: h, channels: samplesPer!, pixels: rows };
  // 1, 2 or 4 bits per sample (grey or palette), or an 8-bit palette
  const sample = (y: number, x: number): number => {
    const bit = x * depth;
    return (rows[y * stride + (bit >>> 3)]! >>> (8 - depth - (bit & 7))) & ((1 << depth) - 1);
  };
  if (type === 0) {
    const scale = 255 / ((1 << depth) - 1);
    const px = new Uint8Array(w * h);
    for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) px[y * w + x] = sample(y, x) * scale;
    return { width: w, height: h, channels: 1, pixels: px };
  }
  const pal = palette!;
  const entries = Math.floor(pal.length / 3);
  const px = new Uint8Array(w * h * 3);
  for (let y = 0; y < h; y++) {
    for (let x = 0; x < w; x++) {
      const i = sample(y, x);
      // an index past the palette: black, as Pillow's palette (padded with zeros)
      if (i < entries) px.set(pal.subarray(3 * i, 3 * i + 3), 3 * (y * w + x));
    }
  }
  return { width: w, height: h, channels: 3, pixels: px };
}

function decodePnm(b: Uint8Array, fail: Fail): Pixels {
  const channels = b[1] === 0x35 ? 1 : 3;
  let pos = 2;
  const space = (c: number | undefined): boolean => c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d || c === 0x0b || c === 0x0c;
  const token = (): number => {
    for (;;) {
      while (space(b[pos])) pos++;
      if (b[pos] !== 0x23) break; // a comment to the end of the line
      while (pos < b.length && b[pos] !== 0x0a && b[pos] !== 0x0d) pos++;
    }
    const start = pos;
    while (pos < b.length && b[pos]! >= 0x30 && b[pos]! <= 0x39) pos++;
    if (pos === start || (!space(b[pos]) && b[pos] !== 0x23)) fail('broken PGM/PPM header');
    return Number(String.fromCharCode(...b.subarray(start, pos)));
  };
  const w = token();
  const h = token();
  const maxval = token();
  if (!space(b[pos])) fail('broken PGM/PPM header');
  pos++;
  if (w === 0 || h === 0 || w > 1 << 16 || h > 1 << 16) fail(`a PGM/PPM of ${w} x ${h} pixels`);
  if (maxval !== 255) fail(`a PGM/PPM of maxval ${maxval} is not read by this device (only 255: 8 bits per channel)`);
  const n = w * h * channels;
  if (b.length - pos < n) fail('truncated PGM/PPM image data');
  return { width: w, height: h, channels, pixels: b.slice(pos, pos + n) };
}
