/**
 * The `synthetic` data set (src/synthetic.ts) against pfl-edge's own (test/fixtures/synthetic.json, written by
 * test/fixtures/make_synthetic_fixtures.py from `pfl_edge.data.synthetic.make_synthetic` and
 * `pfl_edge.federation.deal_arrays`): the prototypes, both splits' inputs and labels bit for bit, and every slot of
 * two synthetic federations as the Node platform loads them (`loadSlotData`, normalisation `none`), with the checks
 * it makes of the card. Needs no data files.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { CardError, parseCard } from '../src/card.js';
import { NUM_RATINGS } from '../src/partition.js';
import { nodeSha256 } from '../src/node.js';
import { toHex } from '../src/sha256.js';
import { SYNTHETIC_SIZES, makeSynthetic } from '../src/synthetic.js';
import { loadSlotData, syntheticDataset } from '../src/nodejs/platform.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const fix = JSON.parse(readFileSync(FIX + 'synthetic.json', 'utf8'));
const cardJson = JSON.parse(readFileSync(FIX + 'card.json', 'utf8'));

// the digests are of little-endian bytes; typed arrays hold the platform's order
const littleEndian = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const sha = (a: Float32Array | Float64Array | Int32Array): string => {
  assert.ok(littleEndian, 'this test reads typed arrays as little-endian bytes');
  return toHex(nodeSha256(new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));
};
const bits = (a: Float32Array): number[] => [...new Uint32Array(a.buffer, a.byteOffset, a.length)];

/** The captured card with pfl-edge's normalisation of the synthetic set (`modelcard.dataset_normalisation`). */
const cardWith = (normalisation: Record<string, unknown>, numClasses = 10) =>
  parseCard({ ...cardJson, num_classes: numClasses, input: { ...cardJson.input, normalisation } });
const NONE = { statistics: 'none', scale: 1.0, mean: [0.0], std: [1.0], std_floor: null, description: 'generated already as model inputs (no pixels)' };
const synthCard = cardWith(NONE);

interface SplitFix { n: number; x_sha256: string; y_sha256: string; x_head_u32: number[]; x_head: number[]; x_tail_u32: number[]; y_head: number[] }

function checkSplit(x: Float32Array, y: Int32Array, want: SplitFix, what: string): void {
  assert.equal(y.length, want.n, `${what}: n`);
  assert.equal(x.length, want.n * 784, `${what}: inputs`);
  assert.deepEqual(bits(x.subarray(0, 5)), want.x_head_u32, `${what}: first inputs' bits`);
  assert.deepEqual([...x.subarray(0, 5)], want.x_head, `${what}: first inputs`);
  assert.deepEqual(bits(x.subarray(x.length - 3)), want.x_tail_u32, `${what}: last inputs' bits`);
  assert.deepEqual([...y.subarray(0, 10)], want.y_head, `${what}: first labels`);
  assert.equal(sha(y), want.y_sha256, `${what}: labels`);
  assert.equal(sha(x), want.x_sha256, `${what}: inputs`);
}

test('the synthetic data set equals pfl-edge\'s bit for bit', () => {
  const d = makeSynthetic();
  assert.equal(fix.seed, 20261129);
  assert.deepEqual([d.numClasses, d.channels, d.size], [10, 1, 28]);
  assert.deepEqual([d.train.n, d.test.n], [...SYNTHETIC_SIZES]);
  assert.equal(d.prototypes.length, 10 * 28 * 28);
  assert.deepEqual([...d.prototypes.subarray(0, 5)], fix.prototypes.head);
  assert.equal(sha(d.prototypes), fix.prototypes.sha256, 'prototypes (float64)');
  checkSplit(d.train.x, d.train.y, fix.train, 'train');
  checkSplit(d.test.x, d.test.y, fix.test, 'test');
  // every class equally often in each split
  for (const s of [d.train, d.test]) {
    const counts = new Array<number>(10).fill(0);
    for (const v of s.y) counts[v]! += 1;
    assert.deepEqual(counts, new Array<number>(10).fill(s.n / 10));
  }
});

test('the platform makes the synthetic set once per process', () => {
  assert.equal(syntheticDataset(), syntheticDataset());
});

test('every slot of a synthetic federation loads as pfl-edge\'s deal_arrays gives it', async () => {
  assert.ok(fix.slots.length >= 9);
  for (const s of fix.slots) {
    const what = `${JSON.stringify(s.config)} slot ${s.slot}`;
    assert.equal(s.num_classes, 10);
    const data = await loadSlotData(s.config, s.slot, synthCard);
    assert.equal(data.train.sampleSize, 784);
    assert.equal(data.train.n, s.train.n);
    assert.equal(data.test.n, s.test.n);
    checkSplit(data.train.x, data.train.y, s.train, `${what} train`);
    checkSplit(data.test.x, data.test.y, s.test, `${what} test`);
  }
  // the process's copy is not changed by loading slots from it
  const d = syntheticDataset();
  assert.equal(sha(d.train.x), fix.train.x_sha256);
  assert.equal(sha(d.test.x), fix.test.x_sha256);
});

test('a synthetic federation needs a card of normalisation none, as it is', async () => {
  const config = { ...fix.slots[0].config };
  const refused = (re: RegExp) => (e: unknown) => e instanceof CardError && re.test(e.message);
  const fixed = parseCard(cardJson); // Fashion-MNIST's card: fixed mean and std
  await assert.rejects(loadSlotData(config, 0, fixed), refused(/normalisation is fixed, not none/));
  await assert.rejects(loadSlotData({ ...config, dataset: 'fashion-mnist' }, 0, synthCard), refused(/normalisation is none, not fixed/));
  await assert.rejects(loadSlotData(config, 0, cardWith({ ...NONE, mean: [0.5] })), refused(/none but gives/));
  await assert.rejects(loadSlotData(config, 0, cardWith({ ...NONE, std: [2] })), refused(/none but gives/));
  await assert.rejects(loadSlotData(config, 0, cardWith({ ...NONE, scale: 1 / 255 })), refused(/none but gives/));
  await assert.rejects(loadSlotData({ ...config, dataset: 'cifar10' }, 0, synthCard), refused(/fashion-mnist and synthetic data sets, not cifar10/));
  await assert.rejects(loadSlotData({ ...config, dataset: 'toString' }, 0, synthCard), refused(/not toString/));
  await assert.rejects(loadSlotData(config, 4, synthCard), refused(/slot 4 is out of range/));
});

test('the deal\'s class count must be the card\'s (synthetic)', async () => {
  const config = { dataset: 'synthetic', partition: 'preference:0.3', clients: 6, seed: 5, samples_per_client: 50, test_per_client: 20 };
  const refused = (re: RegExp) => (e: unknown) => e instanceof CardError && re.test(e.message);
  await assert.rejects(loadSlotData(config, 0, synthCard), refused(/5 classes/));
  await assert.rejects(loadSlotData({ ...config, partition: 'iid' }, 0, cardWith(NONE, NUM_RATINGS)), refused(/10 classes/));
  const data = await loadSlotData(config, 2, cardWith(NONE, NUM_RATINGS));
  assert.equal(data.train.n, 50);
  assert.equal(data.test.n, 20);
  assert.ok(data.train.y.every((y) => y < NUM_RATINGS) && data.test.y.every((y) => y < NUM_RATINGS));
});
