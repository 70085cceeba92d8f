/**
 * The federation's random streams and the deal against pfl-edge's own draws (test/fixtures/*.json, written by
 * test/fixtures/make_fixtures.py from numpy and torch): derive_seed, torch's MT19937 randperm/rand, numpy's PCG64
 * (SeedSequence seeding, raw draws, permutation, choice without replacement on both of its paths, integers,
 * random), and the deal of Fashion-MNIST (when Debian's files are here); `preference` also on synthetic labels
 * (whole deals, each slot's label map, and how P is read: the same maps or pfl-edge's error text).
 */
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { DealError, NUM_RATINGS, type SlotShare, deal, dealtClasses } from '../src/partition.js';
import { MT19937, NumpyGenerator, PCG64, deriveSeed } from '../src/rng.js';
import { nodeSha256 } from '../src/node.js';
import { toHex } from '../src/sha256.js';
import { fashionMnistLabels, FASHION_MNIST_DIRS } from '../src/nodejs/idx.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const rng = JSON.parse(readFileSync(FIX + 'rng.json', 'utf8'));
const deals = JSON.parse(readFileSync(FIX + 'deal.json', 'utf8'));

const digest = (a: ArrayLike<number>): string => {
  const b = new BigInt64Array(a.length);
  for (let i = 0; i < a.length; i++) b[i] = BigInt(a[i]!);
  return toHex(nodeSha256(new Uint8Array(b.buffer)));
};

test('derive_seed', () => {
  for (const d of rng.derive) {
    assert.equal(deriveSeed(nodeSha256, BigInt(d.seed), d.label, ...d.index).toString(), d.value);
  }
});

test('numpy PCG64 and Generator draws', () => {
  for (const r of rng.pcg) {
    const bits = new PCG64(BigInt(r.seed));
    assert.deepEqual(Array.from({ length: 6 }, () => bits.nextU64().toString()), r.raw64, `raw ${r.seed}`);
    const g = new NumpyGenerator(BigInt(r.seed));
    assert.deepEqual([...g.permutation(10)], r.perm10, `perm10 ${r.seed}`);
    assert.equal(digest(g.permutation(1000)), r.perm1000);
    assert.deepEqual([...g.permutation([3, 1, 4, 1, 5, 9, 2, 6])], r.perm_arr);
    assert.equal(digest(g.choiceNoReplace(Array.from({ length: 12000 }, (_, i) => 3 * i), 300)), r.choice_tail, `tail ${r.seed}`);
    assert.deepEqual([...g.choiceNoReplace(Array.from({ length: 500 }, (_, i) => 1000 + i), 20)], r.choice_floyd, `floyd ${r.seed}`);
    assert.equal(digest(g.choiceNoReplace(Array.from({ length: 20000 }, (_, i) => i), 100)), r.choice_floyd_big);
    assert.deepEqual([...g.integers(7, 25)], r.integers, `integers ${r.seed}`);
    assert.deepEqual([...g.random(5)], r.random);
    assert.deepEqual([...g.permutation(17)], r.perm_after);
  }
});

test("torch's MT19937: randperm and rand", () => {
  for (const m of rng.mt) {
    const g = new MT19937(BigInt(m.seed));
    assert.deepEqual([...g.randperm(10)], m.perm10);
    assert.equal(digest(g.randperm(300)), m.perm300);
    assert.deepEqual([...new Uint32Array(g.rand(5).buffer)], m.rand_bits);
  }
});

const haveFmnist = existsSync(FASHION_MNIST_DIRS[0] + '/train-labels-idx1-ubyte.gz');

interface DealCase {
  partition: string;
  clients: number;
  seed: number;
  samples_per_client: number | null;
  test_per_client: number | null;
  test_draw: string | null;
  num_classes: number;
  label_maps: number[][] | null;
  train: { n: number; idx: string; y: string }[];
  test: { n: number; idx: string; y: string }[];
}

