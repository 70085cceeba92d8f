/**
 * Local training and evaluation through the server's programs (docs/model.md): the gradient program (weights and
 * a fixed batch in; loss and gradients out) driven over the federation's batches, the optimiser step in JS
 * (./sgd.ts), and the inference program for accuracy and loss. The runtime is behind two small interfaces, so
 * that Node (onnxruntime-node), a phone (onnxruntime-react-native) and the unit tests (a program in plain JS)
 * share this code.
 */
import type { MT19937 } from './rng.js';
import { SGD, type TrainConfig, type Weights } from './sgd.js';

/** A training program: `forward(x, y, weight, *params) -> (loss, *grads)` at a fixed batch size. */
export interface GradientProgram {
  readonly batchSize: number;
  /** every parameter, in the program's input order */
  readonly keys: readonly string[];
  /** the keys whose gradients it returns, in order */
  readonly trainable: readonly string[];
  /** one sample's shape, [C, H, W] */
  readonly inputShape: readonly number[];
  run(x: Float32Array, y: BigInt64Array, weight: Float32Array, weights: ReadonlyMap<string, Float32Array>): Promise<{
    loss: number;
    grads: Map<string, Float32Array>;
  }>;
}

/** An inference program: logits `[n, classes]` of `n` samples under the given weights. */
export interface InferenceProgram {
  logits(x: Float32Array, n: number, weights: ReadonlyMap<string, Float32Array>): Promise<Float32Array>;
  readonly numClasses: number;
}

/** Samples as model inputs: `x` [n, ...sample] row-major, `y` labels. */
export interface Samples {
  readonly x: Float32Array;
  readonly y: Int32Array;
  readonly n: number;
  /** elements per sample */
  readonly sampleSize: number;
}

export interface TrainStats {
  /** mean of the batch losses */
  loss: number;
  steps: number;
  samples: number;
  seconds: number;
}

/** `pfl_edge.sgd.epoch_batches`: each epoch a fresh permutation from `gen`, cut into batches, the last partial. */
export function epochBatches(n: number, epochs: number, batchSize: number, gen: MT19937): Int32Array[] {
  const out: Int32Array[] = [];
  for (let e = 0; e < epochs; e++) {
    const perm = gen.randperm(n);
    for (let s = 0; s < n; s += batchSize) out.push(perm.subarray(s, Math.min(s + batchSize, n)));
  }
  return out;
}

/**
 * Loss and gradients on the samples `idx` (1 ... batchSize of them): a partial batch is padded to the program's
 * fixed batch with copies of its first sample at weight 0.
 */
export async function batchGradients(program: GradientProgram, weights: ReadonlyMap<string, Float32Array>, data: Samples,
  idx: ArrayLike<number>): Promise<{ loss: number; grads: Map<string, Float32Array> }> {
  const B = program.batchSize;
  const n = idx.length;
  if (n < 1 || n > B) throw new RangeError(`a batch of ${n} samples; this program takes 1 to ${B}`);
  const size = data.sampleSize;
  const x = new Float32Array(B * size);
  const y = new BigInt64Array(B);
  const w = new Float32Array(B);
  for (let i = 0; i < B; i++) {
    const src = idx[i < n ? i : 0]!;
    x.set(data.x.subarray(src * size, (src + 1) * size), i * size);
    y[i] = BigInt(data.y[src]!);
    w[i] = i < n ? 1 : 0;
  }
  return program.run(x, y, w, weights);
}

export interface TrainOptions {
  /** the keys it steps (default: every trainable key of the program) */
  trainable?: readonly string[];
  /** DisPFL: 0/1 masks of the masked tensors */
  masks?: ReadonlyMap<string, ArrayLike<number>>;
  /** Ditto: the anchor of the proximal term */
  anchor?: ReadonlyMap<string, Float32Array>;
  /** the wall clock, in seconds (default `performance.now()`-based) */
  now?: () => number;
}

/**
 * Local SGD over `weights` (changed in place): the federation's batches from `gen` (`epochBatches`), the program's
 * gradients, `SGD`'s step. Masked tensors start from `w * mask`.
 */
