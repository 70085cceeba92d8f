/**
 * The Node platform of a device: files, mqtt.js, onnxruntime-node, Fashion-MNIST from Debian's IDX files or the
 * `synthetic` data set (made in memory, src/synthetic.ts), or the device's own images from a folder (`--data-dir`).
 */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { availableParallelism, release, type } from 'node:os';

import mqtt from 'mqtt';

import { type ModelCard, CardError, findProgram, trainingDetails } from '../card.js';
import { slotInputs, slotSamples } from '../data.js';
import type { DeviceData, LogLevel, Platform } from '../device.js';
import type { PlatformInfo } from '../enrol.js';
import type { MqttConnect } from '../mqtt.js';
import { DEALT_PARTITIONS, type SlotShare, deal, dealtClasses } from '../partition.js';
import { nodeSha256 } from '../node.js';
import { type ShareSource, parseShare, shareBound } from '../share.js';
import { type SyntheticSet, makeSynthetic } from '../synthetic.js';
import { DirStorage } from './fs.js';
import { type RawDataset, loadFashionMnist } from './idx.js';
import { loadImageFolder } from './images.js';
import { openInference, openTraining, ortVersion } from './ort.js';

export interface NodePlatformOptions {
  stateDir: string;
  /** where the data set's files are (default: Debian's) */
  datasetDir?: string | null;
  /**
   * the device's own labelled images instead, one sub-folder per class (`pfl-edge client --data-dir`): used
   * whatever the federation's partition, as the Python device does; needed where it is `"device"`
   */
  imageDir?: string | null;
  /** the CA of the server's and broker's certificates (mqtts://) */
  caFile?: string | null;
  verbose?: boolean;
  /** a prefix for log lines */
  name?: string;
}

export function logger(verbose: boolean, name = ''): (level: LogLevel, msg: string) => void {
  return (level, msg) => {
    if (level === 'debug' && !verbose) return;
    const at = new Date().toISOString();
    console.error(`${at} ${level.toUpperCase().padEnd(5)} ${name ? name + ': ' : ''}${msg}`);
  };
}

/**
 * The device's own images in `imageDir` as its training and test samples (`edge_runtime/data.py::load_image_folder`):
 * converted and resized to the card's `input.shape`, standardised over the folder (`input.own_images`), a fifth
 * of each class held out by the `holdout` stream of its slot.
 */
export function loadOwnImages(config: Record<string, unknown>, slot: number, card: ModelCard, imageDir: string): DeviceData {
  const seed = config['seed'];
  if (typeof seed !== 'number' || !Number.isSafeInteger(seed)) throw new CardError(`the federation's seed ${String(seed)} cannot be held exactly`);
  const [channels, height, width] = card.inputShape;
  if (card.inputShape.length !== 3 || (channels !== 1 && channels !== 3)) {
    throw new CardError(`the card's input shape [${card.inputShape.join(', ')}] is not grey or RGB images`);
  }
  const own = (card.raw['input'] as Record<string, unknown> | undefined)?.['own_images'] as Record<string, unknown> | undefined;
  const floor = typeof own?.['std_floor'] === 'number' ? own['std_floor'] : 1e-6;
  const d = loadImageFolder(imageDir, {
    channels, height: height!, width: width!, numClasses: card.numClasses, sha256: nodeSha256, seed, slot, stdFloor: floor,
  });
  return { train: d.train, test: d.test };
}

/** The data sets a dealt federation may name, and the card's normalisation each needs. */
const DATASET_STATISTICS: Record<string, 'fixed' | 'none'> = { 'fashion-mnist': 'fixed', synthetic: 'none' };

let syntheticCache: SyntheticSet | null = null;

/** The `synthetic` data set, made once per process (the same in every federation; about 25 MB). */
export function syntheticDataset(): SyntheticSet {
  syntheticCache ??= makeSynthetic();
  return syntheticCache;
}

/**
 * Its slot's training and test samples: its own images where it has a folder of them (`imageDir`), else the
 * data set dealt as pfl-edge deals it: Fashion-MNIST's pixels normalised as the card says (`fixed`), or the
 * `synthetic` set's inputs as they are (`none`). A partition of `DEALT_PARTITIONS` it deals itself; any other
 * (the Dirichlet splits) it takes from the server's share (`share`, `GET /v1/devices/me/share`, checked by
 * `parseShare`), then gathers and normalises the samples exactly as for a share it dealt.
 */
