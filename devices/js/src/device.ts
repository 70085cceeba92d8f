/**
 * The device: enrols, follows its federation's rounds, and trains through the server's programs (docs/protocol.md,
 * "A minimal device", "A round, step by step", "Rounds, tasks and metrics"; docs/model.md). MQTT rings the bell;
 * the device acts only on `GET /v1/rounds/current/task`. Everything a round needs to be redone is in its state
 * dir (./state.ts): killed at any moment, it redoes at most its current round, with the same result.
 *
 * Algorithms: FedPer and FedAvg (its base part up, its personal blocks kept), FedPer-FT (the personal blocks
 * fine-tuned alone on each new base), DisPFL (./dispfl.ts). Platform-neutral: the platform (files, MQTT client,
 * ONNX runtime, data, randomness) is passed in.
 */
import type { webcrypto } from 'node:crypto';
import { type ModelCard, CardError, DATASET_SHAPES, findProgram, modelIdOf, parseCard, trainConfig } from './card.js';
import { CodecError, decode, encode } from './codec.js';
import { type EnrolConfig, EnrolRefused, type PlatformInfo, Tokens, enrol, renew } from './enrol.js';
import { Http, HttpError, Stopped, sleep } from './http.js';
import { maxBits, quantize } from './secagg.js';
import { runSecureRound } from './securestep.js';
import { type Enrolment, type RoundAnnouncement, type Task, federationState, parseBrokerInfo, parseTask, parseUpdateAccepted } from './messages.js';
import { Bell, type MqttConnect } from './mqtt.js';
import { privatize } from './privacy.js';
import { DEALT_PARTITIONS, dealtClasses } from './partition.js';
import { type ShareSource, httpShareSource } from './share.js';
import { MT19937, Stream, mtStream } from './rng.js';
import type { Weights } from './sgd.js';
import { toHex, type Sha256 } from './sha256.js';
import { type MetricRecord, type Progress, type RoundStats, StateStore, type Storage } from './state.js';
import { type GradientProgram, type InferenceProgram, type Samples, allFinite, evaluate, trainLocal } from './train.js';
import * as dispfl from './dispfl.js';

export type LogLevel = 'debug' | 'info' | 'warn' | 'error';

export interface DeviceData {
  train: Samples;
  test: Samples;
}

/** What the platform gives the device. */
export interface Platform {
  sha256: Sha256;
  random(n: number): Uint8Array;
  storage: Storage;
  mqttConnect: MqttConnect;
  openTraining(bytes: Uint8Array, card: ModelCard, mode: string, threads: number): Promise<GradientProgram>;
  openInference(bytes: Uint8Array, card: ModelCard, threads: number): Promise<InferenceProgram>;
  /**
   * its slot's samples, from the federation's config (dealt as pfl-edge deals them); for a partition it does not
   * deal, from the server's share, which `share` asks for (`GET /v1/devices/me/share`)
   */
  loadData(config: Record<string, unknown>, slot: number, card: ModelCard, share?: ShareSource): Promise<DeviceData>;
  log(level: LogLevel, msg: string): void;
  /** what this device is, said at enrolment (architecture, OS, runtime, threads); absent: it says nothing */
  describe?(threads: number): PlatformInfo;
  /** extra MQTT client options (TLS) */
  mqttExtra?: Record<string, unknown>;
}

export interface DeviceConfig {
  server: string;
  federation: string;
  enrolSecret: string;
  profile: string;
  name: string;
  partitionId: number | null;
  threads: number;
  /** seconds to keep retrying an unreachable server */
  patienceS: number;
  maxBlobBytes: number;
  /** ask the server for its task this often even without a bell, seconds (0: only on bells) */
  pollS: number;
  exitWhenDone: boolean;
}

export class DivergedError extends Error {
  override name = 'DivergedError';
}

/** A model it received that does not decode against its own, or holds NaN/Inf: it sits the round out. */
export class UnusableModel extends Error {
  override name = 'UnusableModel';
}

const SUPPORTED = ['fedper', 'fedavg', 'fedper-ft', 'dispfl', 'ditto', 'fedrep'];
const PERSONAL = 'personal:'; // Ditto's personal model in the state file
const MAX_CARD_BYTES = 16 << 20;

export class Device {
  readonly store: StateStore;
  readonly http: Http;
  private readonly stopper = new AbortController();
  private tokens!: Tokens;
  enr!: Enrolment;
  card!: ModelCard;
  config!: Record<string, unknown>;
  private training!: GradientProgram;
  private inference!: InferenceProgram;
  data!: DeviceData;
  private shapes!: Map<string, number[]>;
  private bell: Bell | null = null;
  private rang = false;
  private wakeUp: (() => void) | null = null;
  private hint: Task | null = null;
  private readonly skipped = new Set<number>();
  done = false;
  /** events, for tests and a phone app's UI */
  onEvent: (kind: string, data: Record<string, unknown>) => void = () => undefined;

