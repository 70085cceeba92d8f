/**
 * DisPFL on the device (docs/protocol.md, "A round, step by step" and "Rounds, tasks and metrics"; docs/algorithms.md,
 * "DisPFL"; docs/model.md, "DisPFL's mask schedule"). The device keeps three things: its weights as its last
 * training left them (zero off its support), the support (the mask they were trained under: it travels with them)
 * and its current mask (after its last prune-and-regrow; never sent). A round t:
 *
 * 1. its own model and its in-neighbours' (the task's, downloaded and checked), each counted where the mask it
 *    travels with covers, summed in slot order in binary32, over the number of covering masks (0 where none), then
 *    times its current mask; a neighbour whose model is not finite or whose L2 norm exceeds `neighbour_bound`
 *    (default 10) times its own is left out (and counted as `dropped`);
 * 2. masked SGD from there (the training program's mode `dispfl`: the unmasked gradient; the clip before the mask);
 * 3. evaluate the trained model: the metrics of round t;
 * 4. prune `ceil(alpha_t * nnz)` smallest |w| and regrow as many zeros by largest |g| (the dense gradient on the
 *    first `batch_size` samples of a permutation from the `regrow` stream) or at random (`regrow-random`);
 *    ties at a cut go to the lower index;
 * 5. upload the trained weights with their support (tensors its density leaves dense go without a mask) as the
 *    update of round t; once accepted, post the metrics of round t.
 *
 * Round 0: the mask at its density by ERK, drawn from its slot's `mask` stream, the initial model times it, sent as
 * the update of round 0. Platform-neutral.
 */
import { type TensorIn, decode, encode } from './codec.js';
import { type Device, DivergedError, UnusableModel } from './device.js';
import type { Task } from './messages.js';
import { MT19937, Stream } from './rng.js';
import type { Weights } from './sgd.js';
import type { MetricRecord, Progress } from './state.js';
import { trainConfig } from './card.js';
import { allFinite, denseGradients, trainLocal } from './train.js';

type Masks = Map<string, Uint8Array>;

const numel = (s: readonly number[]): number => s.reduce((a, b) => a * b, 1);

/** `erk_densities`: per-tensor densities by the Erdős–Rényi-Kernel rule for overall `density` (power 1). */
export function erkDensities(shapes: ReadonlyMap<string, readonly number[]>, density: number): Map<string, number> {
  if (!(density > 0 && density <= 1)) throw new RangeError(`density must be in (0, 1], got ${density}`);
  const keys = [...shapes.keys()];
  const n = new Map(keys.map((k) => [k, numel(shapes.get(k)!)]));
  if (density === 1) return new Map(keys.map((k) => [k, 1.0]));
  const raw = new Map(keys.map((k) => [k, shapes.get(k)!.reduce((a, b) => a + b, 0) / n.get(k)!]));
  const dense = new Set<string>();
  let eps = 0;
  for (;;) {
    const sparse = keys.filter((k) => !dense.has(k));
    if (!sparse.length) break;
    let divisor = 0;
    for (const k of sparse) divisor += raw.get(k)! * n.get(k)!;
    let sumSparse = 0;
    for (const k of sparse) sumSparse += n.get(k)!;
    let sumDense = 0;
    for (const k of keys) if (dense.has(k)) sumDense += n.get(k)!;
    eps = (density * sumSparse - (1 - density) * sumDense) / divisor;
    const top = Math.max(...sparse.map((k) => raw.get(k)!));
    if (top * eps > 1) for (const k of sparse) {
      if (raw.get(k) === top) dense.add(k);
    }
    else break;
  }
  return new Map(keys.map((k) => [k, dense.has(k) ? 1.0 : eps * raw.get(k)!]));
}

/** `mask_ones`: `int(density_l * numel_l)` per tensor. */
export function maskOnes(shapes: ReadonlyMap<string, readonly number[]>, densities: ReadonlyMap<string, number>): Map<string, number> {
  return new Map([...shapes].map(([k, s]) => [k, Math.trunc(densities.get(k)! * numel(s))]));
}

/** `init_masks`: exactly `mask_ones` ones per tensor, at the first positions of a randperm from `gen`. */
export function initMasks(shapes: ReadonlyMap<string, readonly number[]>, densities: ReadonlyMap<string, number>, gen: MT19937): Masks {
  const counts = maskOnes(shapes, densities);
  const out: Masks = new Map();
  for (const [k, s] of shapes) {
    const n = numel(s);
    const perm = gen.randperm(n);
    const m = new Uint8Array(n);
    for (let i = 0; i < counts.get(k)!; i++) m[perm[i]!] = 1;
    out.set(k, m);
  }
  return out;
}

