/**
 * The federation's random streams and the deal against pfl-edge's own draws (test/fixtures/*.json, written by
 * test/fixtures/make_fixtures.py from numpy and torch): derive_seed, torch's MT19937 randperm/rand, numpy's PCG64
 * (SeedSequence seeding, raw draws, permutation, choice without replacement on both of its paths, integers,
 * random), and the deal of Fashion-MNIST (when Debian's files are here).
 */
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { deal } from '../src/partition.js';
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

test('the deal of Fashion-MNIST equals pfl-edge\'s', { skip: haveFmnist ? false : 'no Fashion-MNIST here' }, () => {
  const labels = fashionMnistLabels();
  for (const c of deals.cases) {
    const shares = deal(nodeSha256, labels.train, labels.test, 10, {
      partition: c.partition, clients: c.clients, seed: c.seed, samplesPerClient: c.samples_per_client,
      testPerClient: c.test_per_client, testDraw: c.test_draw,
    });
    shares.forEach((s, i) => {
      const what = `${c.partition} clients ${c.clients} seed ${c.seed} slot ${i}`;
      assert.equal(s.trainIdx.length, c.train[i].n, what);
      assert.equal(digest(s.trainIdx), c.train[i].idx, what + ' train idx');
      assert.equal(digest(s.trainY), c.train[i].y, what + ' train y');
      assert.equal(digest(s.testIdx), c.test[i].idx, what + ' test idx');
      assert.equal(digest(s.testY), c.test[i].y, what + ' test y');
    });
  }
});
