/**
 * The model card (docs/model.md, docs/schemas/ModelCard.json): the model as data, the training the federation
 * runs, and the programs a device downloads. `parseCard` checks what this device relies on and refuses anything
 * else with a `CardError` (a configuration error: the device stops, it does not retry).
 */
import { type TrainConfig, lrAt } from './sgd.js';

export class CardError extends Error {
  override name = 'CardError';
}

export const CARD_FORMAT = 'pfl-edge-model-card/1';
export const TRAINING_SIGNATURE = 'forward(x, y, weight, *params) -> (loss, *grads)';
const PROGRAM_FILE = /^[a-z0-9][a-z0-9._-]{0,199}\.(onnx|pte)$/;
const SHA256_HEX = /^[0-9a-f]{64}$/;

export interface CardTensor {
  name: string;
  shape: number[];
  block: string;
  kind: 'parameter' | 'buffer';
}

export interface Normalisation {
  statistics: 'fixed' | 'none' | 'own_data';
  scale: number;
  mean: number[];
  std: number[];
  std_floor: number | null;
}

export interface CardTraining {
  lr: number;
  lrDecay: number;
  momentum: number;
  weightDecay: number;
  clipNorm: number | null;
  clipUnmasked: boolean;
  batchSize: number;
  localEpochs: number;
  ftEpochs: number;
  maskSchedule: MaskSchedule | null;
  /** FedRep's head epochs per round (`training.fedrep`, protocol 2); null: not FedRep, or a server of version 1
   * (the device then reads `config.options.head_epochs`). */
  headEpochs: number | null;
  /** Ditto's personal model (`training.ditto`); null: not Ditto, or a card without it (then `config.options`). */
  ditto: { lam: number; personalEpochs: number } | null;
}

export interface MaskSchedule {
  alpha0: number;
  rounds: number;
  anneal: string;
  prune: string;
  regrow: 'gradient' | 'random';
}

export interface ProgramEntry {
  file: string;
  kind: 'inference' | 'training';
  runtime: string;
  mode: string | null;
  sha256: string;
  bytes: number;
  url: string;
  details: Record<string, unknown>;
}

export interface ModelCard {
  modelId: string;
  model: string;
  federation: string;
  profile: string;
  algorithm: string;
  numClasses: number;
  inputShape: number[];
  normalisation: Normalisation;
  tensors: CardTensor[];
  baseKeys: string[];
  personalKeys: string[];
  kp: number;
  density: number;
  training: CardTraining;
  programs: ProgramEntry[];
  /** the card as received */
  raw: Record<string, unknown>;
}

type Obj = Record<string, unknown>;

const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);

function need<T>(ok: boolean, what: string, v: unknown): T {
  if (!ok) throw new CardError(`the model card's ${what} is not valid: ${JSON.stringify(v)?.slice(0, 120)}`);
  return v as T;
}

const str = (o: Obj, k: string, where = ''): string => need<string>(typeof o[k] === 'string', where + k, o[k]);
const num = (o: Obj, k: string, where = ''): number =>
  need<number>(typeof o[k] === 'number' && Number.isFinite(o[k]), where + k, o[k]);
const int = (o: Obj, k: string, where = ''): number => need<number>(Number.isSafeInteger(o[k]), where + k, o[k]);
const numOrNull = (o: Obj, k: string, where = ''): number | null => (o[k] === null ? null : num(o, k, where));
const strList = (o: Obj, k: string, where = ''): string[] =>
  need<string[]>(Array.isArray(o[k]) && (o[k] as unknown[]).every((s) => typeof s === 'string'), where + k, o[k]);
const intList = (v: unknown, what: string): number[] =>
  need<number[]>(Array.isArray(v) && v.every((s) => Number.isSafeInteger(s) && (s as number) >= 0), what, v);
const obj = (o: Obj, k: string, where = ''): Obj => need<Obj>(isObj(o[k]), where + k, o[k]);