/** `prune_rate`: `alpha0 / 2 * (1 + cos(pi * t / T))`, taken at t - 1 after round t. */
export function pruneRate(alpha0: number, t: number, rounds: number): number {
  return (alpha0 / 2) * (1 + Math.cos((Math.PI * t) / rounds));
}

/** Indices (ascending) of the `k` smallest values of `key`; at the cut, the lowest indices first. */
export function selectSmallest(key: Float64Array, k: number): Int32Array {
  const n = key.length;
  if (k < 0 || k > n) throw new RangeError(`cannot select ${k} of ${n} elements`);
  if (k === 0) return new Int32Array(0);
  for (let i = 0; i < n; i++) if (Number.isNaN(key[i]!)) throw new RangeError('cannot select among NaN values');
  const kth = Float64Array.from(key).sort()[k - 1]!;
  const out: number[] = [];
  for (let i = 0; i < n; i++) if (key[i]! < kth) out.push(i);
  let tied = k - out.length;
  for (let i = 0; i < n && tied > 0; i++) {
    if (key[i] === kth) {
      out.push(i);
      tied--;
    }
  }
  return Int32Array.from(out).sort();
}

/** `prune_regrow` on one tensor: the new mask (the same number of ones). */
export function pruneRegrow(w: Float32Array, mask: Uint8Array, alpha: number, score: { grads: Float32Array } | { gen: MT19937 }): Uint8Array {
  const n = mask.length;
  let nnz = 0;
  for (let i = 0; i < n; i++) nnz += mask[i]!;
  const k = Math.min(Math.ceil(alpha * nnz), nnz);
  if (nnz === n || nnz === 0 || k === 0) return Uint8Array.from(mask);
  const mag = new Float64Array(n);
  for (let i = 0; i < n; i++) mag[i] = mask[i] ? Math.abs(w[i]!) : Infinity;
  const pruned = Uint8Array.from(mask);
  for (const i of selectSmallest(mag, k)) pruned[i] = 0;
  const r = 'gen' in score ? score.gen.rand(n) : null;
  const key = new Float64Array(n); // select_largest(s) = select_smallest(-s)
  for (let i = 0; i < n; i++) key[i] = pruned[i] ? Infinity : -(r !== null ? r[i]! : Math.abs((score as { grads: Float32Array }).grads[i]!));
  for (const i of selectSmallest(key, k)) pruned[i] = 1;
  return pruned;
}

const allOnes = (m: Uint8Array): boolean => {
  for (let i = 0; i < m.length; i++) if (!m[i]) return false;
  return true;
};

/** What the device keeps between rounds. */
export interface SparseState {
  weights: Weights;
  support: Masks;
  masks: Masks;
}

const MASK = 'mask:';

/** The state in one codec payload: the weights sparse on their support (dense where it is all ones), and the
 * current mask of each parameter as `mask:<key>`, ones sparse on the mask. */
async function save(dev: Device, st: SparseState, round: number, metrics: MetricRecord[]): Promise<void> {
  const tensors: TensorIn[] = [];
  for (const t of dev.card.tensors) {
    const s = st.support.get(t.name);
    tensors.push({ name: t.name, shape: t.shape, data: st.weights.get(t.name)!, mask: s && !allOnes(s) ? s : null });
  }
  for (const t of dev.card.tensors) {
    const m = st.masks.get(t.name);
    if (m !== undefined) tensors.push({ name: MASK + t.name, shape: t.shape, data: new Float32Array(m.length).fill(1), mask: allOnes(m) ? null : m });
  }
  const payload = encode({ model: dev.card.modelId, round, tensors }, { sha256: dev.platform.sha256 });
  await dev.store.saveModel('model.bin', payload, { round, metrics, dispfl: true });
}

