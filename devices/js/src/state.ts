/**
 * The device's state dir (docs/protocol.md, "Failures", "Credentials"): its nonce (written before it first asks
 * to enrol), its enrolment and token (private files), its model and the round it was trained in, its progress
 * (which round's update is staged or accepted, the metrics still to post, each round's bytes and times), the
 * payload of a trained round until the server has accepted it, and the programs it downloaded. Every file is
 * written atomically (a temp file renamed over it), so a device killed at any moment restarts from one whole
 * version of each. The files sit behind `Storage`, so a phone plugs in its own; Node's is ./nodejs/fs.ts.
 * Platform-neutral.
 */

/** Named files, each written atomically. */
export interface Storage {
  read(name: string): Promise<Uint8Array | null>;
  /** writes `data` to a temp file, flushes it and renames it over `name`; `secret`: readable by the owner only */
  write(name: string, data: Uint8Array, opts?: { secret?: boolean }): Promise<void>;
  remove(name: string): Promise<void>;
  /** appends a line (a log; not atomic) */
  append(name: string, line: string): Promise<void>;
}

export interface MetricRecord {
  round: number;
  accuracy: number;
  loss: number;
  n_test: number;
  dropped?: number;
}

export interface RoundStats {
  bytes_up: number;
  bytes_down: number;
  train_s: number | null;
  step_ms: number | null;
}

export interface Progress {
  /** the last round it trained in (0: none yet) */
  round: number;
  /** that round's update was accepted (or abandoned) */
  posted: boolean;
  /** sha256 of the staged upload */
  digest: string | null;
  train_loss: number | null;
  train_s: number | null;
  /** metrics to post once the staged update is accepted */
  pending_metrics: MetricRecord[];
  stats: Record<string, RoundStats>;
  /** FedPer: its final evaluation is posted */
  final: boolean;
  /** it enrolled after round 0 */
  late: boolean;
  /** DisPFL: its initial model (the update of round 0) is accepted */
  initial_sent: boolean;
  /** a round whose update the server closed without (409) or refused (422) */
  abandoned: number | null;
  bytes_up: number;
}

export const freshProgress = (): Progress => ({
  round: 0, posted: true, digest: null, train_loss: null, train_s: null, pending_metrics: [], stats: {}, final: false,
  late: false, initial_sent: false, abandoned: null, bytes_up: 0,
});

export interface TokenRecord {
  token: string;
  /** unix seconds it expires (null: not known yet; a rotation tells) */
  expires: number | null;
  /** unix seconds it was issued (as this device saw it) */
  issued: number;
}

export interface ModelMeta {
  /** the round it was trained in (0: the initial model) */
  round: number;
  /** metrics computed in that round, to post with its update */
  metrics: MetricRecord[];
  /** more of the algorithm's state (DisPFL: which tensors carry which mask) */
  [key: string]: unknown;
}

const enc = new TextEncoder();
const dec = new TextDecoder();

export class StateStore {
  constructor(readonly storage: Storage) {}

  async readJson<T>(name: string): Promise<T | null> {
    const b = await this.storage.read(name);
    return b === null ? null : (JSON.parse(dec.decode(b)) as T);
  }

  async writeJson(name: string, value: unknown, secret = false): Promise<void> {
    await this.storage.write(name, enc.encode(JSON.stringify(value, null, 1) + '\n'), { secret });
  }

  /** The nonce: read, or made (32 lowercase hex) and stored before it is used. */
  async nonce(random: (n: number) => Uint8Array): Promise<string> {
    const got = await this.readJson<{ nonce: string }>('nonce.json');
    if (got !== null && /^[0-9a-f]{32}$/.test(got.nonce)) return got.nonce;
    const nonce = [...random(16)].map((b) => b.toString(16).padStart(2, '0')).join('');
    await this.writeJson('nonce.json', { nonce }, true);
    return nonce;
  }

  async progress(): Promise<Progress> {
    return { ...freshProgress(), ...((await this.readJson<Partial<Progress>>('progress.json')) ?? {}) };
  }

  async saveProgress(p: Progress): Promise<void> {
    await this.writeJson('progress.json', p);
  }

  async token(): Promise<TokenRecord | null> {
    return this.readJson<TokenRecord>('token.json');
  }

  async saveToken(t: TokenRecord): Promise<void> {
    await this.writeJson('token.json', t, true);
  }

  /** The model (a codec payload) and its meta, in one file: `u32 LE` meta length, the meta JSON, the payload. */
  async saveModel(name: string, payload: Uint8Array, meta: ModelMeta): Promise<void> {
    const m = enc.encode(JSON.stringify(meta));
    const out = new Uint8Array(4 + m.length + payload.length);
    new DataView(out.buffer).setUint32(0, m.length, true);
    out.set(m, 4);
    out.set(payload, 4 + m.length);
    await this.storage.write(name, out);
  }

  async loadModel(name: string): Promise<{ payload: Uint8Array; meta: ModelMeta } | null> {
    const b = await this.storage.read(name);
    if (b === null) return null;
    if (b.length < 4) throw new Error(`${name} is cut short`);
    const len = new DataView(b.buffer, b.byteOffset, b.byteLength).getUint32(0, true);
    if (4 + len > b.length) throw new Error(`${name} is cut short`);
    return { meta: JSON.parse(dec.decode(b.subarray(4, 4 + len))) as ModelMeta, payload: b.subarray(4 + len) };
  }

  /** One line per update the server accepted: a retry after a restart (the server answers the same update again)
   *  finds its line there already and adds none. */
  async appendLedger(round: number, digest: string, nSamples: number): Promise<void> {
    const have = await this.storage.read('ledger.jsonl');
    if (have !== null) {
      for (const line of dec.decode(have).split('\n')) {
        if (!line) continue;
        const u = JSON.parse(line) as { round?: unknown; digest?: unknown };
        if (u.round === round && u.digest === digest) return;
      }
    }
    await this.storage.append('ledger.jsonl', JSON.stringify({ round, digest, n_samples: nSamples, at: Date.now() / 1e3 }));
  }
}