  constructor(
    readonly cfg: DeviceConfig,
    readonly platform: Platform,
  ) {
    this.store = new StateStore(platform.storage);
    this.http = new Http(cfg.server, {
      patienceS: cfg.patienceS,
      signal: this.stopper.signal,
      log: (level, msg) => platform.log(level, msg),
    });
  }

  log(level: LogLevel, msg: string): void {
    this.platform.log(level, msg);
  }

  get algorithm(): string {
    return String(this.config['algorithm']);
  }

  private get enrolConfig(): EnrolConfig {
    const c = this.cfg;
    return {
      federation: c.federation, enrolSecret: c.enrolSecret, profile: c.profile, name: c.name, index: c.partitionId, nSamples: null,
      platform: this.platform.describe ? this.platform.describe(c.threads) : null, subtle: this.subtle,
    };
  }

  stop(): void {
    this.stopper.abort();
    this.ring();
  }

  private ring(): void {
    this.rang = true;
    const w = this.wakeUp;
    this.wakeUp = null;
    w?.();
  }

  // ------------------------------------------------------------------------------------------------ setup

  async setup(): Promise<void> {
    this.enr = await enrol(this.store, this.http, this.enrolConfig, (n) => this.platform.random(n));
    this.tokens = new Tokens(this.store, this.http, (m) => this.log('info', m), this.subtle);
    await this.tokens.load(this.enr);
    await this.renewing(() => this.rotateIfDue());
    const enr = this.enr;
    this.log('info', `device ${enr.device_id}, slot ${enr.index} of federation ${enr.federation} (joined in round ${enr.round})`);
    this.config = enr.config;
    if (!SUPPORTED.includes(this.algorithm)) {
      throw new CardError(`this device runs ${SUPPORTED.join(', ')}; federation ${enr.federation} runs ${this.algorithm}`);
    }
    const privacy = this.config['privacy'] as Record<string, unknown> | null | undefined;
    if (privacy && privacy['mode'] === 'distributed') {
      // its update would go without its share of the noise, and the server could not tell (docs/privacy.md)
      throw new CardError(`federation ${enr.federation} adds differential privacy's noise on its devices ` +
        '(privacy.mode "distributed"); this device does not: run the Python agent');
    }
    if (this.config['secure_aggregation'] != null && this.subtle === undefined) {
      // its update must never go in the clear (docs/secagg.md): without Web Crypto it cannot run SecAgg+'s steps
      throw new CardError(`federation ${enr.federation} aggregates securely (SecAgg+), which needs Web Crypto ` +
        '(X25519, AES-GCM, AES-CTR, HKDF); this platform has none');
    }
    if (this.cfg.partitionId !== null && this.cfg.partitionId !== enr.index && Number(this.config['participation'] ?? 1) >= 1) {
      throw new EnrolRefused(`asked for partition ${this.cfg.partitionId} but the server gave slot ${enr.index}`);
    }
    this.card = await this.renewing(() => this.fetchCard());
    const shape = DATASET_SHAPES[String(this.config['dataset'])];
    if (shape !== undefined) {
      // the deal's class count: a preference federation's model predicts its ratings, not the data set's classes
      const want = modelIdOf(this.config, { ...shape, numClasses: dealtClasses(String(this.config['partition']), shape.numClasses) });
      if (this.card.modelId !== want) throw new CardError(`the card's model id ${this.card.modelId} is not the federation's ${want}`);
    }
    if (this.card.federation !== enr.federation) throw new CardError(`the card is federation ${this.card.federation}'s`);
    this.shapes = new Map(this.card.tensors.map((t) => [t.name, t.shape]));
    const mode = this.algorithm === 'dispfl' ? 'dispfl' : 'fedper';
    const threads = this.cfg.threads;
    const trainEntry = findProgram(this.card, 'training', 'onnxruntime', mode);
    this.training = await this.platform.openTraining(await this.renewing(() => this.program(trainEntry.file)), this.card, mode, threads);
    if (this.training.batchSize < this.card.training.batchSize) {
      throw new CardError(`the training program takes batches of ${this.training.batchSize}, the federation trains with ${this.card.training.batchSize}`);
    }
    const inf = findProgram(this.card, 'inference', 'onnxruntime');
    this.inference = await this.platform.openInference(await this.renewing(() => this.program(inf.file)), this.card, threads);
    this.data = await this.platform.loadData(this.config, enr.index, this.card, this.shareSource());
    this.log('info', `data: ${this.data.train.n} training and ${this.data.test.n} test samples`);
    if ((await this.store.loadModel('model.bin')) === null) await this.renewing(() => this.initModel());
    const prog = await this.store.progress();
    if (this.algorithm === 'dispfl' && !prog.initial_sent) {
      await this.renewing(() => dispfl.sendInitial(this));
    } else {
      await this.renewing(() => this.flushUpload());
    }
  }

