/**
 * A device's own labelled images as its training and test samples (a federation of `"partition": "device"`;
 * docs/model.md, "Input", `input.own_images`; docs/react-native.md, "Data: the phone's own images"), computed
 * exactly as the Python device computes them (`edge_runtime/data.py::load_image_folder`,
 * `pfl_edge/data/folder.py::read_image_folder_arrays`) from the same decoded pixels:
 *
 * 1. each image converted as Pillow's `convert("L")` (grey models, C = 1) or `convert("RGB")` (C = 3): grey from
 *    colour is ITU-R 601-2 luma in Pillow's 16-bit fixed point, `(R*19595 + G*38470 + B*7471 + 0x8000) >> 16`;
 *    alpha is dropped (not composited); grey to RGB repeats the grey value;
 * 2. **not resized**: every image must already be the model's H x W (the card's `input.shape`), else an
 *    `ImageDataError` names it. The Python device resizes with Pillow's default bicubic `resize`; an image already
 *    H x W is left as it is there too, so the arrays are equal. (Pillow 13 runs its two bicubic passes in an order
 *    it picks by the scale factors, PR python-pillow/Pillow#9549, with no documented rule: not reproduced here.)
 * 3. divided by 255 in float32, then standardised per channel by the mean and standard deviation (Bessel's
 *    correction when there is more than one image; floored at `std_floor`, 1e-6) over **all** of the images,
 *    in float64, rounded once to float32;
 * 4. `testFraction` (0.2) of each class held out: for each label in increasing order, the class's image indices
 *    shuffled by numpy's `permutation` from the `holdout` stream (seed, slot), the first
 *    `round(testFraction * n)` (half to even, as Python's `round`) for testing, the rest for training.
 *
 * The images must come in the Python device's order: class folders sorted by name, files sorted by name within
 * each (`classFolders`, `comparePaths`). Platform-neutral: a phone decodes its images with the platform's own
 * image API and passes the pixels here.
 */
import { Stream, numpyStream } from './rng.js';
import type { Sha256 } from './sha256.js';
import type { Samples } from './train.js';

export class ImageDataError extends Error {
  override name = 'ImageDataError';
}

/** One decoded 8-bit image: `channels` interleaved values per pixel, rows top to bottom. */
export interface DecodedImage {
  /** its class, 0 .. numClasses - 1 */
  label: number;
  width: number;
  height: number;
  /** 1 grey, 2 grey + alpha, 3 RGB, 4 RGBA */
  channels: number;
  /** width * height * channels bytes */
  pixels: Uint8Array;
  /** where it came from, for messages */
  name?: string;
}

export interface OwnImageOptions {
  /** the model's input: C (1 grey or 3 RGB), H, W (the card's `input.shape`) */
  channels: number;
  height: number;
  width: number;
  /** the card's `num_classes` */
  numClasses: number;
  sha256: Sha256;
  /** the federation's seed (`config.seed`) */
  seed: bigint | number;
  /** the device's slot (`Enrolment.index`) */
  slot: number;
  /** default 0.2, as the Python device */
  testFraction?: number;
  /** default 1e-6 (the card's `input.own_images.std_floor`) */
  stdFloor?: number;
}

export interface OwnImageData {
  train: Samples;
  test: Samples;
  /** the per-channel statistics the samples were standardised with (float64) */
  mean: number[];
  std: number[];
}

/** What the Python device reads (`pfl_edge.data.folder._SUFFIXES`), sorted as its messages list them. */
export const IMAGE_SUFFIXES = ['.bmp', '.gif', '.jpeg', '.jpg', '.pgm', '.png', '.ppm', '.webp'];

/** Python's `PurePath(name).suffix.lower()`. */
export function suffixOf(name: string): string {
  const i = name.lastIndexOf('.');
  return i > 0 && i < name.length - 1 ? name.slice(i).toLowerCase() : '';
}

/** Whether the Python device reads a file of this name (its suffix, any case); it reads the file's contents. */
export function isImageName(name: string): boolean {
  return IMAGE_SUFFIXES.includes(suffixOf(name));
}

/** Python's string order (by code point; JS's `<` compares UTF-16 code units, which differs past U+FFFF). */
export function comparePaths(a: string, b: string): number {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i]!.codePointAt(0)! - y[i]!.codePointAt(0)!;
    if (d !== 0) return d;
  }
  return x.length - y.length;
}

