/**
 * A slot's data from the server's share (src/share.ts, `GET /v1/devices/me/share`) for a partition the device does
 * not deal: test/fixtures/share.json (make_synthetic_fixtures.py) holds pfl-edge's answers (`data_share` of
 * `deal_labels`) for every slot of a `dirichlet-client:0.3` federation on the synthetic set with what `deal_arrays`
 * gives each slot; the Node platform's `loadSlotData`, asking through the device's HTTP client against a fake
 * `fetch`, gives those very samples. A `preference` share (a label map) reads as the device's own deal of the slot;
 * hostile answers (another slot, federation, data set or partition; indices out of range, unsorted, repeated or not
 * integers; a label map out of range or of another length; another class count; too large; not JSON) are refused.
 */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { parseCard } from '../src/card.js';
import { Http, HttpError } from '../src/http.js';
import { DealError, NUM_RATINGS, deal } from '../src/partition.js';
import { nodeSha256 } from '../src/node.js';
import { SHARE_PATH, type ShareExpect, ShareError, type ShareSource, httpShareSource, parseShare, shareBound } from '../src/share.js';
import { toHex } from '../src/sha256.js';
import { loadSlotData, syntheticDataset } from '../src/nodejs/platform.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const fix = JSON.parse(readFileSync(FIX + 'share.json', 'utf8'));
const cardJson = JSON.parse(readFileSync(FIX + 'card.json', 'utf8'));
const NONE = { statistics: 'none', scale: 1.0, mean: [0.0], std: [1.0], std_floor: null, description: 'generated already as model inputs (no pixels)' };
const synthCard = (numClasses = 10) => parseCard({ ...cardJson, num_classes: numClasses, input: { ...cardJson.input, normalisation: NONE } });

interface Entry {
  config: Record<string, unknown>;
  slot: number;
  share: Record<string, unknown>;
  num_classes: number;
  train: { n: number; x_sha256: string; y_sha256: string };
  test: { n: number; x_sha256: string; y_sha256: string };
}
const entries = fix.shares as Entry[];
const dirichlet = entries.filter((e) => String(e.config['partition']).startsWith('dirichlet-client'));
const preference = entries.filter((e) => String(e.config['partition']).startsWith('preference'));

const sha = (a: Float32Array | Int32Array): string => toHex(nodeSha256(new Uint8Array(a.buffer, a.byteOffset, a.byteLength)));

/** The device's share source on an `Http` whose `fetch` answers `answer` (a body, or a Response); its calls. */
function fakeServer(answer: unknown, federation: string = fix.federation): { source: ShareSource; calls: { url: string; init: RequestInit }[] } {
  const calls: { url: string; init: RequestInit }[] = [];
  const f = (async (url: string, init: RequestInit) => {
    calls.push({ url, init });
    if (answer instanceof Response) return answer;
    return new Response(typeof answer === 'string' ? answer : JSON.stringify(answer), { status: 200, headers: { 'content-type': 'application/json' } });
  }) as unknown as typeof fetch;
  const http = new Http('http://server.test', { fetch: f, backoffS: [0.01, 0.02], patienceS: 1 });
  http.token = 'tok';
  return { source: httpShareSource(http, federation), calls };
}

test('every slot of a dirichlet-client federation loads from its share as pfl-edge\'s deal_arrays gives it', async () => {
  assert.equal(dirichlet.length, 4);
  for (const s of dirichlet) {
    const what = `${String(s.config['partition'])} slot ${s.slot}`;
    const { source, calls } = fakeServer(s.share);
    const data = await loadSlotData(s.config, s.slot, synthCard(), null, null, source);
    assert.equal(calls.length, 1, what);
    assert.equal(calls[0]!.url, 'http://server.test' + SHARE_PATH);
    assert.equal(calls[0]!.init.method, 'GET');
    assert.equal((calls[0]!.init.headers as Record<string, string>)['authorization'], 'Bearer tok');
    assert.equal(data.train.n, s.train.n, what);
    assert.equal(data.test.n, s.test.n, what);
    assert.equal(sha(data.train.y), s.train.y_sha256, `${what}: train labels`);
    assert.equal(sha(data.test.y), s.test.y_sha256, `${what}: test labels`);
    assert.equal(sha(data.train.x), s.train.x_sha256, `${what}: train inputs`);
    assert.equal(sha(data.test.x), s.test.x_sha256, `${what}: test inputs`);
  }
});