  /** Its share as the server deals it (for a partition it does not deal), asked for with its token renewed on a 401. */
  private shareSource(): ShareSource {
    const src = httpShareSource(this.http, this.enr.federation);
    return {
      federation: src.federation,
      fetch: async (maxBytes) => {
        this.log('info', `partition ${String(this.config['partition'])} is not one this device deals (${DEALT_PARTITIONS.join(', ')}): ` +
          `asking the server for slot ${this.enr.index}'s share`);
        return this.renewing(() => src.fetch(maxBytes));
      },
    };
  }

  private async rotateIfDue(): Promise<void> {
    if (!(await this.tokens.due())) return;
    await this.tokens.rotate(this.enr.device_id);
  }

  /** `step`, and once more after enrolling again if the server refused the token (401). */
  async renewing<T>(step: () => Promise<T>): Promise<T> {
    try {
      return await step();
    } catch (e) {
      if (!(e instanceof HttpError) || e.status !== 401) throw e;
      this.log('warn', `${e.message}: the device enrols again`);
      this.enr = await renew(this.store, this.http, this.enrolConfig, this.enr, (n) => this.platform.random(n));
      await this.tokens.load(this.enr);
      await this.tokens.rotate(this.enr.device_id);
      return step();
    }
  }

  private async fetchCard(): Promise<ModelCard> {
    const fed = encodeURIComponent(this.enr.federation);
    const body = await this.http.getJson(`/v1/federations/${fed}/model?training_backend=onnxruntime`, { maxBytes: MAX_CARD_BYTES });
    return parseCard(body);
  }

  /** A program's bytes: the stored copy if its size and sha256 are the card's, else downloaded, checked, stored. */
  private async program(file: string): Promise<Uint8Array> {
    const entry = this.card.programs.find((p) => p.file === file)!;
    const name = `programs/${file}`;
    const kept = await this.platform.storage.read(name);
    if (kept !== null && kept.length === entry.bytes && toHex(this.platform.sha256(kept)) === entry.sha256) return kept;
    const fed = encodeURIComponent(this.enr.federation);
    const got = (await this.http.call('GET', `/v1/federations/${fed}/programs/${file}`, { maxBytes: Math.max(entry.bytes, 1) })).bytes;
    if (got.length !== entry.bytes || toHex(this.platform.sha256(got)) !== entry.sha256) {
      throw new CardError(`program ${file} arrived with ${got.length} bytes and another sha256 than the card's; not using it`);
    }
    await this.platform.storage.write(name, got);
    this.log('info', `downloaded program ${file} (${got.length} bytes)`);
    return got;
  }

  // ------------------------------------------------------------------------------------------------ models

  /** `GET /v1/blobs/<digest>`, its sha256 checked; bytes counted into `down`. */
  async fetchBlob(digest: string, down: { bytes: number }): Promise<Uint8Array> {
    const data = (await this.http.call('GET', `/v1/blobs/${digest}`, { maxBytes: this.cfg.maxBlobBytes })).bytes;
    if (toHex(this.platform.sha256(data)) !== digest) throw new UnusableModel(`blob ${digest} arrived with other content (sha256 mismatch)`);
    down.bytes += data.length;
    return data;
  }

  /** A payload decoded against this device's model: names, shapes, model id, finite values. */
  decodeModel(payload: Uint8Array): { tensors: Weights; masks: Map<string, Uint8Array>; round: number } {
    let d;
    try {
      d = decode(payload, { sha256: this.platform.sha256, maxBytes: this.cfg.maxBlobBytes, modelId: this.card.modelId,
        expected: this.shapes, allowMissing: true });
    } catch (e) {
      if (e instanceof CodecError) throw new UnusableModel(`a model it received is unusable: ${e.message}`);
      throw e;
    }
    const tensors: Weights = new Map();
    const masks = new Map<string, Uint8Array>();
    for (const [k, t] of d.tensors) {
      tensors.set(k, t.data);
      if (t.mask !== null) masks.set(k, t.mask);
    }
    if (!allFinite(tensors.values())) throw new UnusableModel('a model it received holds NaN or Inf');
    return { tensors, masks, round: d.round };
  }

  /** Encodes tensors `keys` of `state` (in the card's order), sparse where `masks` has a mask. */
  encodeModel(state: Weights, keys: readonly string[], round: number, masks: ReadonlyMap<string, Uint8Array> = new Map()): Uint8Array {
    const want = new Set(keys);
    return encode({
      model: this.card.modelId, round,
      tensors: this.card.tensors.filter((t) => want.has(t.name)).map((t) => ({
        name: t.name, shape: t.shape, data: state.get(t.name)!, mask: masks.get(t.name) ?? null,
      })),
    }, { sha256: this.platform.sha256 });
  }

