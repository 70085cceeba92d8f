#!/usr/bin/env node
/**
 * The device's training step, timed, for bench/train_step_js.py (issue 31): the server's ONNX training program in
 * onnxruntime-node (`openTraining`, as the device opens it) and the device's own step, `batchGradients` (the batch
 * copied into the program's inputs) then `SGD.step`, on one fixed batch, from weights the driver wrote.
 *
 *   node dist/bin/bench_step.js --dir DIR [--threads 1]
 *
 * DIR: `program.onnx`; `meta.json` ({details: the program's card details, config: {lr, momentum, weight_decay,
 * clip_norm, clip_unmasked}, n}); `weights.bin` (every key's float32 values, little-endian, in `details.keys`
 * order); `x.bin` (float32, n samples); `y.bin` (int32 labels). It prints one JSON line when ready, then answers
 * each line of stdin with one JSON line: `step N` runs N steps, timed one by one (ms: the whole step, its
 * gradients, its SGD); `call N` times N calls of the program alone on ready inputs (no batch copy, no SGD; the
 * weights unchanged); `dump PATH` writes the weights as `weights.bin` is laid out. It ends at the end of stdin.
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { createInterface } from 'node:readline';
import { parseArgs } from 'node:util';

import * as ort from 'onnxruntime-node';

import type { TrainingDetails } from '../src/card.js';
import { openTraining } from '../src/nodejs/ort.js';
import { SGD, type Weights } from '../src/sgd.js';
import { type Samples, batchGradients } from '../src/train.js';

interface Meta {
  details: {
    batch_size: number; inputs: string[]; outputs: string[]; keys: string[]; trainable: string[]; frozen: string[];
    shapes: Record<string, number[]>; input_shape: number[];
  };
  config: { lr: number; momentum: number; weight_decay: number; clip_norm: number | null; clip_unmasked: boolean };
  n: number;
}

const f32 = (path: string): Float32Array => {
  const b = readFileSync(path);
  return new Float32Array(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
};

async function main(): Promise<void> {
  const { values } = parseArgs({ options: { dir: { type: 'string' }, threads: { type: 'string', default: '1' } } });
  if (!values.dir) throw new Error('usage: bench_step --dir DIR [--threads N]');
  const dir = values.dir;
  const threads = Number(values.threads);
  const meta = JSON.parse(readFileSync(`${dir}/meta.json`, 'utf8')) as Meta;
  const d = meta.details;
  const det: TrainingDetails = {
    batchSize: d.batch_size, inputs: d.inputs, outputs: d.outputs, keys: d.keys, trainable: d.trainable,
    frozen: d.frozen, shapes: new Map(d.keys.map((k) => [k, d.shapes[k]!])), inputShape: d.input_shape,
  };
  const numel = (k: string): number => det.shapes.get(k)!.reduce((a, b) => a * b, 1);
  const flat = f32(`${dir}/weights.bin`);
  const weights: Weights = new Map();
  let off = 0;
  for (const k of det.keys) {
    weights.set(k, flat.slice(off, off + numel(k)));
    off += numel(k);
  }
  if (off !== flat.length) throw new Error(`weights.bin holds ${flat.length} values, the keys ${off}`);
  const yb = readFileSync(`${dir}/y.bin`);
  const data: Samples = {
    x: f32(`${dir}/x.bin`), y: new Int32Array(yb.buffer.slice(yb.byteOffset, yb.byteOffset + yb.byteLength)),
    n: meta.n, sampleSize: det.inputShape.reduce((a, b) => a * b, 1),
  };
  const idx = Int32Array.from({ length: meta.n }, (_, i) => i);
  const t0 = performance.now();
  const program = await openTraining(readFileSync(`${dir}/program.onnx`), det, threads);
  const openMs = performance.now() - t0;
  const c = meta.config;
  const opt = new SGD(new Map(det.trainable.map((k) => [k, weights.get(k)!])), {
    epochs: 1, batchSize: meta.n, lr: c.lr, momentum: c.momentum, weightDecay: c.weight_decay, clipNorm: c.clip_norm,
    clipUnmasked: c.clip_unmasked,
  });
  // the program's inputs as batchGradients makes them (the batch is full: every sample at weight 1)
  const callX = data.x.slice(0, meta.n * data.sampleSize);
  const callY = BigInt64Array.from(data.y, (v) => BigInt(v));
  const callW = new Float32Array(meta.n).fill(1);
  const say = (o: unknown): void => void process.stdout.write(`${JSON.stringify(o)}\n`);
  say({ ready: true, threads, open_ms: openMs, onnxruntime_node: ort.env.versions.node, node: process.versions.node });
  for await (const line of createInterface({ input: process.stdin })) {
    const [cmd, arg] = line.trim().split(/\s+/, 2);
    if (cmd === 'step') {
      const ms: number[] = [];
      const gradMs: number[] = [];
      const sgdMs: number[] = [];
      let loss = NaN;
      for (let i = 0; i < Number(arg); i++) {
        const a = performance.now();
        const r = await batchGradients(program, weights, data, idx);
        const b = performance.now();
        opt.step(r.grads);
        const e = performance.now();
        ms.push(e - a);
        gradMs.push(b - a);
        sgdMs.push(e - b);
        loss = r.loss;
      }
      say({ ms, grad_ms: gradMs, sgd_ms: sgdMs, loss });
    } else if (cmd === 'call') {
      const ms: number[] = [];
      for (let i = 0; i < Number(arg); i++) {
        const a = performance.now();
        await program.run(callX, callY, callW, weights);
        ms.push(performance.now() - a);
      }
      say({ ms });
    } else if (cmd === 'dump' && arg) {
      const out = new Float32Array(off);
      let o = 0;
      for (const k of det.keys) {
        out.set(weights.get(k)!, o);
        o += numel(k);
      }
      writeFileSync(arg, new Uint8Array(out.buffer));
      say({ ok: true });
    } else {
      say({ error: `unknown command ${JSON.stringify(line)}` });
    }
  }
}

main().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
  process.exit(1);
});