export async function loadSlotData(config: Record<string, unknown>, slot: number, card: ModelCard, datasetDir?: string | null,
  imageDir?: string | null, share?: ShareSource | null): Promise<DeviceData> {
  if (imageDir) return loadOwnImages(config, slot, card, imageDir);
  const dataset = String(config['dataset']);
  const partition = String(config['partition']);
  if (partition === 'device') {
    throw new CardError('this federation\'s devices bring their own data (partition "device"): start the device with ' +
      '--data-dir FOLDER, one sub-folder of images per class');
  }
  const want = Object.hasOwn(DATASET_STATISTICS, dataset) ? DATASET_STATISTICS[dataset] : undefined;
  if (want === undefined) {
    throw new CardError(`this device reads the ${Object.keys(DATASET_STATISTICS).join(' and ')} data sets, not ${dataset}`);
  }
  const norm = card.normalisation;
  if (norm.statistics !== want) throw new CardError(`the card's normalisation is ${norm.statistics}, not ${want} (the ${dataset} data set's)`);
  if (want === 'none') checkIdentity(norm);
  // synthetic: model inputs already (made here, no files); fashion-mnist: 8-bit pixels, normalised below
  const inputs = dataset === 'synthetic' ? syntheticDataset() : null;
  const raw = inputs ?? loadFashionMnist(datasetDir ?? (typeof config['data_dir'] === 'string' ? config['data_dir'] : null));
  // the model learns the deal's labels: a preference federation's are the slot's ratings, not the data set's classes
  const classes = dealtClasses(partition, raw.numClasses);
  if (classes !== card.numClasses) {
    throw new CardError(`partition '${partition}' of ${dataset} gives labels of ${classes} classes, but the card's model predicts ${card.numClasses}`);
  }
  let mine: SlotShare;
  if (DEALT_PARTITIONS.includes(partition.split(':')[0]!) || !share) {
    // dealt here (a partition it cannot deal and no server to ask: `deal` refuses it with a DealError)
    const seed = config['seed'];
    if (typeof seed !== 'number' || !Number.isSafeInteger(seed)) throw new CardError(`the federation's seed ${String(seed)} cannot be held exactly`);
    const num = (k: string): number | null => (typeof config[k] === 'number' ? (config[k] as number) : null);
    const shares = deal(nodeSha256, raw.train.y, raw.test.y, raw.numClasses, {
      partition, clients: Number(config['clients']), seed, samplesPerClient: num('samples_per_client'), testPerClient: num('test_per_client'),
      testDraw: typeof config['test_draw'] === 'string' ? config['test_draw'] : null,
    });
    const dealt = shares[slot];
    if (dealt === undefined) throw new CardError(`slot ${slot} is out of range for ${shares.length} partitions`);
    mine = dealt;
  } else {
    // the server's deal of a partition it does not deal (numpy's gamma draws): its share, read as hostile
    const body = await share.fetch(shareBound(raw.train.y.length, raw.test.y.length));
    mine = parseShare(body, {
      federation: share.federation, slot, dataset, partition, numClasses: card.numClasses, datasetClasses: raw.numClasses,
      trainY: raw.train.y, testY: raw.test.y,
    });
  }
  const sampleSize = raw.channels * raw.size * raw.size;
  if (inputs !== null) return slotInputs(inputs.train, inputs.test, mine, sampleSize);
  const pixels = raw as RawDataset;
  return slotSamples(pixels.train, pixels.test, mine, pixels.channels, sampleSize, norm.mean, norm.std);
}

/** `statistics: "none"` (docs/model.md): the samples already are model inputs, so scale 1, mean 0 and std 1; a card
 * that says otherwise contradicts itself and is refused rather than read one way or the other. */
function checkIdentity(norm: ModelCard['normalisation']): void {
  const ok = norm.scale === 1 && norm.mean.every((m) => m === 0) && norm.std.every((s) => s === 1);
  if (!ok) {
    throw new CardError(`the card's normalisation is none but gives scale ${norm.scale}, mean [${norm.mean.join(', ')}], ` +
      `std [${norm.std.join(', ')}] (none means 1, 0, 1: the samples are used as they are)`);
  }
}

/** This machine as the protocol's Platform: Node's names for the architecture, the OS, onnxruntime-node's version. */
export function describeNode(threads: number): PlatformInfo {
  const label = (s: string): string => s.replace(/[^\x20-\x7e]/g, '?').trim().slice(0, 64) || 'unknown';
  return {
    machine: process.arch.replace(/[^A-Za-z0-9_.+-]/g, '').slice(0, 32) || 'unknown',
    os: label(`${type()} ${release()}`),
    language: label(`node ${process.versions.node}`),
    runtime: label(`onnxruntime-node ${ortVersion()}`),
    threads: Math.max(1, Math.min(1024, Math.floor(threads))),
    cpus: Math.max(1, Math.min(4096, availableParallelism())),
  };
}

export function nodePlatform(o: NodePlatformOptions): Platform {
  const ca = o.caFile ? readFileSync(o.caFile) : null;
  return {
    sha256: nodeSha256,
    random: (n) => new Uint8Array(randomBytes(n)),
    storage: new DirStorage(o.stateDir),
    mqttConnect: ((url, opts) => mqtt.connect(url, opts)) as MqttConnect,
    openTraining: async (bytes, card, mode, threads) =>
      openTraining(bytes, trainingDetails(card, findProgram(card, 'training', 'onnxruntime', mode)), threads),
    openInference: async (bytes, card, threads) => openInference(bytes, card, findProgram(card, 'inference', 'onnxruntime'), threads),
    loadData: async (config, slot, card, share) => loadSlotData(config, slot, card, o.datasetDir, o.imageDir, share),
    log: logger(o.verbose ?? false, o.name),
    describe: describeNode,
    mqttExtra: ca ? { ca: [ca], rejectUnauthorized: true } : undefined,
  };
}