  /** The initial model: the base part from `init_digest`, the personal tensors from `init_model`. */
  private async initModel(): Promise<void> {
    const enr = this.enr;
    const down = { bytes: 0 };
    const base = this.decodeModel(await this.fetchBlob(enr.init_digest, down)).tensors;
    const state: Weights = new Map();
    const missing = this.card.tensors.filter((t) => !base.has(t.name)).map((t) => t.name);
    if (missing.length) {
      if (!enr.init_model) throw new CardError(`the initial model lacks ${missing.join(', ')} and the enrolment names no init_model`);
      const whole = this.decodeModel(await this.fetchBlob(enr.init_model, down)).tensors;
      for (const k of missing) {
        const v = whole.get(k);
        if (v === undefined) throw new CardError(`the federation's initial model lacks ${k}`);
        base.set(k, v);
      }
    }
    for (const t of this.card.tensors) state.set(t.name, Float32Array.from(base.get(t.name)!));
    const prog = await this.store.progress();
    prog.late = enr.round > 0;
    prog.stats['0'] = { bytes_up: 0, bytes_down: down.bytes, train_s: null, step_ms: null };
    await this.store.saveProgress(prog);
    if (this.algorithm === 'dispfl') {
      await dispfl.initState(this, state);
    } else {
      // Ditto: the personal model starts as the initial model
      await this.saveModel(state, 0, [], this.algorithm === 'ditto' ? new Map([...state].map(([k, v]) => [k, Float32Array.from(v)])) : null);
    }
  }

  /** The device's model (Ditto: and its personal model, as `personal:<key>`), the round it was trained in and that
   * round's metrics, in one file written atomically: a restart never sees parts of two rounds. */
  async saveModel(state: Weights, round: number, metrics: MetricRecord[], personal: Weights | null = null): Promise<void> {
    const tensors = this.card.tensors.map((t) => ({ name: t.name, shape: t.shape, data: state.get(t.name)! }));
    if (personal !== null) for (const t of this.card.tensors) tensors.push({ name: PERSONAL + t.name, shape: t.shape, data: personal.get(t.name)! });
    const payload = encode({ model: this.card.modelId, round, tensors }, { sha256: this.platform.sha256 });
    await this.store.saveModel('model.bin', payload, { round, metrics });
  }

  async loadModel(): Promise<{ state: Weights; personal: Weights | null; round: number; metrics: MetricRecord[] }> {
    const got = await this.store.loadModel('model.bin');
    if (got === null) throw new Error('model.bin is missing from the state dir; remove the state dir to enrol afresh');
    const d = decode(got.payload, { sha256: this.platform.sha256, maxBytes: this.cfg.maxBlobBytes, modelId: this.card.modelId });
    const state: Weights = new Map();
    let personal: Weights | null = null;
    for (const t of this.card.tensors) {
      const x = d.tensors.get(t.name);
      if (x === undefined || x.shape.join(',') !== t.shape.join(',')) throw new Error(`model.bin lacks ${t.name} of shape [${t.shape}]`);
      state.set(t.name, Float32Array.from(x.data));
      const p = d.tensors.get(PERSONAL + t.name);
      if (p !== undefined) (personal ??= new Map()).set(t.name, Float32Array.from(p.data));
    }
    if (personal !== null && personal.size !== state.size) throw new Error('model.bin holds part of a personal model');
    return { state, personal, round: got.meta.round, metrics: got.meta.metrics };
  }

  // ------------------------------------------------------------------------------------------------ main loop

  async run(): Promise<number> {
    try {
      await this.setup();
    } catch (e) {
      if (e instanceof Stopped) return 0;
      throw e;
    }
    const enr = this.enr;
    this.bell = new Bell({
      federation: enr.federation, deviceId: enr.device_id, clientId: enr.mqtt_client_id ?? `pfl-${enr.device_id}`,
      brokerUrl: enr.broker_url, username: enr.mqtt_username,
      password: enr.mqtt_password, connect: this.platform.mqttConnect,
      onBell: (hint, ann) => this.onBell(hint, ann),
      isStale: (t) => this.isStale(t),
      brokerNow: async () => parseBrokerInfo(await this.http.getJson('/v1/devices/me/broker')),
      log: (level, msg) => this.log(level, msg),
      extra: this.platform.mqttExtra,
    });
    this.bell.start();
    this.staleProgress = await this.store.progress();
    try {
      this.rang = true; // the server's task now: a retained message may never come
      while (!this.done && !this.stopper.signal.aborted) {
        if (!this.rang) {
          let timer: ReturnType<typeof setTimeout> | null = null;
          await new Promise<void>((resolve) => {
            this.wakeUp = resolve;
            if (this.cfg.pollS > 0) timer = setTimeout(() => this.ring(), this.cfg.pollS * 1e3);
          });
          if (timer !== null) clearTimeout(timer);
        }
        if (this.stopper.signal.aborted) break;
        this.rang = false;
        const hint = this.hint;
        this.hint = null;
        try {
          await this.renewing(() => this.rotateIfDue());
          await this.renewing(() => this.wake(hint));
        } catch (e) {
          if (e instanceof Stopped) break;
          if (e instanceof HttpError && e.status >= 400 && e.status < 500 && e.status !== 401 && e.status !== 429) {
            // an answer that is not this device's to fix now: logged, and the next bell asks again
            this.log('error', e.message);
            await sleep(2000, this.stopper.signal).catch(() => undefined);
            continue;
          }
          throw e;
        }
        this.staleProgress = await this.store.progress();
      }
    } finally {
      await this.bell.close().catch(() => undefined);
    }
    return 0;
  }

