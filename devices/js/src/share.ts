/**
 * A slot's share of a dealt federation's data set as the server deals it (`GET /v1/devices/me/share`,
 * docs/protocol.md "Data shares"; `pfl_edge.data_share.DataShare`), for a partition this device does not deal
 * itself: `dirichlet:A` and `dirichlet-client:A` draw numpy's gamma sampler, which nothing here reproduces. The
 * partitions of `DEALT_PARTITIONS` it still deals itself (./partition.ts).
 *
 * The answer is read as hostile (tolerant only of fields added later): every field's type, the slot its own, the
 * data set and partition its config's, `num_classes` the card's, every index an integer in range of its split,
 * ascending (so each once), neither split empty, and a `label_map` (where one is given) with one rating per class of
 * the data set, each in `[0, num_classes)`. What it gives is a `SlotShare`, the very thing the deal gives, so the
 * samples are gathered and normalised by the same code (./data.ts `slotSamples`, `slotInputs`). Platform-neutral.
 */
import { Http, HttpError } from './http.js';
import { DealError, type SlotShare } from './partition.js';

/** A share the server gave that this device refuses (or no share where it needs one): it cannot train. */
export class ShareError extends DealError {
  override name = 'ShareError';
}

/** The path a device asks for its share on. */
export const SHARE_PATH = '/v1/devices/me/share';

/**
 * The largest share answer read, in bytes, for splits of `trainN` and `testN` samples: a valid share names each
 * sample of a split at most once (its indices ascend), each index in at most 6 digits (the splits here hold fewer
 * than 1,000,000 samples; Fashion-MNIST's 60,000 take 5) and a separator, so 8 bytes a sample of both splits, plus
 * 64 KiB for the other fields (a label map of up to a few thousand classes, the names, white space). Fashion-MNIST:
 * 624 KiB; `synthetic`: 128 KiB. A larger answer is refused before it is held.
 */
export const shareBound = (trainN: number, testN: number): number => (trainN + testN) * 8 + 65536;

/** Where a platform gets its slot's share from: the device's authenticated `GET /v1/devices/me/share`. */
export interface ShareSource {
  /** the federation the device enrolled in: the share must be its */
  federation: string;
  /** the answer's JSON, read with a bound of `maxBytes` */
  fetch(maxBytes: number): Promise<unknown>;
}

/**
 * The share of the device on `http` (its token set), as a `ShareSource`: 404 (a server of protocol version 1, which
 * deals no shares) and 409 (its devices bring their own data) are `ShareError`s, as is an answer that is not JSON;
 * other failures are the HTTP client's (a 401 an `HttpError` for the caller to enrol again on).
 */
export function httpShareSource(http: Http, federation: string): ShareSource {
  return {
    federation,
    async fetch(maxBytes: number): Promise<unknown> {
      let answer;
      try {
        answer = await http.call('GET', SHARE_PATH, { maxBytes });
      } catch (e) {
        if (e instanceof HttpError && e.status === 404) {
          throw new ShareError(`the server gives no data shares (${e.status}: ${e.detail}): a server of protocol version 1 ` +
            'cannot give this device its share of a partition it does not deal');
        }
        if (e instanceof HttpError && e.status === 409) throw new ShareError(`the server deals this federation no data (${e.detail})`);
        throw e;
      }
      try {
        return answer.json();
      } catch (e) {
        throw new ShareError(`the server's share is not JSON (${e instanceof Error ? e.message : String(e)})`);
      }
    },
  };
}

/** What the share must be: the device's own and its federation's, and the splits and classes its indices index. */
export interface ShareExpect {
  /** the federation it enrolled in (null: not checked) */
  federation: string | null;
  /** its slot (`Enrolment.index`) */
  slot: number;
  /** the config's `dataset` and `partition` */
  dataset: string;
  partition: string;
  /** the classes the card's model predicts: the share's `num_classes` */
  numClasses: number;
  /** the data set's classes: a label map maps each of them */
  datasetClasses: number;
  /** the data set's labels of its train and test splits, in their stored order (what the indices index) */
  trainY: ArrayLike<number>;
  testY: ArrayLike<number>;
}

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === 'object' && v !== null && !Array.isArray(v);
const show = (v: unknown): string => {
  const s = typeof v === 'string' ? JSON.stringify(v) : Array.isArray(v) ? `a list of ${v.length}` : isObject(v) ? 'an object' : String(v);
  return s.length > 80 ? s.slice(0, 77) + '...' : s;
};

