/**
 * The deal: which of a data set's samples each slot of a federation holds, drawn exactly as pfl-edge deals them
 * (`pfl_edge.data.partition.partition_arrays` with `numpy_rng(seed, "partition")`), so that a device trains on
 * its slot's very samples. The whole federation is dealt (each slot's share depends on the draws for the others);
 * a device keeps its own slot's. Platform-neutral.
 *
 * Partitions dealt here: `iid`, `pathological:K`, `pathological-random:K`, `groups:G`, `preference[:P]`. The
 * Dirichlet splits (`dirichlet:A`, `dirichlet-client:A`) draw from numpy's gamma sampler; they are refused with a
 * clear message (a device of such a federation needs its data given to it).
 *
 * `preference` relabels: each slot sees its samples' classes through its own class -> rating map
 * (`SlotShare.labelMap`), so its labels are ratings `0 .. NUM_RATINGS - 1` and the federation's model predicts
 * `NUM_RATINGS` classes (`dealtClasses`), not the data set's.
 */
import type { Sha256 } from './sha256.js';
import { NumpyGenerator, Stream, deriveSeed } from './rng.js';

export class DealError extends Error {
  override name = 'DealError';
}

/** The preference task's ratings (`pfl_edge.data.partition.NUM_RATINGS`): what its model predicts. */
export const NUM_RATINGS = 5;

/** Partitions whose labels are not the data set's classes: each maps a slot's classes to `NUM_RATINGS` ratings. */
const RELABELLING = ['preference'];

/**
 * One slot's share: indices (ascending) into the train / test split, and the labels the slot sees for them (the
 * data set's classes, or for `preference` their ratings, `labelMap[class]`).
 */
export interface SlotShare {
  readonly trainIdx: Int32Array;
  readonly trainY: Int32Array;
  readonly testIdx: Int32Array;
  readonly testY: Int32Array;
  /** `preference`: the slot's class -> rating map (`PartitionArrays.label_maps[slot]`); null for the others */
  readonly labelMap: Int32Array | null;
}

export interface DealSpec {
  partition: string;
  clients: number;
  seed: bigint | number;
  samplesPerClient?: number | null;
  testPerClient?: number | null;
  /** 'disjoint' | 'shared'; null or absent: the partition's default (`defaultTestDraw`). */
  testDraw?: string | null;
}

/** The DisPFL reference's splits, whose test sets are drawn shared unless the config says (pfl_edge's rule). */
const SHARED_BY_DEFAULT = ['pathological-random', 'dirichlet-client'];

/**
 * How many classes the model of a federation dealt by `partition` predicts, its data set having `numClasses`
 * (`PartitionArrays.num_classes`): `NUM_RATINGS` for `preference`, else the data set's.
 */
export const dealtClasses = (partition: string, numClasses: number): number =>
  RELABELLING.includes(partition.split(':')[0]!) ? NUM_RATINGS : numClasses;

/** `default_test_draw`: how a partition's test sets are drawn when the config leaves `test_draw` unset. */
export const defaultTestDraw = (partition: string): string =>
  SHARED_BY_DEFAULT.includes(partition.split(':')[0]!) ? 'shared' : 'disjoint';

type Labels = ArrayLike<number>;

const flatnonzeroEq = (y: Labels, c: number): number[] => {
  const out: number[] = [];
  for (let i = 0; i < y.length; i++) if (y[i] === c) out.push(i);
  return out;
};

/** `np.array_split(a, k)`: the first `len % k` pieces one longer. */
function arraySplit<T>(a: ArrayLike<T>, k: number): T[][] {
  const n = a.length;
  const base = Math.floor(n / k);
  const extra = n % k;
  const out: T[][] = [];
  let at = 0;
  for (let i = 0; i < k; i++) {
    const len = base + (i < extra ? 1 : 0);
    out.push(Array.from({ length: len }, (_, j) => a[at + j]!));
    at += len;
  }
  return out;
}

