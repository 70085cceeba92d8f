/** The Node platform of a device: files, mqtt.js, onnxruntime-node, Fashion-MNIST from Debian's IDX files. */
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';

import mqtt from 'mqtt';

import { type ModelCard, CardError, findProgram, trainingDetails } from '../card.js';
import { slotSamples } from '../data.js';
import type { DeviceData, LogLevel, Platform } from '../device.js';
import type { MqttConnect } from '../mqtt.js';
import { deal } from '../partition.js';
import { nodeSha256 } from '../node.js';
import { DirStorage } from './fs.js';
import { loadFashionMnist } from './idx.js';
import { openInference, openTraining } from './ort.js';

export interface NodePlatformOptions {
  stateDir: string;
  /** where the data set's files are (default: Debian's) */
  datasetDir?: string | null;
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

/** Its slot's training and test samples: the data set dealt as pfl-edge deals it, normalised as the card says. */
export async function loadSlotData(config: Record<string, unknown>, slot: number, card: ModelCard, datasetDir?: string | null): Promise<DeviceData> {
  const dataset = String(config['dataset']);
  const partition = String(config['partition']);
  if (partition === 'device') throw new CardError('this federation\'s devices bring their own data (partition "device"); this device deals a registered data set only');
  if (dataset !== 'fashion-mnist') throw new CardError(`this device reads the fashion-mnist data set, not ${dataset}`);
  const norm = card.normalisation;
  if (norm.statistics !== 'fixed') throw new CardError(`the card's normalisation is ${norm.statistics}, not fixed`);
  const raw = loadFashionMnist(datasetDir ?? (typeof config['data_dir'] === 'string' ? config['data_dir'] : null));
  const seed = config['seed'];
  if (typeof seed !== 'number' || !Number.isSafeInteger(seed)) throw new CardError(`the federation's seed ${String(seed)} cannot be held exactly`);
  const num = (k: string): number | null => (typeof config[k] === 'number' ? (config[k] as number) : null);
  const shares = deal(nodeSha256, raw.train.y, raw.test.y, raw.numClasses, {
    partition, clients: Number(config['clients']), seed, samplesPerClient: num('samples_per_client'), testPerClient: num('test_per_client'),
  });
  const share = shares[slot];
  if (share === undefined) throw new CardError(`slot ${slot} is out of range for ${shares.length} partitions`);
  const sampleSize = raw.channels * raw.size * raw.size;
  return slotSamples(raw.train, raw.test, share, raw.channels, sampleSize, norm.mean, norm.std);
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
    loadData: async (config, slot, card) => loadSlotData(config, slot, card, o.datasetDir),
    log: logger(o.verbose ?? false, o.name),
    mqttExtra: ca ? { ca: [ca], rejectUnauthorized: true } : undefined,
  };
}