export async function load(dev: Device): Promise<{ st: SparseState; round: number; metrics: MetricRecord[] }> {
  const got = await dev.store.loadModel('model.bin');
  if (got === null) throw new Error('model.bin is missing from the state dir; remove the state dir to enrol afresh');
  const d = decode(got.payload, { sha256: dev.platform.sha256, maxBytes: dev.cfg.maxBlobBytes, modelId: dev.card.modelId });
  const weights: Weights = new Map();
  const support: Masks = new Map();
  const masks: Masks = new Map();
  const params = dev.card.tensors.filter((t) => t.kind === 'parameter').map((t) => t.name);
  for (const t of dev.card.tensors) {
    const x = d.tensors.get(t.name);
    if (x === undefined) throw new Error(`model.bin lacks ${t.name}`);
    weights.set(t.name, Float32Array.from(x.data));
  }
  for (const k of params) {
    const w = d.tensors.get(k)!;
    const n = w.data.length;
    support.set(k, w.mask !== null ? Uint8Array.from(w.mask) : new Uint8Array(n).fill(1));
    const m = d.tensors.get(MASK + k);
    if (m === undefined) throw new Error(`model.bin lacks the mask of ${k}`);
    masks.set(k, m.mask !== null ? Uint8Array.from(m.mask) : new Uint8Array(n).fill(1));
  }
  return { st: { weights, support, masks }, round: got.meta.round, metrics: got.meta.metrics };
}

const paramShapes = (dev: Device): Map<string, number[]> =>
  new Map(dev.card.tensors.filter((t) => t.kind === 'parameter').map((t) => [t.name, t.shape]));

/** Round 0's state: its ERK mask at its density (its slot's `mask` stream) and the initial model on it. */
export async function initState(dev: Device, init: Weights): Promise<void> {
  const shapes = paramShapes(dev);
  const masks = initMasks(shapes, erkDensities(shapes, dev.enr.density), dev.stream(Stream.MASK, dev.enr.index));
  const weights: Weights = new Map();
  for (const [k, v] of init) {
    const m = masks.get(k);
    const w = Float32Array.from(v);
    if (m !== undefined) for (let i = 0; i < w.length; i++) w[i] = w[i]! * m[i]!;
    weights.set(k, w);
  }
  const copy = new Map([...masks].map(([k, m]) => [k, Uint8Array.from(m)]));
  await save(dev, { weights, support: masks, masks: copy }, 0, []);
}

/** The upload: its weights on the support they were trained under (dense tensors without a mask). */
function upload(dev: Device, st: SparseState, round: number): Uint8Array {
  const sent = new Map([...st.support].filter(([, m]) => !allOnes(m)));
  return dev.encodeModel(st.weights, dev.card.tensors.map((t) => t.name), round, sent);
}

/** Its initial sparse model as its update of round 0. */
export async function sendInitial(dev: Device): Promise<void> {
  const prog = await dev.store.progress();
  if (prog.round === 0 && !prog.posted && prog.digest !== null) {
    await dev.flushUpload();
    return;
  }
  const { st } = await load(dev);
  await dev.stageUpload(prog, 0, upload(dev, st, 0), [], null, null);
  await dev.flushUpload();
}

/** L2 norm over every tensor, summed in float64; Infinity for a model holding NaN or Inf. */
function norm(w: Weights): number {
  let sq = 0;
  for (const v of w.values()) for (let i = 0; i < v.length; i++) sq += v[i]! * v[i]!;
  return Number.isFinite(sq) ? Math.sqrt(sq) : Infinity;
}