/** Each client's train indices, in the order the partitioner builds them, and (`preference`) its label map. */
type Dealt = [parts: number[][], maps: Int32Array[] | null];
type Partitioner = (y: Labels, n: number, arg: string | null, numClasses: number, rng: NumpyGenerator) => Dealt;

function intArg(arg: string | null, lo: number, hi: number, what: string): number {
  if (arg === null || !/^[0-9]+$/.test(arg) || Number(arg) < lo || Number(arg) > hi) {
    throw new DealError(`${what} needs an integer in [${lo}, ${hi}], got ${arg === null ? 'None' : `'${arg}'`}`);
  }
  return Number(arg);
}

/** Python's `float(str)`: decimal digits with single underscores between them, an optional exponent, or nan / inf. */
const PY_DIGITS = String.raw`\d(?:_?\d)*`;
const PY_FLOAT = new RegExp(
  String.raw`^[+-]?(?:(?:${PY_DIGITS}\.(?:${PY_DIGITS})?|\.${PY_DIGITS}|${PY_DIGITS})(?:e[+-]?${PY_DIGITS})?|inf|infinity|nan)$`, 'i');

/** `_float_arg`: `arg` read as Python's `float` reads it (surrounding white space ignored); refused with pfl-edge's text. */
function floatArg(arg: string, what: string): number {
  const s = arg.trim();
  if (!PY_FLOAT.test(s)) throw new DealError(`${what} takes a number, got '${arg}'`);
  const word = s.replace(/^[+-]/, '').toLowerCase();
  if (word === 'nan') return NaN;
  if (word.startsWith('inf')) return s.startsWith('-') ? -Infinity : Infinity;
  return Number(s.replace(/_/g, ''));
}

const iid: Partitioner = (y, n, arg, _c, rng) => {
  if (arg !== null) throw new DealError('iid takes no argument');
  return [arraySplit(rng.permutation(y.length), n).map((p) => p.map(Number)), null];
};

const pathological: Partitioner = (y, n, arg, numClasses, rng) => {
  const k = intArg(arg, 1, numClasses, 'pathological:K');
  const order = rng.permutation(numClasses);
  const holders: number[][] = Array.from({ length: numClasses }, () => []);
  for (let i = 0; i < n; i++) for (let j = 0; j < k; j++) holders[order[(i * k + j) % numClasses]!]!.push(i);
  const parts: number[][] = Array.from({ length: n }, () => []);
  for (let c = 0; c < numClasses; c++) {
    const hs = holders[c]!;
    if (hs.length === 0) continue;
    const idx = rng.permutation(flatnonzeroEq(y, c));
    const chunks = arraySplit(idx, hs.length);
    hs.forEach((i, j) => parts[i]!.push(...chunks[j]!));
  }
  return [parts, null];
};

const groups: Partitioner = (y, n, arg, numClasses, rng) => {
  const g = intArg(arg, 1, Math.min(n, numClasses), 'groups:G');
  const sets = arraySplit(rng.permutation(numClasses), g);
  const parts: number[][] = Array.from({ length: n }, () => []);
  sets.forEach((classes, grp) => {
    const members: number[] = [];
    for (let i = grp; i < n; i += g) members.push(i);
    for (const c of classes) {
      const idx = rng.permutation(flatnonzeroEq(y, c));
      const chunks = arraySplit(idx, members.length);
      members.forEach((i, j) => parts[i]!.push(...chunks[j]!));
    }
  });
  return [parts, null];
};