  private staleProgress: Progress | null = null;

  private isStale(t: Task): boolean {
    const p = this.staleProgress;
    if (p === null) return false;
    if (t.final) return p.final;
    return t.round < p.round || (t.round === p.round && p.posted);
  }

  private onBell(hint: Task | null, ann: RoundAnnouncement | null): void {
    if (hint !== null) this.hint = hint;
    if (ann !== null) this.log('debug', `round ${ann.round} ${ann.state}`);
    this.ring();
  }

  /** The server's current task (null: none now, 404). */
  private async currentTask(): Promise<Task | null> {
    let body: unknown;
    try {
      body = await this.http.getJson('/v1/rounds/current/task');
    } catch (e) {
      if (e instanceof HttpError && e.status === 404) return null;
      throw e;
    }
    const task = parseTask(body);
    if (task.federation !== this.enr.federation) throw new Error(`the server sent a task of federation ${task.federation}`);
    return task;
  }

  private async finished(): Promise<boolean> {
    const info = federationState(await this.http.getJson(`/v1/federations/${encodeURIComponent(this.enr.federation)}`));
    return info.state === 'finished';
  }

  private async wake(hint: Task | null): Promise<void> {
    const task = await this.currentTask();
    if (hint !== null) {
      if (task === null) this.log('info', `the broker's task of round ${hint.round} is not the server's: it has no task now`);
      else if (hint.round === task.round && hint.final === task.final && (hint.base !== task.base ||
        JSON.stringify(hint.neighbours) !== JSON.stringify(task.neighbours))) {
        this.log('warn', `round ${task.round}: the broker's task differs from the server's; ignoring the broker's`);
        this.onEvent('task_mismatch', { round: task.round });
      }
    }
    if (task !== null) {
      await this.runTask(task);
      return;
    }
    const prog = await this.store.progress();
    const finalTask = this.algorithm !== 'dispfl';
    if (await this.finished() && (!finalTask || prog.final)) this.done = this.cfg.exitWhenDone;
  }

  private async runTask(task: Task): Promise<void> {
    const prog = await this.store.progress();
    if (task.final) {
      if (!prog.final) await this.final(task, prog);
      this.done = this.cfg.exitWhenDone;
      return;
    }
    if (task.round < prog.round || (task.round === prog.round && prog.posted) || this.skipped.has(task.round)) return;
    this.onEvent('task', { round: task.round });
    try {
      if (task.round === prog.round && !prog.posted) await this.flushUpload();
      else if (this.algorithm === 'dispfl') await dispfl.round(this, task, prog);
      else await this.round(task, prog);
    } catch (e) {
      if (!(e instanceof UnusableModel || e instanceof DivergedError)) throw e;
      this.skipped.add(task.round);
      this.log('error', `round ${task.round}: skipped (${e instanceof UnusableModel ? 'bad_model' : 'diverged'}): ${e.message}`);
      this.onEvent(e instanceof UnusableModel ? 'bad_model' : 'diverged', { round: task.round, error: e.message });
    }
  }

  // ------------------------------------------------------------------------------------------------ FedPer

  /**
   * `pfl_edge.privacy.privatize` (central mode): under a federation's `privacy` table, what it sends of `state`
   * is `base` plus its update clipped to `clip * (1 - 1e-6)` in L2 over the base tensors; else `state` itself.
   */
  private privatized(state: Weights, base: Weights): Weights {
    const privacy = this.config['privacy'] as Record<string, unknown> | null | undefined;
    return privacy ? privatize(state, base, this.card.baseKeys, Number(privacy['clip'])) : state;
  }

  /** Puts the base part `base` on `state` (its personal tensors kept); the base must hold exactly its base keys. */
  private withBase(state: Weights, base: Weights): Weights {
    const want = new Set(this.card.baseKeys);
    const got = [...base.keys()];
    if (got.length !== want.size || got.some((k) => !want.has(k))) {
      throw new UnusableModel(`the base holds ${got.join(', ')}, not this device's base keys ${[...want].join(', ')}`);
    }
    const out: Weights = new Map();
    for (const [k, v] of state) out.set(k, want.has(k) ? Float32Array.from(base.get(k)!) : v);
    return out;
  }

  /** FedPer-FT (and a late joiner's first round): the personal blocks alone, base frozen, `ft_epochs`. */
  private async finetunePersonal(state: Weights, t: number, epochs: number): Promise<number> {
    const personal = this.card.personalKeys.filter((k) => this.card.tensors.find((x) => x.name === k)?.kind === 'parameter');
    if (!personal.length || epochs === 0) return 0;
    const gen = this.stream(Stream.FINETUNE, t, this.enr.index);
    const st = await trainLocal(this.training, state, this.data.train, trainConfig(this.card, t, epochs), gen, { trainable: personal });
    return st.seconds;
  }