test('without a share to ask for, a partition it does not deal is refused as before', async () => {
  const s = dirichlet[0]!;
  const refused = (e: unknown) => e instanceof DealError && /cannot deal partition 'dirichlet-client:0.3'/.test(e.message);
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard()), refused);
});

test('a partition it deals is dealt here, never asked for', async () => {
  const s = preference[0]!;
  const { source, calls } = fakeServer({ nonsense: true });
  const data = await loadSlotData(s.config, s.slot, synthCard(NUM_RATINGS), null, null, source);
  assert.equal(calls.length, 0);
  assert.equal(sha(data.train.x), s.train.x_sha256);
  assert.equal(sha(data.train.y), s.train.y_sha256);
});

const expectFor = (s: Entry, numClasses: number): ShareExpect => {
  const d = syntheticDataset();
  return {
    federation: fix.federation, slot: s.slot, dataset: String(s.config['dataset']), partition: String(s.config['partition']),
    numClasses, datasetClasses: 10, trainY: d.train.y, testY: d.test.y,
  };
};

test('a preference share (a label map) reads as the device\'s own deal of the slot', () => {
  const d = syntheticDataset();
  for (const s of preference) {
    const c = s.config;
    const want = deal(nodeSha256, d.train.y, d.test.y, 10, {
      partition: String(c['partition']), clients: Number(c['clients']), seed: Number(c['seed']),
      samplesPerClient: Number(c['samples_per_client']), testPerClient: Number(c['test_per_client']),
    })[s.slot]!;
    const got = parseShare(s.share, expectFor(s, NUM_RATINGS));
    for (const k of ['trainIdx', 'trainY', 'testIdx', 'testY', 'labelMap'] as const) {
      assert.deepEqual([...got[k]!], [...want[k]!], `slot ${s.slot}: ${k}`);
    }
    assert.equal(sha(got.trainY), s.train.y_sha256);
    assert.equal(sha(got.testY), s.test.y_sha256);
  }
});

