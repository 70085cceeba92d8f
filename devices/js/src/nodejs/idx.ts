/**
 * Fashion-MNIST from its (gzipped) IDX files (Debian's `dataset-fashion-mnist`: /usr/share/datasets/fashion-mnist),
 * read with `node:zlib`. An IDX file of unsigned bytes: magic `00 00 08 NN` (NN dimensions), big-endian 32-bit
 * sizes, then the bytes.
 */
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { gunzipSync } from 'node:zlib';

export const FASHION_MNIST_DIRS = ['/usr/share/datasets/fashion-mnist'];

export interface Idx {
  dims: number[];
  data: Uint8Array;
}

export function readIdx(path: string): Idx {
  let raw: Uint8Array = readFileSync(path);
  if (path.endsWith('.gz')) raw = gunzipSync(raw);
  if (raw.length < 4 || raw[0] !== 0 || raw[1] !== 0 || raw[2] !== 0x08) throw new Error(`${path} is not an IDX file of unsigned bytes`);
  const ndim = raw[3]!;
  const view = new DataView(raw.buffer, raw.byteOffset, raw.byteLength);
  const dims: number[] = [];
  for (let i = 0; i < ndim; i++) dims.push(view.getUint32(4 + 4 * i, false));
  const header = 4 + 4 * ndim;
  const n = dims.reduce((a, b) => a * b, 1);
  if (raw.length !== header + n) throw new Error(`${path}: size ${raw.length} does not match its header [${dims.join(', ')}]`);
  return { dims, data: raw.subarray(header) };
}

export interface PixelSet {
  /** 8-bit pixels, [N, C, H, W] row-major */
  x: Uint8Array;
  y: Uint8Array;
  n: number;
}

export interface RawDataset {
  name: string;
  channels: number;
  size: number;
  numClasses: number;
  train: PixelSet;
  test: PixelSet;
}

export function fashionMnistDir(dataDir?: string | null): string {
  for (const d of dataDir ? [dataDir] : FASHION_MNIST_DIRS) {
    if (existsSync(join(d, 'train-images-idx3-ubyte.gz'))) return d;
  }
  throw new Error('Fashion-MNIST not found: on Debian/Ubuntu apt-get install dataset-fashion-mnist, or give --dataset-dir ' +
    'with train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz');
}

/** The labels alone (the deal needs only these). */
export function fashionMnistLabels(dataDir?: string | null): { train: Uint8Array; test: Uint8Array } {
  const d = fashionMnistDir(dataDir);
  return {
    train: readIdx(join(d, 'train-labels-idx1-ubyte.gz')).data,
    test: readIdx(join(d, 't10k-labels-idx1-ubyte.gz')).data,
  };
}

export function loadFashionMnist(dataDir?: string | null): RawDataset {
  const d = fashionMnistDir(dataDir);
  const part = (prefix: string): PixelSet => {
    const imgs = readIdx(join(d, `${prefix}-images-idx3-ubyte.gz`));
    const labels = readIdx(join(d, `${prefix}-labels-idx1-ubyte.gz`));
    if (imgs.dims.length !== 3 || labels.dims.length !== 1 || labels.dims[0] !== imgs.dims[0]) {
      throw new Error(`${d}: ${prefix} images [${imgs.dims}] and labels [${labels.dims}] do not match`);
    }
    for (const v of labels.data) if (v >= 10) throw new Error(`${d}: labels outside [0, 10)`);
    return { x: imgs.data, y: labels.data, n: imgs.dims[0]! };
  };
  return { name: 'fashion-mnist', channels: 1, size: 28, numClasses: 10, train: part('train'), test: part('t10k') };
}