/** Deals case `c` of labels `train`/`test` (10 classes) and holds every slot to pfl-edge's deal. */
function checkDeal(c: DealCase, train: ArrayLike<number>, test: ArrayLike<number>): SlotShare[] {
  const shares = deal(nodeSha256, train, test, 10, {
    partition: c.partition, clients: c.clients, seed: c.seed, samplesPerClient: c.samples_per_client,
    testPerClient: c.test_per_client, testDraw: c.test_draw,
  });
  const what0 = `${c.partition} clients ${c.clients} seed ${c.seed}`;
  assert.equal(shares.length, c.clients, what0);
  assert.equal(dealtClasses(c.partition, 10), c.num_classes, what0 + ' num_classes');
  shares.forEach((s, i) => {
    const what = `${what0} slot ${i}`;
    assert.equal(s.trainIdx.length, c.train[i]!.n, what);
    assert.equal(s.testIdx.length, c.test[i]!.n, what);
    assert.equal(digest(s.trainIdx), c.train[i]!.idx, what + ' train idx');
    assert.equal(digest(s.trainY), c.train[i]!.y, what + ' train y');
    assert.equal(digest(s.testIdx), c.test[i]!.idx, what + ' test idx');
    assert.equal(digest(s.testY), c.test[i]!.y, what + ' test y');
    assert.deepEqual(s.labelMap === null ? null : [...s.labelMap], c.label_maps === null ? null : c.label_maps[i], what + ' label map');
    // the labels are the map's image of the data set's classes, all below the model's class count
    const map = s.labelMap;
    s.trainIdx.forEach((j, k) => assert.equal(s.trainY[k], map === null ? train[j] : map[train[j]!], what));
    s.testIdx.forEach((j, k) => assert.equal(s.testY[k], map === null ? test[j] : map[test[j]!], what));
    assert.ok(s.trainY.every((y) => y >= 0 && y < c.num_classes) && s.testY.every((y) => y >= 0 && y < c.num_classes), what);
  });
  return shares;
}

test('the deal of Fashion-MNIST equals pfl-edge\'s', { skip: haveFmnist ? false : 'no Fashion-MNIST here' }, () => {
  const labels = fashionMnistLabels();
  assert.ok(deals.cases.some((c: DealCase) => c.partition.startsWith('preference')));
  for (const c of deals.cases) checkDeal(c, labels.train, labels.test);
});

const synth = deals.synthetic;
/** make_fixtures.py's synthetic_labels: (7i + (i^2 + salt) mod 11) mod 10 */
const synthLabels = (n: number, salt: number): Int32Array => Int32Array.from({ length: n }, (_, i) => (7 * i + ((i * i + salt) % 11)) % 10);

test('preference on synthetic labels equals pfl-edge\'s deal: indices, ratings, label maps', () => {
  const train = synthLabels(synth.train_n, synth.train_salt);
  const test = synthLabels(synth.test_n, synth.test_salt);
  for (const c of synth.cases) {
    const shares = checkDeal(c, train, test);
    // slot i's map before re-draws is (c + i mod 5) mod 5: at P = 0 exactly that
    if (c.partition === 'preference:0') {
      shares.forEach((s, i) => assert.deepEqual([...s.labelMap!], Array.from({ length: 10 }, (_, k) => (k + (i % NUM_RATINGS)) % NUM_RATINGS)));
    }
  }
});

test('preference:P is read as pfl-edge reads it: the same maps, or its error', () => {
  const train = synthLabels(synth.train_n, synth.train_salt);
  const test = synthLabels(synth.test_n, synth.test_salt);
  assert.ok(synth.args.some((a: { error?: string }) => a.error) && synth.args.some((a: { error?: string }) => !a.error));
  for (const a of synth.args as { partition: string; label_maps?: number[][]; error?: string }[]) {
    const run = (): SlotShare[] => deal(nodeSha256, train, test, 10, { partition: a.partition, clients: 6, seed: 13, samplesPerClient: 50 });
    if (a.error !== undefined) {
      assert.throws(run, (e: unknown) => e instanceof DealError && e.message === a.error, a.partition);
    } else {
      assert.deepEqual(run().map((s) => [...s.labelMap!]), a.label_maps, a.partition);
    }
  }
});