/** Parses and checks a model card (the JSON body of `GET /v1/federations/{fed}/model`). */
export function parseCard(body: unknown): ModelCard {
  if (!isObj(body)) throw new CardError('the model card is not a JSON object');
  if (body['format'] !== CARD_FORMAT) {
    throw new CardError(`the model card's format is ${JSON.stringify(body['format'])}, not '${CARD_FORMAT}': this device cannot read it`);
  }
  const input = obj(body, 'input');
  const norm = obj(input, 'normalisation', 'input.');
  const statistics = norm['statistics'];
  need(statistics === 'fixed' || statistics === 'none' || statistics === 'own_data', 'input.normalisation.statistics', statistics);
  const tensors = need<unknown[]>(Array.isArray(body['tensors']), 'tensors', body['tensors']).map((t, i) => {
    const o = need<Obj>(isObj(t), `tensors[${i}]`, t);
    const kind = o['kind'];
    need(kind === 'parameter' || kind === 'buffer', `tensors[${i}].kind`, kind);
    need(o['dtype'] === 'f32', `tensors[${i}].dtype`, o['dtype']);
    return { name: str(o, 'name'), shape: intList(o['shape'], `tensors[${i}].shape`), block: str(o, 'block'), kind } as CardTensor;
  });
  const names = new Set(tensors.map((t) => t.name));
  if (names.size !== tensors.length) throw new CardError('the model card names a tensor twice');
  const baseKeys = strList(body, 'base_keys');
  const personalKeys = strList(body, 'personal_keys');
  for (const k of [...baseKeys, ...personalKeys]) if (!names.has(k)) throw new CardError(`the model card's key ${k} is not one of its tensors`);
  const tr = obj(body, 'training');
  const sched = obj(tr, 'lr_schedule', 'training.');
  const ms = tr['mask_schedule'];
  let maskSchedule: MaskSchedule | null = null;
  if (ms !== null && ms !== undefined) {
    const m = need<Obj>(isObj(ms), 'training.mask_schedule', ms);
    const regrow = m['regrow'];
    need(regrow === 'gradient' || regrow === 'random', 'training.mask_schedule.regrow', regrow);
    maskSchedule = { alpha0: num(m, 'alpha0'), rounds: int(m, 'rounds'), anneal: str(m, 'anneal'), prune: str(m, 'prune'),
      regrow: regrow as 'gradient' | 'random' };
  }
  if (tr['optimiser'] !== 'sgd') throw new CardError(`the card's optimiser is ${JSON.stringify(tr['optimiser'])}; this device runs sgd`);
  if (tr['loss'] !== 'cross_entropy') throw new CardError(`the card's loss is ${JSON.stringify(tr['loss'])}; this device's programs compute cross_entropy`);
  if ((tr['nesterov'] ?? false) !== false || (tr['dampening'] ?? 0) !== 0) throw new CardError('the card asks for Nesterov momentum or dampening, which this device does not run');
  const training: CardTraining = {
    lr: num(tr, 'lr', 'training.'),
    lrDecay: num(sched, 'lr_decay', 'training.lr_schedule.'),
    momentum: num(tr, 'momentum', 'training.'),
    weightDecay: num(tr, 'weight_decay', 'training.'),
    clipNorm: numOrNull(tr, 'clip_norm', 'training.'),
    clipUnmasked: need<boolean>(typeof tr['clip_unmasked'] === 'boolean', 'training.clip_unmasked', tr['clip_unmasked']),
    batchSize: int(tr, 'batch_size', 'training.'),
    localEpochs: int(tr, 'local_epochs', 'training.'),
    ftEpochs: int(tr, 'ft_epochs', 'training.'),
    maskSchedule,
    headEpochs: null,
    ditto: null,
  };
  const fr = tr['fedrep'];
  if (fr !== null && fr !== undefined) {
    training.headEpochs = int(need<Obj>(isObj(fr), 'training.fedrep', fr), 'head_epochs', 'training.fedrep.');
  }
  const dt = tr['ditto'];
  if (dt !== null && dt !== undefined) {
    const d = need<Obj>(isObj(dt), 'training.ditto', dt);
    training.ditto = { lam: num(d, 'lam', 'training.ditto.'), personalEpochs: int(d, 'personal_epochs', 'training.ditto.') };
  }
  const programs = need<unknown[]>(Array.isArray(body['programs']), 'programs', body['programs']).map((p, i) => {
    const o = need<Obj>(isObj(p), `programs[${i}]`, p);
    const file = str(o, 'file', `programs[${i}].`);
    if (!PROGRAM_FILE.test(file)) throw new CardError(`the model card lists a program file that is not a plain name: ${JSON.stringify(file)}`);
    const kind = o['kind'];
    need(kind === 'inference' || kind === 'training', `programs[${i}].kind`, kind);
    const sha = str(o, 'sha256', `programs[${i}].`);
    need(SHA256_HEX.test(sha), `programs[${i}].sha256`, sha);
    const bytes = int(o, 'bytes', `programs[${i}].`);
    need(bytes >= 0, `programs[${i}].bytes`, bytes);
    return {
      file, kind, runtime: str(o, 'runtime', `programs[${i}].`), mode: o['mode'] === null ? null : str(o, 'mode', `programs[${i}].`),
      sha256: sha, bytes, url: str(o, 'url', `programs[${i}].`), details: obj(o, 'details', `programs[${i}].`),
    } as ProgramEntry;
  });
  const density = num(body, 'density');
  need(density > 0 && density <= 1, 'density', density);
  return {
    modelId: str(body, 'model_id'),
    model: str(body, 'model'),
    federation: str(body, 'federation'),
    profile: str(body, 'profile'),
    algorithm: str(body, 'algorithm'),
    numClasses: int(body, 'num_classes'),
    inputShape: intList(input['shape'], 'input.shape'),
    normalisation: {
      statistics: statistics as Normalisation['statistics'],
      scale: num(norm, 'scale'),
      mean: need<number[]>(Array.isArray(norm['mean']), 'input.normalisation.mean', norm['mean']),
      std: need<number[]>(Array.isArray(norm['std']), 'input.normalisation.std', norm['std']),
      std_floor: norm['std_floor'] === null || norm['std_floor'] === undefined ? null : num(norm, 'std_floor'),
    },
    tensors,
    baseKeys,
    personalKeys,
    kp: int(body, 'kp'),
    density,
    training,
    programs,
    raw: body,
  };
}

