/** The model card (src/card.ts): a card captured from a running server, what the device derives from it, refusals. */
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { CardError, DATASET_SHAPES, findProgram, modelIdOf, parseCard, trainConfig, trainingDetails } from '../src/card.js';

const FIX = fileURLToPath(new URL('../../test/fixtures/', import.meta.url));
const raw = (): Record<string, unknown> => JSON.parse(readFileSync(FIX + 'card.json', 'utf8'));

test('a FedPer card with the ONNX training programs', () => {
  const card = parseCard(raw());
  assert.equal(card.modelId, 'cnn/10/1x28/deep0');
  assert.equal(modelIdOf({ model: 'cnn', base: 'deep', kp: 2 }, DATASET_SHAPES['fashion-mnist']!), card.modelId);
  assert.deepEqual(card.personalKeys, ['fc2.0.weight', 'fc2.0.bias', 'head.weight', 'head.bias']);
  assert.equal(card.baseKeys.length + card.personalKeys.length, card.tensors.length);
  assert.deepEqual(card.inputShape, [1, 28, 28]);
  assert.deepEqual(card.normalisation.mean, [0.286]);
  const inf = findProgram(card, 'inference', 'onnxruntime');
  assert.match(inf.file, /^cnn-inference-.*\.onnx$/);
  const tr = findProgram(card, 'training', 'onnxruntime', 'fedper');
  const det = trainingDetails(card, tr);
  assert.equal(det.batchSize, 32);
  assert.deepEqual(det.inputs.slice(0, 3), ['x', 'y', 'weight']);
  assert.equal(det.outputs[0], 'loss');
  assert.deepEqual(det.trainable, card.tensors.map((t) => t.name));
  assert.throws(() => findProgram(card, 'training', 'onnxruntime', 'dispfl'), CardError);
  const c = trainConfig(card, 3);
  assert.deepEqual(c, { epochs: 1, batchSize: 32, lr: 0.05, momentum: 0.9, weightDecay: 0, clipNorm: 10, clipUnmasked: false });
  assert.equal(trainConfig(card, 1, 4).epochs, 4);
});

test('the model id of the linear-base control and CIFAR-10', () => {
  assert.equal(modelIdOf({ model: 'cnn', base: 'linear', kp: 2 }, DATASET_SHAPES['fashion-mnist']!), 'cnn/10/1x28/linear2');
  assert.equal(modelIdOf({ model: 'resnet18-gn', base: 'deep', kp: 2 }, DATASET_SHAPES['cifar10']!), 'resnet18-gn/10/3x32/deep0');
});

test('cards this device must refuse', () => {
  const bad: [string, (c: Record<string, any>) => void][] = [
    ['format', (c) => { c.format = 'pfl-edge-model-card/2'; }],
    ['file name', (c) => { c.programs[0].file = '../etc/passwd.onnx'; }],
    ['sha256', (c) => { c.programs[0].sha256 = 'ABC'; }],
    ['optimiser', (c) => { c.training.optimiser = 'adam'; }],
    ['unknown key', (c) => { c.base_keys = [...c.base_keys, 'nope']; }],
    ['dtype', (c) => { c.tensors[0].dtype = 'f16'; }],
    ['density', (c) => { c.density = 0; }],
    ['lr', (c) => { c.training.lr = 'fast'; }],
  ];
  for (const [what, spoil] of bad) {
    const c = raw();
    spoil(c);
    assert.throws(() => parseCard(c), CardError, what);
  }
  const c = raw() as Record<string, any>;
  c.programs[1].details.signature = 'forward(x) -> y';
  assert.throws(() => trainingDetails(parseCard(c), parseCard(c).programs[1]!), CardError);
});

test("protocol 2's training fields are read, an added field is ignored, and a card without them still parses", () => {
  const plain = parseCard(raw());
  assert.equal(plain.training.headEpochs, null);
  assert.equal(plain.training.ditto, null); // the fixture, a card of the previous release: neither field
  const c = raw() as Record<string, any>;
  c.training.fedrep = { head_epochs: 3 };
  c.training.ditto = { lam: 0.5, personal_epochs: 2 };
  c.training.added_later = { anything: true };
  c.added_later = 1;
  const card = parseCard(c);
  assert.equal(card.training.headEpochs, 3);
  assert.deepEqual(card.training.ditto, { lam: 0.5, personalEpochs: 2 });
  for (const spoil of [(x: any) => { x.training.fedrep = { head_epochs: 1.5 }; }, (x: any) => { x.training.ditto = { lam: 'big' }; }]) {
    const d = raw() as Record<string, any>;
    spoil(d);
    assert.throws(() => parseCard(d), CardError);
  }
});
