/**
 * Differential privacy of the shared part on this device (pfl-edge's docs/privacy.md): the central mode's clip,
 * `pfl_edge.privacy.privatize` without noise. This device adds no noise share, so it refuses a distributed-mode
 * federation (device.ts).
 */
import type { Weights } from './sgd.js';

/** A device clips just inside the bound, so that float32 rounding never puts it past the server's clip. */
export const MARGIN = 1 - 1e-6;

/**
 * What it sends of `state`: `base` plus its update over `keys` clipped to `clip * MARGIN` in L2 (in float64, as
 * pfl-edge computes it), or `state` itself where the update is within the bound.
 */
export function privatize(state: Weights, base: Weights, keys: readonly string[], clip: number): Weights {
  const bound = clip * MARGIN;
  let sq = 0;
  for (const k of keys) {
    const a = state.get(k)!;
    const b = base.get(k)!;
    for (let i = 0; i < a.length; i++) sq += (a[i]! - b[i]!) ** 2;
  }
  const norm = Math.sqrt(sq);
  if (norm <= bound) return state;
  const scale = bound / norm;
  const out = new Map(state);
  for (const k of keys) {
    const b = base.get(k)!;
    out.set(k, Float32Array.from(state.get(k)!, (v, i) => b[i]! + (v - b[i]!) * scale));
  }
  return out;
}