export async function trainLocal(program: GradientProgram, weights: Weights, data: Samples, cfg: TrainConfig, gen: MT19937,
  opts: TrainOptions = {}): Promise<TrainStats> {
  const now = opts.now ?? (() => performance.now() / 1e3);
  const t0 = now();
  if (cfg.batchSize > program.batchSize) throw new RangeError(`batch size ${cfg.batchSize} > the program's ${program.batchSize}`);
  const names = opts.trainable ? program.trainable.filter((k) => opts.trainable!.includes(k)) : [...program.trainable];
  if (opts.trainable) {
    const beyond = opts.trainable.filter((k) => !program.trainable.includes(k));
    if (beyond.length) throw new Error(`this program cannot train ${beyond.join(', ')}`);
  }
  const masks = opts.masks ?? new Map();
  for (const [k, m] of masks) {
    const w = weights.get(k);
    if (w === undefined) throw new Error(`a mask for ${k}, which the model does not have`);
    for (let i = 0; i < w.length; i++) w[i] = w[i]! * m[i]!;
  }
  const params: Weights = new Map(names.map((k) => {
    const w = weights.get(k);
    if (w === undefined) throw new Error(`no weights for ${k}`);
    return [k, w];
  }));
  const opt = new SGD(params, cfg, masks, opts.anchor);
  let lossSum = 0;
  let steps = 0;
  for (const b of epochBatches(data.n, cfg.epochs, cfg.batchSize, gen)) {
    const { loss, grads } = await batchGradients(program, weights, data, b);
    opt.step(grads);
    lossSum += loss;
    steps++;
  }
  return { loss: lossSum / Math.max(steps, 1), steps, samples: data.n * cfg.epochs, seconds: now() - t0 };
}

/** DisPFL's regrowth screen: the dense gradient on the first `batchSize` samples of one permutation from `gen`. */
export async function denseGradients(program: GradientProgram, weights: ReadonlyMap<string, Float32Array>, data: Samples,
  batchSize: number, gen: MT19937): Promise<Map<string, Float32Array>> {
  const b = gen.randperm(data.n).subarray(0, batchSize);
  const out = new Map(program.trainable.map((k) => [k, new Float32Array(weights.get(k)!.length)]));
  for (let s = 0; s < b.length; s += program.batchSize) {
    const chunk = b.subarray(s, s + program.batchSize);
    const { grads } = await batchGradients(program, weights, data, chunk);
    const share = chunk.length / b.length;
    for (const [k, g] of grads) {
      const o = out.get(k)!;
      const c = Math.fround(share);
      for (let i = 0; i < g.length; i++) o[i] = o[i]! + (share === 1 ? g[i]! : Math.fround(g[i]! * c));
    }
  }
  return out;
}

/** Correct predictions and summed cross-entropy (float64, natural log) of logits `[n, classes]` against `y`. */
export function scoreLogits(logits: Float32Array, y: ArrayLike<number>, n: number, classes: number): { correct: number; loss: number } {
  let correct = 0;
  let loss = 0;
  for (let i = 0; i < n; i++) {
    let top = -Infinity;
    let arg = 0;
    for (let c = 0; c < classes; c++) {
      const z = logits[i * classes + c]!;
      if (z > top) {
        top = z;
        arg = c;
      }
    }
    let s = 0;
    for (let c = 0; c < classes; c++) s += Math.exp(logits[i * classes + c]! - top);
    loss += top + Math.log(s) - logits[i * classes + y[i]!]!;
    if (arg === y[i]) correct++;
  }
  return { correct, loss };
}

/** Accuracy and mean cross-entropy of `weights` on `test`, in chunks of `chunk` samples. */
export async function evaluate(program: InferenceProgram, weights: ReadonlyMap<string, Float32Array>, test: Samples,
  chunk = 1000): Promise<{ accuracy: number; loss: number }> {
  let correct = 0;
  let loss = 0;
  for (let s = 0; s < test.n; s += chunk) {
    const n = Math.min(chunk, test.n - s);
    const logits = await program.logits(test.x.subarray(s * test.sampleSize, (s + n) * test.sampleSize), n, weights);
    const r = scoreLogits(logits, test.y.subarray(s, s + n), n, program.numClasses);
    correct += r.correct;
    loss += r.loss;
  }
  const n = Math.max(test.n, 1);
  return { accuracy: correct / n, loss: loss / n };
}

/** True when every value of every tensor is finite. */
export function allFinite(tensors: Iterable<Float32Array>): boolean {
  for (const t of tensors) for (let i = 0; i < t.length; i++) if (!Number.isFinite(t[i]!)) return false;
  return true;
}