/** The program of `kind` (and training `mode`) for `runtime`; a CardError if the card lists none. */
export function findProgram(card: ModelCard, kind: 'inference' | 'training', runtime: string, mode: string | null = null): ProgramEntry {
  const p = card.programs.find((e) => e.kind === kind && e.runtime === runtime && (kind === 'inference' || e.mode === mode));
  if (p === undefined) {
    throw new CardError(`the model card lists no ${runtime} ${kind} program${mode ? ` of mode ${mode}` : ''} ` +
      `(it lists ${card.programs.map((e) => e.file).join(', ') || 'none'})`);
  }
  return p;
}

/** The interface a training program's `details` state (checked against the card's tensors). */
export interface TrainingDetails {
  batchSize: number;
  inputs: string[];
  outputs: string[];
  keys: string[];
  trainable: string[];
  frozen: string[];
  shapes: Map<string, number[]>;
  inputShape: number[];
}

export function trainingDetails(card: ModelCard, p: ProgramEntry): TrainingDetails {
  const d = p.details;
  const where = `programs[${p.file}].details.`;
  if (d['kind'] !== 'training') throw new CardError(`${p.file} is not a training program`);
  if (d['signature'] !== TRAINING_SIGNATURE) {
    throw new CardError(`${p.file}'s signature is ${JSON.stringify(d['signature'])}, not the gradient program this device drives`);
  }
  const shapesObj = obj(d, 'shapes', where);
  const keys = strList(d, 'keys', where);
  const det: TrainingDetails = {
    batchSize: int(d, 'batch_size', where),
    inputs: strList(d, 'inputs', where),
    outputs: strList(d, 'outputs', where),
    keys,
    trainable: strList(d, 'trainable', where),
    frozen: strList(d, 'frozen', where),
    shapes: new Map(keys.map((k) => [k, intList(shapesObj[k], `${where}shapes.${k}`)])),
    inputShape: intList(d['input_shape'], `${where}input_shape`),
  };
  const expectInputs = ['x', 'y', 'weight', ...keys];
  if (det.inputs.join('\n') !== expectInputs.join('\n')) throw new CardError(`${p.file}'s inputs are not x, y, weight and its keys`);
  if (det.outputs.join('\n') !== ['loss', ...det.trainable.map((k) => `grad:${k}`)].join('\n')) {
    throw new CardError(`${p.file}'s outputs are not loss and grad:<key> of its trainable keys`);
  }
  const params = new Map(card.tensors.filter((t) => t.kind === 'parameter').map((t) => [t.name, t.shape]));
  for (const k of keys) {
    const s = params.get(k);
    if (s === undefined || s.join(',') !== det.shapes.get(k)!.join(',')) {
      throw new CardError(`${p.file}'s weight ${k} is not one of the card's parameters with that shape`);
    }
  }
  if (det.inputShape.join(',') !== card.inputShape.join(',')) throw new CardError(`${p.file}'s input shape is not the card's`);
  return det;
}

/** `train_config(t, epochs)`: local SGD of round `t` (1-based; round 0 uses round 1's lr). */
export function trainConfig(card: ModelCard, t: number, epochs?: number): TrainConfig {
  const tr = card.training;
  return {
    epochs: epochs ?? tr.localEpochs,
    batchSize: tr.batchSize,
    lr: lrAt(tr.lr, tr.lrDecay, t),
    momentum: tr.momentum,
    weightDecay: tr.weightDecay,
    clipNorm: tr.clipNorm,
    clipUnmasked: tr.clipUnmasked,
  };
}

/** docs/protocol.md, "The model id": `<model>/<num_classes>/<in_channels>x<image_size>/<base><linear_kp>`. */
export function modelIdOf(config: Record<string, unknown>, dataset: { numClasses: number; channels: number; size: number }): string {
  const base = config['base'] ?? 'deep';
  const kp = base === 'linear' ? Number(config['kp'] ?? 0) : 0;
  return `${String(config['model'] ?? 'cnn')}/${dataset.numClasses}/${dataset.channels}x${dataset.size}/${String(base)}${kp}`;
}

/** The registered data sets' shapes (docs/protocol.md, "The model id"). */
export const DATASET_SHAPES: Record<string, { numClasses: number; channels: number; size: number }> = {
  'fashion-mnist': { numClasses: 10, channels: 1, size: 28 },
  synthetic: { numClasses: 10, channels: 1, size: 28 },
  cifar10: { numClasses: 10, channels: 3, size: 32 },
};
