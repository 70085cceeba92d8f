/**
 * A device's samples as model inputs (docs/protocol.md, "Input normalisation"): 8-bit pixels `p` become
 * `x = (p / 255 - mean[c]) / std[c]`, every step rounded to binary32 with `mean` and `std` rounded to binary32
 * first, as pfl-edge computes it (`pfl_edge.data.sources.normalise`), so the device's inputs equal the
 * simulator's bit for bit. A data set whose samples already are model inputs (`statistics: "none"`, the `synthetic`
 * set) is only gathered (`slotInputs`). Platform-neutral.
 */
import type { SlotShare } from './partition.js';
import type { Samples } from './train.js';

const f = Math.fround;

export interface PixelSplit {
  /** [N, C, H, W] 8-bit pixels */
  x: Uint8Array;
  y: ArrayLike<number>;
}

/** The samples `idx` of `pixels` (`sampleSize` = C*H*W), normalised per channel. */
export function normalise(pixels: Uint8Array, idx: ArrayLike<number>, labels: ArrayLike<number>, channels: number,
  sampleSize: number, mean: readonly number[], std: readonly number[]): Samples {
  const n = idx.length;
  const x = new Float32Array(n * sampleSize);
  const plane = sampleSize / channels;
  const lut: Float32Array[] = [];
  for (let c = 0; c < channels; c++) {
    const m = f(mean[c] ?? 0);
    const s = f(std[c] ?? 1);
    const t = new Float32Array(256);
    for (let p = 0; p < 256; p++) t[p] = f(f(f(p / 255) - m) / s);
    lut.push(t);
  }
  for (let i = 0; i < n; i++) {
    const src = idx[i]! * sampleSize;
    for (let j = 0; j < sampleSize; j++) x[i * sampleSize + j] = lut[Math.floor(j / plane)]![pixels[src + j]!]!;
  }
  return { x, y: Int32Array.from(labels), n, sampleSize };
}

/** A slot's training and test samples from the data set's pixels and its share of the deal. */
export function slotSamples(train: PixelSplit, test: PixelSplit, share: SlotShare, channels: number, sampleSize: number,
  mean: readonly number[], std: readonly number[]): { train: Samples; test: Samples } {
  return {
    train: normalise(train.x, share.trainIdx, share.trainY, channels, sampleSize, mean, std),
    test: normalise(test.x, share.testIdx, share.testY, channels, sampleSize, mean, std),
  };
}

export interface InputSplit {
  /** [N, ...sample] model inputs already (`statistics: "none"`) */
  x: Float32Array;
  y: ArrayLike<number>;
}

/** The samples `idx` of `inputs` (`sampleSize` elements each), as they are: copied, not normalised. */
export function gather(inputs: Float32Array, idx: ArrayLike<number>, labels: ArrayLike<number>, sampleSize: number): Samples {
  const n = idx.length;
  const x = new Float32Array(n * sampleSize);
  for (let i = 0; i < n; i++) {
    const src = idx[i]! * sampleSize;
    if (!Number.isSafeInteger(src) || src < 0 || src + sampleSize > inputs.length) throw new RangeError(`sample ${idx[i]} is out of range`);
    x.set(inputs.subarray(src, src + sampleSize), i * sampleSize);
  }
  return { x, y: Int32Array.from(labels), n, sampleSize };
}

/** A slot's training and test samples from a data set of model inputs (`statistics: "none"`) and its share. */
export function slotInputs(train: InputSplit, test: InputSplit, share: SlotShare, sampleSize: number): { train: Samples; test: Samples } {
  return {
    train: gather(train.x, share.trainIdx, share.trainY, sampleSize),
    test: gather(test.x, share.testIdx, share.testY, sampleSize),
  };
}