  get seed(): bigint {
    const s = this.config['seed'];
    if (typeof s !== 'number' || !Number.isSafeInteger(s)) throw new CardError(`the federation's seed ${String(s)} is not an integer this device can hold exactly`);
    return BigInt(s);
  }

  /** The federation's stream `name`/`index` (e.g. `train`, round, slot), as torch's generator draws it. */
  stream(name: string, ...index: number[]): MT19937 {
    return mtStream(this.platform.sha256, this.seed, name, ...index);
  }

  async evaluate(state: Weights, round: number): Promise<MetricRecord> {
    const { accuracy, loss } = await evaluate(this.inference, state, this.data.test);
    return { round, accuracy, loss, n_test: this.data.test.n };
  }

  get trainingProgram(): GradientProgram {
    return this.training;
  }

  private async round(task: Task, prog: Progress): Promise<void> {
    const t = task.round;
    const saved = await this.loadModel();
    if (task.base === null || task.base === undefined) throw new UnusableModel(`round ${t}'s task names no base`);
    const down = { bytes: 0 };
    if (saved.round === t && this.config['secure_aggregation'] != null) {
      // its keys died with the restart (securestep.ts): it sits the round out, a dropout the round recovers from
      this.skipped.add(t);
      this.log('warn', `round ${t}: restarted during its secure aggregation; it sits the round out`);
      return;
    }
    if (saved.round === t) {
      // trained in round t before a restart, not staged: send that, never train twice
      const sent = this.config['privacy'] ? this.privatized(saved.state, this.decodeModel(await this.fetchBlob(task.base, down)).tensors)
        : saved.state;
      await this.stageUpload(prog, t, this.encodeModel(sent, this.card.baseKeys, t), saved.metrics, null, null);
      await this.flushUpload();
      return;
    }
    const base = this.decodeModel(await this.fetchBlob(task.base, down)).tensors;
    const state = this.withBase(saved.state, base);
    const prev = prog.round >= 1 ? t - 1 : 0;
    let trainS = 0;
    const ftEpochs = this.algorithm === 'fedper-ft' ? this.card.training.ftEpochs
      : prog.late && prev === 0 ? Number(this.config['ft_epochs'] ?? 1) : 0;
    if (ftEpochs > 0) trainS += await this.finetunePersonal(state, prev, ftEpochs);
    const personal = saved.personal; // Ditto: what it deploys
    const metrics: MetricRecord[] = [];
    if (prev >= 1) metrics.push(await this.evaluate(personal ?? state, prev));
    const anchor = personal !== null ? new Map([...state].map(([k, v]) => [k, Float32Array.from(v)])) : null;
    let steps = 0;
    let body: string[] | undefined;
    if (this.algorithm === 'fedrep') {
      // FedRep (pfl_edge/algorithms/fedrep.py): the head (its personal parameters) alone for head_epochs from its
      // PERSONAL stream, then the base alone for the round's epochs from TRAIN; the same whole-model program
      const head = this.card.personalKeys.filter((k) => this.training.trainable.includes(k));
      body = this.training.trainable.filter((k) => !head.includes(k));
      // the card's (protocol 2); a server of version 1 sends none: the config's option, else its default
      const opts = (this.config['options'] ?? {}) as Record<string, unknown>;
      const headEpochs = this.card.training.headEpochs ?? (typeof opts['head_epochs'] === 'number' ? opts['head_epochs'] : 10);
      if (head.length && headEpochs > 0) {
        const hst = await trainLocal(this.training, state, this.data.train, trainConfig(this.card, t, headEpochs),
          this.stream(Stream.PERSONAL, t, this.enr.index), { trainable: head });
        trainS += hst.seconds;
        steps += hst.steps;
      }
    }
    const st = await trainLocal(this.training, state, this.data.train, trainConfig(this.card, t), this.stream(Stream.TRAIN, t, this.enr.index),
      body ? { trainable: body } : {});
    trainS += st.seconds;
    steps += st.steps;
    if (personal !== null && anchor !== null) {
      // Ditto: the personal model, pulled towards the global model it received (lam), from its own stream
      const opts = (this.config['options'] ?? {}) as Record<string, unknown>;
      const ditto = this.card.training.ditto;
      const lam = ditto?.lam ?? (typeof opts['lam'] === 'number' ? opts['lam'] : 0.1);
      const epochs = ditto?.personalEpochs ?? (typeof opts['personal_epochs'] === 'number' ? opts['personal_epochs'] : this.card.training.localEpochs);
      const pst = await trainLocal(this.training, personal, this.data.train, { ...trainConfig(this.card, t, epochs), prox: lam },
        this.stream(Stream.PERSONAL, t, this.enr.index), { anchor });
      trainS += pst.seconds;
      steps += pst.steps;
    }
    if (!allFinite(state.values()) || (personal !== null && !allFinite(personal.values()))) {
      throw new DivergedError(`training diverged: NaN/Inf in the model of round ${t}`);
    }
    this.log('info', `round ${t}: trained ${steps} steps in ${trainS.toFixed(2)} s, loss ${st.loss.toFixed(4)}` +
      (metrics.length ? `; round ${prev}: accuracy ${metrics[0]!.accuracy.toFixed(4)}` : ''));
    prog.stats[String(t)] = { bytes_up: 0, bytes_down: down.bytes, train_s: trainS, step_ms: (1e3 * trainS) / Math.max(steps, 1) };
    await this.saveModel(state, t, metrics, personal);
    if (this.config['secure_aggregation'] != null) {
      await this.sendSecurely(t, prog, this.privatized(state, base), base, metrics, st.loss, trainS);
      return;
    }
    await this.stageUpload(prog, t, this.encodeModel(this.privatized(state, base), this.card.baseKeys, t), metrics, st.loss,
      trainS);
    await this.flushUpload();
  }