test('hostile shares are refused, each with what is wrong', async () => {
  const s = dirichlet[1]!;
  const base = s.share;
  const train = base['train'] as number[];
  const test_ = base['test'] as number[];
  const cases: [string, Record<string, unknown> | unknown, RegExp][] = [
    ['another slot', { ...base, slot: 0 }, /for slot 0, not this device's 1/],
    ['a slot as text', { ...base, slot: '1' }, /for slot "1", not this device's 1/],
    ['another federation', { ...base, federation: 'other' }, /for federation "other", not this device's "share-fixture"/],
    ['another partition', { ...base, partition: 'dirichlet-client:0.5' }, /for partition "dirichlet-client:0.5", not this device's "dirichlet-client:0.3"/],
    ['another data set', { ...base, dataset: 'fashion-mnist' }, /for dataset "fashion-mnist", not this device's "synthetic"/],
    ['no partition', { ...base, partition: undefined }, /for partition undefined/],
    ['another class count', { ...base, num_classes: 5 }, /labels of 5 classes, but the card's model predicts 10/],
    ['a class count as text', { ...base, num_classes: '10' }, /num_classes is "10", not a positive integer/],
    ['a train index out of range', { ...base, train: [...train.slice(0, -1), 6000] }, /train\[47\] = 6000 is out of range of the split's 6000 samples/],
    ['a negative index', { ...base, test: [-1, ...test_.slice(1)] }, /test\[0\] = -1 is out of range/],
    ['a test index out of range', { ...base, test: [...test_.slice(0, -1), 2000] }, /= 2000 is out of range of the split's 2000 samples/],
    ['unsorted', { ...base, train: [train[1], train[0], ...train.slice(2)] }, /train\[1\] = \d+ after \d+: the indices must ascend/],
    ['a sample twice', { ...base, test: [test_[0], ...test_] }, /test\[1\] = \d+ after \d+: the indices must ascend, each sample once/],
    ['a fraction', { ...base, train: [0.5, ...train.slice(1)] }, /train\[0\] is 0.5, not an integer/],
    ['an index as text', { ...base, train: ['3', ...train.slice(1)] }, /train\[0\] is "3", not an integer/],
    ['a boolean', { ...base, train: [true, ...train.slice(1)] }, /train\[0\] is true, not an integer/],
    ['a null index', { ...base, test: [null, ...test_.slice(1)] }, /test\[0\] is null, not an integer/],
    ['train not a list', { ...base, train: { 0: 1 } }, /train is an object, not a list of indices/],
    ['no test', { ...base, test: undefined }, /test is undefined, not a list of indices/],
    ['an empty train', { ...base, train: [] }, /train is empty/],
    ['too many indices', { ...base, test: Array.from({ length: 2001 }, (_, i) => i) }, /lists 2001 samples, more than the split's 2000/],
    ['a label map out of range', { ...base, label_map: [0, 1, 2, 3, 4, 5, 6, 7, 8, 10] }, /label_map\[9\] is 10, not a label in \[0, 10\)/],
    ['a negative label', { ...base, label_map: [0, 1, 2, 3, -1, 5, 6, 7, 8, 9] }, /label_map\[4\] is -1/],
    ['a label map too short', { ...base, label_map: [0, 1, 2] }, /label_map has 3 entries, not one for each of synthetic's 10 classes/],
    ['a label map not a list', { ...base, label_map: 'identity' }, /label_map is "identity", not a list or null/],
    ['a list', [base], /the server's share is a list of 1, not an object/],
    ['null', null, /the server's share is null, not an object/],
  ];
  for (const [what, body, re] of cases) {
    const { source } = fakeServer(body);
    await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, source),
      (e: unknown) => e instanceof ShareError && e instanceof DealError && re.test(e.message), what);
  }
  // without a label map the labels are the data set's: a share of another class count needs one (a 5-class card)
  await assert.rejects(async () => parseShare({ ...base, num_classes: 5 }, expectFor(s, 5)),
    (e: unknown) => e instanceof ShareError && /labels of 5 classes and no label map, but synthetic has 10/.test(e.message));
  // the valid share itself, with fields added later ignored
  const ok = parseShare({ ...base, added_later: [1, 2] }, expectFor(s, 10));
  assert.deepEqual([...ok.trainIdx], train);
});

test('the share answer is bounded, and a refusal or non-JSON is a clear ShareError', async () => {
  const s = dirichlet[0]!;
  // the synthetic set's 8000 samples: 8 bytes each plus 64 KiB, far above the valid answer's size
  const bound = shareBound(6000, 2000);
  assert.equal(bound, 8000 * 8 + 65536);
  assert.ok(JSON.stringify(s.share).length < bound / 10);
  const huge = { ...s.share, padding: 'x'.repeat(bound) };
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, fakeServer(huge).source),
    (e: unknown) => e instanceof HttpError && new RegExp(`over this device's bound of ${bound}`).test(e.message));
  const answer = (status: number, detail: string) => new Response(JSON.stringify({ detail }), { status, headers: { 'content-type': 'application/json' } });
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, fakeServer(answer(404, 'Not Found')).source),
    (e: unknown) => e instanceof ShareError && /gives no data shares \(404: Not Found\): a server of protocol version 1/.test(e.message));
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, fakeServer(answer(409, 'deals no data')).source),
    (e: unknown) => e instanceof ShareError && /deals this federation no data \(deals no data\)/.test(e.message));
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, fakeServer('{"slot": 0, "train": [1, 2').source),
    (e: unknown) => e instanceof ShareError && /the server's share is not JSON/.test(e.message));
  // another federation's device: the share it is given must be its own federation's
  await assert.rejects(loadSlotData(s.config, s.slot, synthCard(), null, null, fakeServer(s.share, 'fed-b').source),
    (e: unknown) => e instanceof ShareError && /not this device's "fed-b"/.test(e.message));
});
