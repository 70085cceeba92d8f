/**
 * The server's programs on onnxruntime-node (a phone uses onnxruntime-react-native, whose API is the same): the
 * ONNX training program (inputs `x`, `y`, `weight` and each parameter by its state-dict key; outputs `loss` and
 * `grad:<key>`) and the ONNX inference program (`input` and every state-dict tensor; output `logits`), in plain
 * inference sessions on the CPU (docs/model.md, "ONNX training", "ONNX inference").
 */
import * as ort from 'onnxruntime-node';

import type { ModelCard, ProgramEntry, TrainingDetails } from '../card.js';
import type { GradientProgram, InferenceProgram } from '../train.js';

/** onnxruntime-node's version, as its runtime reports it ('?' where it does not). */
export function ortVersion(): string {
  const v = (ort.env as { versions?: Record<string, string | undefined> }).versions;
  return v?.['node'] ?? v?.['common'] ?? '?';
}

const options = (threads: number): ort.InferenceSession.SessionOptions => ({
  executionProviders: ['cpu'],
  intraOpNumThreads: threads,
  interOpNumThreads: 1,
});

export async function openTraining(bytes: Uint8Array, det: TrainingDetails, threads = 1): Promise<GradientProgram> {
  const sess = await ort.InferenceSession.create(bytes, options(threads));
  if (sess.inputNames.join('\n') !== det.inputs.join('\n')) {
    throw new Error(`the training program's inputs ${sess.inputNames.slice(0, 4).join(', ')}... are not its details' ${det.inputs.slice(0, 4).join(', ')}...`);
  }
  for (const o of det.outputs) if (!sess.outputNames.includes(o)) throw new Error(`the training program has no output ${o}`);
  const B = det.batchSize;
  const xShape = [B, ...det.inputShape];
  const program: GradientProgram = {
    batchSize: B,
    keys: det.keys,
    trainable: det.trainable,
    inputShape: det.inputShape,
    async run(x, y, weight, weights) {
      const feeds: Record<string, ort.Tensor> = {
        x: new ort.Tensor('float32', x, xShape),
        y: new ort.Tensor('int64', y, [B]),
        weight: new ort.Tensor('float32', weight, [B]),
      };
      for (const k of det.keys) {
        const w = weights.get(k);
        if (w === undefined) throw new Error(`no weights for ${k}`);
        feeds[k] = new ort.Tensor('float32', w, det.shapes.get(k)!);
      }
      const out = await sess.run(feeds, det.outputs);
      const loss = (out['loss']!.data as Float32Array)[0]!;
      const grads = new Map<string, Float32Array>();
      for (const k of det.trainable) grads.set(k, out[`grad:${k}`]!.data as Float32Array);
      return { loss, grads };
    },
  };
  // one call at load: a program this runtime cannot run fails here, not mid-round
  const size = det.inputShape.reduce((a, b) => a * b, 1);
  const zeros = new Map(det.keys.map((k) => [k, new Float32Array(det.shapes.get(k)!.reduce((a, b) => a * b, 1))]));
  const { grads } = await program.run(new Float32Array(B * size), new BigInt64Array(B), new Float32Array(B).fill(1), zeros);
  if ([...grads.keys()].join('\n') !== det.trainable.join('\n')) throw new Error("the program's gradients are not its trainable keys");
  return program;
}

export async function openInference(bytes: Uint8Array, card: ModelCard, p: ProgramEntry, threads = 1): Promise<InferenceProgram> {
  const sess = await ort.InferenceSession.create(bytes, options(threads));
  const weights = p.details['weights'];
  if (!Array.isArray(weights) || !weights.every((w) => typeof w === 'string')) throw new Error(`${p.file}: details.weights is not a list of keys`);
  const shapes = new Map(card.tensors.map((t) => [t.name, t.shape]));
  for (const k of weights as string[]) if (!shapes.has(k)) throw new Error(`${p.file} takes ${k}, which the card does not list`);
  if (sess.inputNames.join('\n') !== ['input', ...(weights as string[])].join('\n')) throw new Error(`${p.file}'s inputs are not input and the weights`);
  return {
    numClasses: card.numClasses,
    async logits(x, n, w) {
      const feeds: Record<string, ort.Tensor> = { input: new ort.Tensor('float32', x, [n, ...card.inputShape]) };
      for (const k of weights as string[]) feeds[k] = new ort.Tensor('float32', w.get(k)!, shapes.get(k)!);
      const out = await sess.run(feeds, ['logits']);
      return out['logits']!.data as Float32Array;
    },
  };
}