  /** Its update goes only masked, through the round's secure aggregation (securestep.ts, docs/secagg.md). */
  private async sendSecurely(t: number, prog: Progress, sent: Weights, base: Weights, metrics: MetricRecord[],
    loss: number, trainS: number): Promise<void> {
    const sa = this.config['secure_aggregation'] as Record<string, unknown>;
    const privacy = this.config['privacy'] as Record<string, unknown> | null | undefined;
    const bound = Number(sa['bound'] ?? privacy?.['clip']);
    const bits = typeof sa['bits'] === 'number' ? sa['bits'] : maxBits(Number(this.config['clients']));
    const keys = [...this.card.baseKeys].sort(); // the tensors by name, as the server orders the vector
    const delta = new Float64Array(keys.reduce((n, k) => n + base.get(k)!.length, 0));
    let at = 0;
    for (const k of keys) {
      const a = sent.get(k)!;
      const b = base.get(k)!;
      for (let i = 0; i < a.length; i++) delta[at++] = a[i]! - b[i]!;
    }
    const sendInput = async (payload: Uint8Array): Promise<boolean> => {
      await this.stageUpload(prog, t, payload, metrics, loss, trainS);
      await this.flushUpload();
      return (await this.store.progress()).abandoned !== t;
    };
    const ok = await runSecureRound({ http: this.http, subtle: this.subtle!, random: (n) => this.platform.random(n),
      federation: this.enr.federation, slot: this.enr.index, stepS: Number(sa['step_s'] ?? 60), signal: this.stopper.signal,
      log: (level, msg) => this.log(level, msg) }, t, quantize(delta, bound, bits), sendInput);
    if (!ok && (await this.store.progress()).round !== t) {
      this.skipped.add(t); // it never got to send: the last round's metrics all the same
      for (const m of metrics) await this.postMetrics(m, prog);
    }
  }

  /** Web Crypto, where the platform has it (Node 20, browsers; not React Native without a polyfill). */
  get subtle(): webcrypto.SubtleCrypto | undefined {
    return (globalThis.crypto as { subtle?: webcrypto.SubtleCrypto } | undefined)?.subtle;
  }

  /** The federation's last step (FedPer): evaluate on the last average, report round T's metrics, keep the model. */
  private async final(task: Task, prog: Progress): Promise<void> {
    const saved = await this.loadModel();
    try {
      if (task.base === null || task.base === undefined) throw new UnusableModel('the final task names no base');
      const down = { bytes: 0 };
      const base = this.decodeModel(await this.fetchBlob(task.base, down)).tensors;
      // the last base under its own blocks, adapted as a round would adapt them (Central.device_round, final):
      // FedPer-FT fine-tunes its personal blocks on it; so does a late joiner that never trained
      const synced = this.withBase(saved.state, base);
      const prev = prog.round >= 1 ? task.round : 0;
      const ftEpochs = this.algorithm === 'fedper-ft' ? this.card.training.ftEpochs
        : prog.late && prev === 0 ? Number(this.config['ft_epochs'] ?? 1) : 0;
      if (saved.personal === null && ftEpochs > 0) await this.finetunePersonal(synced, prev, ftEpochs);
      const state = saved.personal ?? synced; // Ditto deploys its personal model
      const names = this.card.tensors.map((x) => x.name);
      if (prog.round >= 1) {
        const m = await this.evaluate(state, task.round);
        this.log('info', `final (round ${task.round}): accuracy ${m.accuracy.toFixed(4)}, loss ${m.loss.toFixed(4)} on ${m.n_test} test samples`);
        await this.store.saveModel('final.bin', this.encodeModel(state, names, task.round), { round: task.round, metrics: [m] });
        await this.postMetrics(m, prog);
      } else {
        // never drawn (a sampled federation): it still deploys the last base under its own blocks, as the
        // simulator does for its slot (Central.device_round, final); it trained no round, so it reports none
        this.log('info', `final (round ${task.round}): never drawn; deploying the last base under its own blocks`);
        await this.store.saveModel('final.bin', this.encodeModel(state, names, task.round), { round: task.round, metrics: [] });
      }
    } catch (e) {
      if (!(e instanceof UnusableModel)) throw e;
      this.log('error', `final step of round ${task.round}: skipped (bad_model): ${e.message}`);
    }
    prog.final = true;
    await this.store.saveProgress(prog);
    this.onEvent('final', { round: task.round });
  }