export async function round(dev: Device, task: Task, prog: Progress): Promise<void> {
  const t = task.round;
  const saved = await load(dev);
  if (saved.round === t) {
    // trained in round t before a restart, not staged: send that, never train twice
    await dev.stageUpload(prog, t, upload(dev, saved.st, t), saved.metrics, null, null);
    await dev.flushUpload();
    return;
  }
  const me = dev.enr.index;
  const own = saved.st;
  const down = { bytes: 0 };
  type Row = { slot: number; weights: Weights; support: Masks };
  const rows: Row[] = [{ slot: me, weights: own.weights, support: own.support }];
  for (const n of task.neighbours ?? []) {
    if (n.device_id === dev.enr.device_id || n.index === me) continue;
    const got = dev.decodeModel(await dev.fetchBlob(n.digest, down));
    for (const tname of dev.card.tensors) if (!got.tensors.has(tname.name)) throw new UnusableModel(`neighbour slot ${n.index}'s model lacks ${tname.name}`);
    const support: Masks = new Map();
    for (const k of own.support.keys()) support.set(k, got.masks.get(k) ?? new Uint8Array(got.tensors.get(k)!.length).fill(1));
    rows.push({ slot: n.index, weights: got.tensors, support });
  }
  rows.sort((a, b) => a.slot - b.slot);
  // the neighbour screen: finite, and a norm within neighbour_bound x its own
  const options = (dev.config['options'] ?? {}) as Record<string, unknown>;
  const bound = typeof options['neighbour_bound'] === 'number' ? options['neighbour_bound'] : 10;
  const limit = bound > 0 ? bound * norm(own.weights) : Infinity;
  const dropped: number[] = [];
  const used = rows.filter((r) => {
    if (r.slot === me) return true;
    const nn = norm(r.weights);
    const ok = Number.isFinite(nn) && nn <= limit;
    if (!ok) dropped.push(r.slot);
    return ok;
  });
  if (dropped.length) dev.log('warn', `round ${t}: left out neighbour slot(s) [${dropped.join(', ')}]: non-finite, or a norm past the bound`);
  // the neighbourhood average, then its own current mask
  const start: Weights = new Map();
  for (const tn of dev.card.tensors) {
    const k = tn.name;
    const n = own.weights.get(k)!.length;
    const num = new Float32Array(n);
    const den = new Float32Array(n);
    const masked = own.support.has(k);
    for (const r of used) {
      const w = r.weights.get(k)!;
      const s = masked ? r.support.get(k)! : null;
      for (let i = 0; i < n; i++) {
        const c = s === null ? 1 : s[i]!;
        num[i] = num[i]! + Math.fround(w[i]! * c);
        den[i] = den[i]! + c;
      }
    }
    const avg = new Float32Array(n);
    const m = own.masks.get(k);
    for (let i = 0; i < n; i++) {
      const a = den[i]! > 0 ? Math.fround(num[i]! / Math.max(den[i]!, 1)) : 0;
      avg[i] = m !== undefined ? a * m[i]! : a;
    }
    start.set(k, avg);
  }
  // masked training under its current mask
  const trainS0 = performance.now();
  const masksF = new Map([...own.masks].map(([k, m]) => [k, m]));
  const st = await trainLocal(dev.trainingProgram, start, dev.data.train, trainConfig(dev.card, t), dev.stream(Stream.TRAIN, t, me), { masks: masksF });
  if (!allFinite(start.values())) throw new DivergedError(`DisPFL round ${t}: training diverged (NaN/Inf)`);
  const metrics = [{ ...(await dev.evaluate(start, t)), dropped: dropped.length }];
  // prune and regrow: the mask of the next round
  const sched = dev.card.training.maskSchedule;
  const alpha0 = sched?.alpha0 ?? Number(dev.config['alpha0'] ?? 0.5);
  const rounds = sched?.rounds ?? Number(dev.config['rounds']);
  const regrow = sched?.regrow ?? (dev.config['regrow'] === 'random' ? 'random' : 'gradient');
  const alpha = pruneRate(alpha0, t - 1, rounds);
  const grads = regrow === 'gradient'
    ? await denseGradients(dev.trainingProgram, start, dev.data.train, dev.card.training.batchSize, dev.stream(Stream.REGROW, t, me))
    : null;
  const gen = grads === null ? dev.stream(Stream.REGROW_RANDOM, t, me) : null;
  const next: Masks = new Map();
  for (const [k, m] of own.masks) {
    if (allOnes(m)) {
      next.set(k, Uint8Array.from(m));
      continue;
    }
    next.set(k, pruneRegrow(start.get(k)!, m, alpha, grads !== null ? { grads: grads.get(k)! } : { gen: gen! }));
  }
  const trainS = (performance.now() - trainS0) / 1e3;
  dev.log('info', `round ${t}: trained ${st.steps} steps, loss ${st.loss.toFixed(4)}; accuracy ${metrics[0]!.accuracy.toFixed(4)}` +
    ` (averaged ${used.length} model(s))`);
  prog.stats[String(t)] = { bytes_up: 0, bytes_down: down.bytes, train_s: trainS, step_ms: (1e3 * st.seconds) / Math.max(st.steps, 1) };
  const newState: SparseState = { weights: start, support: own.masks, masks: next };
  await save(dev, newState, t, metrics);
  await dev.store.saveModel('final.bin', dev.encodeModel(start, dev.card.tensors.map((x) => x.name), t), { round: t, metrics });
  await dev.stageUpload(prog, t, upload(dev, newState, t), metrics, st.loss, trainS);
  await dev.flushUpload();
}