/** `v` as the ascending indices of a split of `n` samples (none twice), else a `ShareError` naming the first fault. */
function indices(v: unknown, n: number, what: string): Int32Array {
  if (!Array.isArray(v)) throw new ShareError(`the server's share: ${what} is ${show(v)}, not a list of indices`);
  if (v.length === 0) throw new ShareError(`the server's share: ${what} is empty (a slot of the deal holds samples of both splits)`);
  if (v.length > n) throw new ShareError(`the server's share: ${what} lists ${v.length} samples, more than the split's ${n}`);
  const out = new Int32Array(v.length);
  let prev = -1;
  for (let i = 0; i < v.length; i++) {
    const x: unknown = v[i];
    if (typeof x !== 'number' || !Number.isSafeInteger(x)) throw new ShareError(`the server's share: ${what}[${i}] is ${show(x)}, not an integer`);
    if (x < 0 || x >= n) throw new ShareError(`the server's share: ${what}[${i}] = ${x} is out of range of the split's ${n} samples`);
    if (x <= prev) {
      throw new ShareError(`the server's share: ${what}[${i}] = ${x} after ${prev}: the indices must ascend, each sample once`);
    }
    out[i] = x;
    prev = x;
  }
  return out;
}

/**
 * The server's share `body` read against `e`, as the deal's `SlotShare`: the indices, and their labels (the data
 * set's classes, or through `label_map` the slot's). Anything else is a `ShareError` saying what.
 */
export function parseShare(body: unknown, e: ShareExpect): SlotShare {
  if (!isObject(body)) throw new ShareError(`the server's share is ${show(body)}, not an object`);
  const field = (k: string): unknown => (Object.hasOwn(body, k) ? body[k] : undefined);
  const same = (k: string, want: string | number): void => {
    const got = field(k);
    if (got !== want) throw new ShareError(`the server's share is for ${k} ${show(got)}, not this device's ${show(want)}`);
  };
  if (e.federation !== null) same('federation', e.federation);
  same('slot', e.slot);
  same('dataset', e.dataset);
  same('partition', e.partition);
  const k = field('num_classes');
  if (typeof k !== 'number' || !Number.isSafeInteger(k) || k < 1) {
    throw new ShareError(`the server's share: num_classes is ${show(k)}, not a positive integer`);
  }
  if (k !== e.numClasses) throw new ShareError(`the server's share gives labels of ${k} classes, but the card's model predicts ${e.numClasses}`);
  const raw = field('label_map');
  let map: Int32Array | null = null;
  if (raw === undefined || raw === null) {
    if (k !== e.datasetClasses) {
      throw new ShareError(`the server's share gives labels of ${k} classes and no label map, but ${e.dataset} has ${e.datasetClasses}`);
    }
  } else {
    if (!Array.isArray(raw)) throw new ShareError(`the server's share: label_map is ${show(raw)}, not a list or null`);
    if (raw.length !== e.datasetClasses) {
      throw new ShareError(`the server's share: label_map has ${raw.length} entries, not one for each of ${e.dataset}'s ${e.datasetClasses} classes`);
    }
    map = new Int32Array(raw.length);
    raw.forEach((r: unknown, c) => {
      if (typeof r !== 'number' || !Number.isSafeInteger(r) || r < 0 || r >= k) {
        throw new ShareError(`the server's share: label_map[${c}] is ${show(r)}, not a label in [0, ${k})`);
      }
      map![c] = r;
    });
  }
  const trainIdx = indices(field('train'), e.trainY.length, 'train');
  const testIdx = indices(field('test'), e.testY.length, 'test');
  const labels = (idx: Int32Array, y: ArrayLike<number>, what: string): Int32Array => idx.map((j) => {
    const c = y[j]!;
    const l = map === null ? c : map[c];
    // the data set's own labels are the platform's, checked where they are read; a map covers each of its classes
    if (l === undefined || !(l >= 0 && l < k)) throw new ShareError(`the server's share: ${what} sample ${j} of class ${c} has no label in [0, ${k})`);
    return l;
  });
  return {
    trainIdx, trainY: labels(trainIdx, e.trainY, 'train'), testIdx, testY: labels(testIdx, e.testY, 'test'), labelMap: map,
  };
}