const pathologicalRandom: Partitioner = (y, n, arg, numClasses, rng) => {
  const k = intArg(arg, 1, numClasses, 'pathological-random:K');
  const size = Math.floor(y.length / n);
  if (size < 1) throw new DealError(`pathological-random: ${y.length} samples cannot give each of ${n} clients one`);
  const arange = Array.from({ length: numClasses }, (_, i) => i);
  const classes: Float64Array[] = [];
  for (let i = 0; i < n; i++) classes.push(rng.choiceNoReplace(arange, k));
  const repeated: number[] = [];
  for (let i = 0; i < n; i++) for (let j = 0; j < size; j++) repeated.push(i);
  const order = rng.permutation(repeated);
  const pick = rng.integers(k, order.length);
  const cls = new Float64Array(order.length);
  for (let i = 0; i < order.length; i++) cls[i] = classes[order[i]!]![pick[i]!]!;
  const owners: number[] = [];
  const samples: number[] = [];
  for (let c = 0; c < numClasses; c++) {
    const hit: number[] = [];
    for (let i = 0; i < cls.length; i++) if (cls[i] === c) hit.push(i);
    const pool = rng.permutation(flatnonzeroEq(y, c));
    if (hit.length === 0) continue;
    if (pool.length === 0) throw new DealError(`pathological-random: class ${c} has no training samples`);
    hit.forEach((h, j) => {
      owners.push(order[h]!);
      samples.push(pool[j % pool.length]!);
    });
  }
  const parts: number[][] = Array.from({ length: n }, () => []);
  owners.forEach((o, j) => parts[o]!.push(samples[j]!)); // a stable sort by owner
  return [parts, null];
};

/**
 * `preference[:P]`: the images dealt `iid`; slot i (taste group g = i mod 5) rates class c as (c + g) mod 5, then
 * re-draws each class's rating with probability P (default 0.1): `redraw = random(C) < P`, and the re-drawn
 * classes, ascending, take `integers(0, 5, count)`.
 */
const preference: Partitioner = (y, n, arg, numClasses, rng) => {
  const p = arg === null ? 0.1 : floatArg(arg, 'preference:P');
  if (!(p >= 0 && p <= 1)) throw new DealError(`preference:P needs 0 <= P <= 1, got '${arg}'`);
  const [parts] = iid(y, n, null, numClasses, rng);
  const maps: Int32Array[] = [];
  for (let i = 0; i < n; i++) {
    const g = i % NUM_RATINGS;
    const m = new Int32Array(numClasses);
    for (let c = 0; c < numClasses; c++) m[c] = (c + g) % NUM_RATINGS;
    const u = rng.random(numClasses);
    const redraw: number[] = [];
    for (let c = 0; c < numClasses; c++) if (u[c]! < p) redraw.push(c);
    const r = rng.integers(NUM_RATINGS, redraw.length);
    redraw.forEach((c, j) => (m[c] = r[j]!));
    maps.push(m);
  }
  return [parts, maps];
};

const PARTITIONERS: Record<string, Partitioner> = {
  iid,
  pathological,
  groups,
  'pathological-random': pathologicalRandom,
  preference,
};

/** The partition names this device can deal. */
export const DEALT_PARTITIONS = Object.keys(PARTITIONERS).sort();

/** `_draw_test`: each slot's test indices in proportion to its train label counts. */
function drawTest(yte: Labels, counts: number[][], per: number, rng: NumpyGenerator): number[][] {
  const nClients = counts.length;
  const nClasses = counts[0]!.length;
  const want = counts.map((row) => {
    const total = row.reduce((a, b) => a + b, 0);
    const exact = row.map((v) => (per * v) / total);
    const w = exact.map(Math.floor);
    const rest = per - w.reduce((a, b) => a + b, 0);
    const order = exact.map((e, i) => [-(e - w[i]!), i] as const).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    for (let r = 0; r < rest; r++) w[order[r]![1]]! += 1;
    return w;
  });
  const out: number[][] = Array.from({ length: nClients }, () => []);
  for (let c = 0; c < nClasses; c++) {
    const pool = rng.permutation(flatnonzeroEq(yte, c));
    let demand = want.map((w) => w[c]!);
    const sum = demand.reduce((a, b) => a + b, 0);
    if (sum > pool.length) demand = demand.map((d) => Math.floor((d * pool.length) / sum));
    let end = 0;
    for (let i = 0; i < nClients; i++) {
      end += demand[i]!;
      for (let j = end - demand[i]!; j < end; j++) out[i]!.push(pool[j]!);
    }
  }
  return out;
}