  // ------------------------------------------------------------------------------------------------ uploads

  async stageUpload(prog: Progress, t: number, payload: Uint8Array, metrics: MetricRecord[], trainLoss: number | null,
    trainS: number | null): Promise<void> {
    await this.platform.storage.write('upload.bin', payload);
    prog.round = t;
    prog.posted = false;
    prog.digest = toHex(this.platform.sha256(payload));
    prog.train_loss = trainLoss;
    prog.train_s = trainS;
    prog.pending_metrics = [...metrics];
    await this.store.saveProgress(prog);
  }

  /** Sends the staged upload (`PUT` the blob, `POST` the update), then the metrics waiting for it. */
  async flushUpload(): Promise<void> {
    const prog = await this.store.progress();
    if (prog.posted) {
      await this.postPending(prog);
      return;
    }
    const payload = await this.platform.storage.read('upload.bin');
    if (payload === null || prog.digest === null) throw new Error('progress says an upload is pending but upload.bin is missing');
    await this.http.call('PUT', `/v1/blobs/${prog.digest}`, { body: payload });
    const stats = prog.stats[String(prog.round)];
    const upd: Record<string, unknown> = { digest: prog.digest, n_samples: this.data.train.n, bytes_down: stats?.bytes_down ?? 0 };
    if (prog.train_loss !== null && Number.isFinite(prog.train_loss)) upd['train_loss'] = prog.train_loss;
    if (prog.train_s !== null) upd['train_s'] = prog.train_s;
    try {
      const acc = parseUpdateAccepted(await this.http.postJson(`/v1/rounds/${prog.round}/updates`, upd));
      this.log('info', `round ${prog.round}: update ${acc.accepted ? 'accepted' : 'already accepted'} (${acc.updates} so far)`);
    } catch (e) {
      if (!(e instanceof HttpError) || (e.status !== 409 && e.status !== 422)) throw e;
      this.log(e.status === 422 ? 'error' : 'warn', `round ${prog.round} goes on without this device's update: ${e.message}`);
      this.onEvent(e.status === 422 ? 'update_refused' : 'round_closed', { round: prog.round });
      prog.posted = true;
      prog.abandoned = prog.round;
      prog.pending_metrics = [];
      await this.store.saveProgress(prog);
      return;
    }
    await this.store.appendLedger(prog.round, prog.digest, this.data.train.n);
    prog.posted = true;
    prog.bytes_up += payload.length;
    const st: RoundStats = prog.stats[String(prog.round)] ?? { bytes_up: 0, bytes_down: 0, train_s: null, step_ms: null };
    st.bytes_up = payload.length;
    prog.stats[String(prog.round)] = st;
    if (prog.round === 0) prog.initial_sent = true;
    await this.store.saveProgress(prog);
    this.onEvent('update', { round: prog.round, bytes_up: payload.length });
    await this.postPending(prog);
  }

  private async postPending(prog: Progress): Promise<void> {
    while (prog.pending_metrics.length) {
      await this.postMetrics(prog.pending_metrics[0]!, prog);
      prog.pending_metrics.shift();
      await this.store.saveProgress(prog);
    }
  }

  async postMetrics(m: MetricRecord, prog: Progress): Promise<void> {
    if (!Number.isFinite(m.accuracy) || !Number.isFinite(m.loss)) {
      this.log('error', `round ${m.round}: not reporting non-finite metrics`);
      return;
    }
    const st = prog.stats[String(m.round)];
    const report: Record<string, unknown> = { accuracy: m.accuracy, loss: m.loss, n_test: m.n_test, bytes_up: st?.bytes_up ?? 0,
      bytes_down: st?.bytes_down ?? 0 };
    if (st?.step_ms != null) report['step_ms'] = st.step_ms;
    if (st?.train_s != null) report['train_s'] = st.train_s;
    if (m.dropped !== undefined) report['dropped'] = m.dropped;
    try {
      await this.http.postJson(`/v1/rounds/${m.round}/metrics`, report);
    } catch (e) {
      if (!(e instanceof HttpError) || (e.status !== 409 && e.status !== 422)) throw e;
      this.log('warn', `round ${m.round}: metrics not taken: ${e.message}`);
      return;
    }
    this.log('info', `round ${m.round}: metrics posted (accuracy ${m.accuracy.toFixed(4)}, loss ${m.loss.toFixed(4)})`);
    this.onEvent('metrics', { ...report, round: m.round });
  }
}
