/**
 * A slot's data as the Node platform loads it for a dealt federation (src/nodejs/platform.ts `loadSlotData`): the
 * samples and labels of its share of the deal, and for `preference` the slot's ratings, which only a card whose
 * model predicts `NUM_RATINGS` classes may train on (when Debian's Fashion-MNIST files are here).
 */
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { CardError, parseCard } from '../src/card.js';
import { NUM_RATINGS, deal } from '../src/partition.js';
import { nodeSha256 } from '../src/node.js';
import { FASHION_MNIST_DIRS, fashionMnistLabels } from '../src/nodejs/idx.js';
import { loadSlotData } from '../src/nodejs/platform.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const card10 = parseCard(JSON.parse(readFileSync(FIX + 'card.json', 'utf8')));
const card5 = { ...card10, numClasses: NUM_RATINGS };
const haveFmnist = existsSync(FASHION_MNIST_DIRS[0] + '/train-labels-idx1-ubyte.gz');
const skip = haveFmnist ? false : 'no Fashion-MNIST here';

const config = (partition: string): Record<string, unknown> => ({
  dataset: 'fashion-mnist', partition, clients: 7, seed: 3, samples_per_client: 60, test_per_client: 20,
});

test('a preference slot trains on its ratings with a 5-class model', { skip }, async () => {
  const labels = fashionMnistLabels();
  const share = deal(nodeSha256, labels.train, labels.test, 10, {
    partition: 'preference:0.3', clients: 7, seed: 3, samplesPerClient: 60, testPerClient: 20,
  })[4]!;
  const data = await loadSlotData(config('preference:0.3'), 4, card5);
  assert.equal(data.train.n, 60);
  assert.deepEqual([...data.train.y], [...share.trainY]);
  assert.deepEqual([...data.test.y], [...share.testY]);
  assert.deepEqual([...data.train.y], [...share.trainIdx].map((i) => share.labelMap![labels.train[i]!]!));
  assert.ok(data.train.y.every((y) => y < NUM_RATINGS) && data.test.y.every((y) => y < NUM_RATINGS));
});

test('the deal\'s class count must be the card\'s', { skip }, async () => {
  await assert.rejects(loadSlotData(config('preference'), 0, card10), (e: unknown) => e instanceof CardError && /5 classes/.test(e.message));
  await assert.rejects(loadSlotData(config('iid'), 0, card5), (e: unknown) => e instanceof CardError && /10 classes/.test(e.message));
  const data = await loadSlotData(config('iid'), 0, card10);
  assert.ok(data.train.y.some((y) => y >= NUM_RATINGS));
});