/**
 * `draw_shared`, the DisPFL reference's draw: per slot, per class c it trains on, `ceil(n_c / n * per)` distinct
 * test samples of class c from a fresh permutation of the class's whole pool (shared between slots).
 */
function drawShared(yte: Labels, counts: number[][], per: number, rng: NumpyGenerator): number[][] {
  const pools = counts[0]!.map((_, c) => flatnonzeroEq(yte, c));
  return counts.map((row) => {
    const total = row.reduce((a, b) => a + b, 0);
    const out: number[] = [];
    row.forEach((v, c) => {
      if (!v) return;
      const pool = pools[c]!;
      const perm = rng.permutation(pool.length);
      const k = Math.min(pool.length, Math.ceil((v / total) * per));
      for (let j = 0; j < k; j++) out.push(pool[perm[j]!]!);
    });
    return out;
  });
}

const sorted = (a: number[]): Int32Array => Int32Array.from(a).sort();

/**
 * Deals `trainY`/`testY` (the data set's labels, `numClasses` classes) to `spec.clients` slots as pfl-edge does,
 * with `numpy_rng(seed, "partition")`; returns every slot's share. The labels of a share are what the model learns:
 * for `preference` the slot's ratings (`dealtClasses` of them), its train and test samples drawn by their classes.
 */
export function deal(sha256: Sha256, trainY: Labels, testY: Labels, numClasses: number, spec: DealSpec): SlotShare[] {
  const [name, ...rest] = spec.partition.split(':');
  const arg = rest.length ? rest.join(':') : null;
  const fn = PARTITIONERS[name!];
  if (fn === undefined) {
    throw new DealError(`this device cannot deal partition '${spec.partition}' (it deals ${DEALT_PARTITIONS.join(', ')}); ` +
      'give it its data instead');
  }
  const n = spec.clients;
  if (!Number.isSafeInteger(n) || n < 1) throw new DealError(`num_clients must be >= 1, got ${n}`);
  const rng = new NumpyGenerator(deriveSeed(sha256, spec.seed, Stream.PARTITION));
  const [dealt, maps] = fn(trainY, n, arg === '' ? null : arg, numClasses, rng);
  let parts = dealt;
  const spc = spec.samplesPerClient ?? null;
  if (spc !== null) {
    if (spc < 1) throw new DealError(`samples_per_client must be >= 1, got ${spc}`);
    parts = parts.map((p) => (p.length <= spc ? p : Array.from(rng.choiceNoReplace(p, spc))));
  }
  const trainIdx = parts.map(sorted);
  trainIdx.forEach((p, i) => {
    if (p.length === 0) throw new DealError(`partition '${spec.partition}' left client ${i} without training data; use fewer clients`);
  });
  const per = spec.testPerClient ?? Math.ceil(testY.length / n);
  const counts = trainIdx.map((p) => {
    const c = new Array<number>(numClasses).fill(0);
    for (const i of p) c[trainY[i]!]! += 1;
    return c;
  });
  const draw = spec.testDraw ?? defaultTestDraw(spec.partition);
  if (draw !== 'shared' && draw !== 'disjoint') throw new DealError(`test_draw must be disjoint or shared, got '${draw}'`);
  const testIdx = (draw === 'shared' ? drawShared : drawTest)(testY, counts, per, rng).map(sorted);
  testIdx.forEach((q, i) => {
    if (q.length === 0) throw new DealError(`client ${i} got no test samples (its classes are exhausted in the test split)`);
  });
  // the label maps apply after the test draw, which draws by the data set's classes (partition_arrays)
  return trainIdx.map((p, i) => {
    const map = maps === null ? null : maps[i]!;
    const labels = (idx: Int32Array, y: Labels): Int32Array => idx.map(map === null ? (j) => y[j]! : (j) => map[y[j]!]!);
    return { trainIdx: p, trainY: labels(p, trainY), testIdx: testIdx[i]!, testY: labels(testIdx[i]!, testY), labelMap: map };
  });
}