/**
 * The class of each class folder, in the order the Python device reads them: folders sorted by name; if every
 * name is digits (ASCII) the class is its number, else its position in that order. `root` names the folder in
 * messages.
 */
export function classFolders(names: readonly string[], numClasses: number, root = '.'): { name: string; label: number }[] {
  if (names.length === 0) throw new ImageDataError(`${root} has no class folders (expected ${root}/<class>/<image>.png)`);
  const sorted = [...names].sort(comparePaths);
  const numeric = sorted.every((n) => /^[0-9]+$/.test(n));
  const out = sorted.map((name, i) => ({ name, label: numeric ? Number(name) : i }));
  const top = Math.max(...out.map((c) => c.label));
  if (top >= numClasses) {
    throw new ImageDataError(`${root}: ${out.length} classes (largest label ${top}) but the federation's model has ${numClasses}`);
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ conversion

/** Pillow's `convert("L")` (bands = 1) or `convert("RGB")` (bands = 3) of an image, interleaved. */
export function convertImage(img: DecodedImage, bands: number): Uint8Array {
  const { width, height, channels, pixels } = img;
  const what = img.name ?? 'an image';
  if (!(channels >= 1 && channels <= 4) || !Number.isInteger(channels)) throw new ImageDataError(`${what}: ${channels} channels (1 to 4 are read)`);
  if (!(Number.isInteger(width) && Number.isInteger(height) && width > 0 && height > 0)) {
    throw new ImageDataError(`${what}: size ${width} x ${height}`);
  }
  const n = width * height;
  if (pixels.length !== n * channels) {
    throw new ImageDataError(`${what}: ${pixels.length} bytes of pixels for ${width} x ${height} x ${channels}`);
  }
  if (bands !== 1 && bands !== 3) throw new ImageDataError(`a model input of ${bands} channels (1 or 3 are read)`);
  const out = new Uint8Array(n * bands);
  if (bands === 1) {
    if (channels <= 2) {
      for (let i = 0; i < n; i++) out[i] = pixels[i * channels]!;
    } else {
      for (let i = 0; i < n; i++) {
        const p = i * channels;
        out[i] = (pixels[p]! * 19595 + pixels[p + 1]! * 38470 + pixels[p + 2]! * 7471 + 0x8000) >>> 16;
      }
    }
  } else if (channels <= 2) {
    for (let i = 0; i < n; i++) out[3 * i] = out[3 * i + 1] = out[3 * i + 2] = pixels[i * channels]!;
  } else {
    for (let i = 0; i < n; i++) {
      const p = i * channels;
      out[3 * i] = pixels[p]!;
      out[3 * i + 1] = pixels[p + 1]!;
      out[3 * i + 2] = pixels[p + 2]!;
    }
  }
  return out;
}

/**
 * One image as the model's 8-bit input, planar `[C, H, W]`, converted as Pillow converts. It must already be
 * H x W: this device does not resize (the Python device resizes with Pillow's bicubic `resize`, whose result
 * depends on the order of its two passes, which Pillow 13 picks by a rule of its own), so another size is an
 * `ImageDataError` naming the image.
 */
export function modelPixels(img: DecodedImage, channels: number, height: number, width: number): Uint8Array {
  if (img.width !== width || img.height !== height) {
    throw new ImageDataError(`${img.name ?? 'an image'} is ${img.width} x ${img.height} pixels; the model takes ${width} x ${height} ` +
      `(W x H): resize it first (this device does not resize)`);
  }
  const sized = convertImage(img, channels);
  if (channels === 1) return sized;
  const plane = width * height;
  const out = new Uint8Array(plane * channels);
  for (let i = 0; i < plane; i++) for (let c = 0; c < channels; c++) out[c * plane + i] = sized[i * channels + c]!;
  return out;
}

// ------------------------------------------------------------------------------------------------ samples

/** Python's `round` of a float to an integer: half to even. */
export function pyRound(x: number): number {
  const f = Math.floor(x);
  const d = x - f;
  if (d > 0.5) return f + 1;
  if (d < 0.5) return f;
  return f % 2 === 0 ? f : f + 1;
}

/** Neumaier's compensated sum (float64, within an ulp of the exact sum, as numpy's pairwise sum nearly is). */
class Sum {
  private s = 0;
  private c = 0;
  add(v: number): void {
    const t = this.s + v;
    this.c += Math.abs(this.s) >= Math.abs(v) ? this.s - t + v : v - t + this.s;
    this.s = t;
  }
  get value(): number {
    return this.s + this.c;
  }
}

/**
 * The held-out split of `load_image_folder`: per label in increasing order, its indices shuffled by the
 * `holdout` (slot) stream, the first `round(testFraction * n)` for testing.
 */
export function holdoutSplit(labels: ArrayLike<number>, sha256: Sha256, seed: bigint | number, slot: number,
  testFraction = 0.2): { train: number[]; test: number[] } {
  const rng = numpyStream(sha256, seed, Stream.HOLDOUT, slot);
  const classes = [...new Set(Array.from(labels))].sort((a, b) => a - b);
  const train: number[] = [];
  const test: number[] = [];
  for (const c of classes) {
    const members: number[] = [];
    for (let i = 0; i < labels.length; i++) if (labels[i] === c) members.push(i);
    const idx = rng.permutation(members);
    const k = pyRound(testFraction * idx.length);
    for (let i = 0; i < idx.length; i++) (i < k ? test : train).push(idx[i]!);
  }
  return { train, test };
}

/**
 * The device's training and test samples from its images' model pixels (`modelPixels`, each `[C, H, W]`) and
 * labels, in the Python device's order: standardised over all of them, then split (`holdoutSplit`).
 */
export function ownDataFromPixels(pixels: readonly Uint8Array[], labels: readonly number[], o: OwnImageOptions): OwnImageData {
  const { channels: C, height: H, width: W } = o;
  const n = pixels.length;
  if (n === 0) throw new ImageDataError(`no images (${IMAGE_SUFFIXES.join(', ')}) in the class folders`);
  if (labels.length !== n) throw new ImageDataError(`${n} images but ${labels.length} labels`);
  for (const y of labels) {
    if (!Number.isInteger(y) || y < 0 || y >= o.numClasses) throw new ImageDataError(`label ${y} is not a class of the federation's model (0 .. ${o.numClasses - 1})`);
  }
  const plane = H * W;
  const size = C * plane;
  for (const p of pixels) if (p.length !== size) throw new ImageDataError(`an image of ${p.length} values; the model takes ${C} x ${H} x ${W}`);
  const lut = new Float64Array(256);
  for (let v = 0; v < 256; v++) lut[v] = Math.fround(v / 255); // float32(p) / 255.0 in float32
  const count = n * plane;
  const floor = o.stdFloor ?? 1e-6;
  const mean: number[] = [];
  const std: number[] = [];
  for (let c = 0; c < C; c++) {
    const s = new Sum();
    for (const p of pixels) for (let j = c * plane; j < (c + 1) * plane; j++) s.add(lut[p[j]!]!);
    const m = s.value / count;
    const q = new Sum();
    for (const p of pixels) {
      for (let j = c * plane; j < (c + 1) * plane; j++) {
        const d = lut[p[j]!]! - m;
        q.add(d * d);
      }
    }
    const dof = Math.max(count - (n > 1 ? 1 : 0), 0);
    mean.push(m);
    std.push(Math.max(Math.sqrt(q.value / dof), floor));
  }
  const split = holdoutSplit(labels, o.sha256, o.seed, o.slot, o.testFraction ?? 0.2);
  if (split.train.length === 0) {
    throw new ImageDataError(`no training images left after holding out ${Math.round((o.testFraction ?? 0.2) * 100)}% for testing`);
  }
  const table: Float32Array[] = [];
  for (let c = 0; c < C; c++) {
    const t = new Float32Array(256);
    for (let v = 0; v < 256; v++) t[v] = (lut[v]! - mean[c]!) / std[c]!;
    table.push(t);
  }
  const take = (idx: number[]): Samples => {
    const x = new Float32Array(idx.length * size);
    const y = new Int32Array(idx.length);
    idx.forEach((k, i) => {
      const p = pixels[k]!;
      for (let j = 0; j < size; j++) x[i * size + j] = table[Math.floor(j / plane)]![p[j]!]!;
      y[i] = labels[k]!;
    });
    return { x, y, n: idx.length, sampleSize: size };
  };
  return { train: take(split.train), test: take(split.test), mean, std };
}

/** `ownDataFromPixels` of decoded images (each checked and converted with `modelPixels`), in the Python order. */
export function ownImageData(images: readonly DecodedImage[], o: OwnImageOptions): OwnImageData {
  const pix = images.map((im) => modelPixels(im, o.channels, o.height, o.width));
  return ownDataFromPixels(pix, images.map((im) => im.label), o);
}
