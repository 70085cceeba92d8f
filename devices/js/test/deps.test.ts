/**
 * The dependencies of the later stages install and load: onnxruntime-node runs a model on the CPU (a one-node
 * ONNX graph written out by hand below, so no model file is needed), and mqtt imports. Also: the platform-neutral
 * sources import nothing from Node, so a React Native bundle can take them.
 */
import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import mqtt from 'mqtt';
import * as ort from 'onnxruntime-node';

// ------------------------------------------------------------------- a minimal protobuf writer for ModelProto

const varint = (v: number): number[] => {
  const out: number[] = [];
  while (v > 0x7f) {
    out.push((v & 0x7f) | 0x80);
    v = Math.floor(v / 128);
  }
  out.push(v);
  return out;
};
const field = (no: number, value: number | string | number[]): number[] => {
  if (typeof value === 'number') return [...varint(no << 3), ...varint(value)];
  const bytes = typeof value === 'string' ? [...new TextEncoder().encode(value)] : value;
  return [...varint((no << 3) | 2), ...varint(bytes.length), ...bytes];
};

/** ValueInfoProto of a float tensor of shape [dim]. */
const floatInput = (name: string, dim: number): number[] =>
  field(1, name).concat(field(2, field(1, field(1, 1).concat(field(2, field(1, field(1, dim)))))));

/** Y = Add(A, B), A, B, Y float[3]; IR version 8, opset 13. */
function addModel(): Uint8Array {
  const node = field(1, 'A').concat(field(1, 'B'), field(2, 'Y'), field(4, 'Add'));
  const graph = field(1, node).concat(field(2, 'add'), field(11, floatInput('A', 3)), field(11, floatInput('B', 3)), field(12, floatInput('Y', 3)));
  const opset = field(1, '').concat(field(2, 13));
  return Uint8Array.from(field(1, 8).concat(field(8, opset), field(7, graph)));
}

test('onnxruntime-node runs a model on the CPU', async (t) => {
  const session = await ort.InferenceSession.create(addModel(), { executionProviders: ['cpu'] });
  assert.deepEqual(session.inputNames, ['A', 'B']);
  const out = await session.run({
    A: new ort.Tensor('float32', Float32Array.of(1, 2, 3), [3]),
    B: new ort.Tensor('float32', Float32Array.of(0.5, -2, 10), [3]),
  });
  assert.deepEqual([...(out['Y']!.data as Float32Array)], [1.5, 0, 13]);
  await session.release();
  t.diagnostic(`onnxruntime-node ${ort.env.versions.node}`);
});

test('mqtt imports', () => {
  assert.equal(typeof mqtt.connect, 'function');
});

test('the platform-neutral sources import nothing from Node', () => {
  const src = fileURLToPath(new URL('../src/', import.meta.url));
  const files = readdirSync(src).filter((f) => f.endsWith('.js') && f !== 'node.js');
  assert.ok(files.includes('codec.js') && files.includes('index.js'));
  for (const f of files) {
    const text = readFileSync(src + f, 'utf8');
    const imports = [...text.matchAll(/from\s+['"]([^'"]+)['"]/g)].map((m) => m[1]!);
    for (const spec of imports) assert.ok(spec.startsWith('./'), `${f} imports ${spec}`);
    assert.ok(!/\b(Buffer|process|require)\b/.test(text.replace(/\/\*[\s\S]*?\*\/|\/\/.*$/gm, '')), `${f} uses a Node global`);
  }
});
