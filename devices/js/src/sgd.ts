/**
 * Local SGD over a device's weights, stepped with the gradients its training program returns (docs/model.md,
 * "ONNX training" and "Training"): `torch.optim.SGD` semantics (dampening 0, no Nesterov) with
 * `clip_grad_norm_`'s clipping and DisPFL's masks, every operation rounded to binary32 as numpy does it on
 * float32 arrays (a Python float scalar taken as float32), so that a step equals pfl-edge's `pfl_edge.sgd.SGD`
 * bit for bit given the same gradients. Per step, with `g` the gradients:
 *
 * 1. `g += prox * (w - anchor)` (Ditto's personal model; 0: none);
 * 2. `clip_unmasked`: clip `g` (the total L2 norm `N` over every trained tensor, summed in float64; every
 *    gradient times `min(1, clip_norm / (N + 1e-6))`);
 * 3. `g *= mask` (DisPFL);
 * 4. not `clip_unmasked`: clip `g`;
 * 5. `g += weight_decay * w`;
 * 6. momentum: `buf = g` on the first step, then `buf = momentum * buf + g`; `g = buf`;
 * 7. `w -= lr * g`;
 * 8. `w *= mask` (DisPFL).
 */

const f = Math.fround;

export interface TrainConfig {
  /** epochs over the device's samples */
  epochs: number;
  batchSize: number;
  /** this round's learning rate */
  lr: number;
  momentum: number;
  weightDecay: number;
  clipNorm: number | null;
  clipUnmasked: boolean;
  /** a proximal term's lambda (Ditto); 0: none */
  prox?: number;
}

export type Weights = Map<string, Float32Array>;

export class SGD {
  private readonly buf = new Map<string, Float32Array>();
  private readonly masks: Map<string, ArrayLike<number>>;
  private readonly anchor: Map<string, Float32Array>;

  /** `params`: the tensors it steps (in place), in the program's trainable order. */
  constructor(
    readonly params: Weights,
    readonly cfg: TrainConfig,
    masks: ReadonlyMap<string, ArrayLike<number>> = new Map(),
    anchor: ReadonlyMap<string, Float32Array> = new Map(),
  ) {
    if (!(cfg.lr > 0) || !Number.isFinite(cfg.lr)) throw new RangeError(`lr must be finite and > 0, got ${cfg.lr}`);
    if (!(cfg.momentum >= 0 && cfg.momentum < 1)) throw new RangeError(`momentum must be in [0, 1), got ${cfg.momentum}`);
    if (!(cfg.weightDecay >= 0)) throw new RangeError(`weight_decay must be >= 0, got ${cfg.weightDecay}`);
    if (cfg.clipNorm !== null && !(cfg.clipNorm > 0)) throw new RangeError(`clip_norm must be > 0, got ${cfg.clipNorm}`);
    this.masks = new Map([...masks].filter(([k]) => params.has(k)));
    this.anchor = cfg.prox ? new Map([...anchor].filter(([k]) => params.has(k))) : new Map();
  }

  step(grads: ReadonlyMap<string, Float32Array>): void {
    const cfg = this.cfg;
    const g = new Map<string, Float32Array>();
    for (const [k, p] of this.params) {
      const gk = grads.get(k);
      if (gk === undefined) throw new Error(`no gradient for ${k}`);
      if (gk.length !== p.length) throw new Error(`the gradient of ${k} has ${gk.length} values, the weight ${p.length}`);
      g.set(k, Float32Array.from(gk)); // a copy: the caller's arrays are not changed
    }
    if (cfg.prox) {
      const lam = f(cfg.prox);
      for (const [k, a] of this.anchor) {
        const gk = g.get(k)!;
        const p = this.params.get(k)!;
        for (let i = 0; i < gk.length; i++) gk[i] = gk[i]! + f(lam * f(p[i]! - a[i]!));
      }
    }
    if (cfg.clipUnmasked) this.clip(g);
    for (const [k, m] of this.masks) {
      const gk = g.get(k)!;
      for (let i = 0; i < gk.length; i++) gk[i] = gk[i]! * m[i]!;
    }
    if (!cfg.clipUnmasked) this.clip(g);
    const lr = f(cfg.lr);
    const wd = f(cfg.weightDecay);
    const mom = f(cfg.momentum);
    for (const [k, p] of this.params) {
      let d = g.get(k)!;
      if (cfg.weightDecay) for (let i = 0; i < d.length; i++) d[i] = d[i]! + f(wd * p[i]!);
      if (cfg.momentum) {
        const buf = this.buf.get(k);
        if (buf === undefined) {
          this.buf.set(k, d);
        } else {
          for (let i = 0; i < d.length; i++) buf[i] = f(buf[i]! * mom) + d[i]!;
          d = buf;
        }
      }
      for (let i = 0; i < p.length; i++) p[i] = p[i]! - f(lr * d[i]!);
      const m = this.masks.get(k);
      if (m !== undefined) for (let i = 0; i < p.length; i++) p[i] = p[i]! * m[i]!;
    }
  }

  /** clip_grad_norm_: the norm over every element, summed in float64; the coefficient rounded to binary32. */
  private clip(g: Map<string, Float32Array>): void {
    if (this.cfg.clipNorm === null || g.size === 0) return;
    let sq = 0;
    for (const v of g.values()) for (let i = 0; i < v.length; i++) sq += v[i]! * v[i]!;
    const coef = Math.min(this.cfg.clipNorm / (Math.sqrt(sq) + 1e-6), 1.0);
    if (!(coef < 1.0)) return;
    const c = f(coef);
    for (const v of g.values()) for (let i = 0; i < v.length; i++) v[i] = v[i]! * c;
  }
}

/** A round's learning rate: `lr * lr_decay ** (t - 1)`; round 0 uses round 1's. */
export function lrAt(lr: number, lrDecay: number, t: number): number {
  return lr * lrDecay ** (Math.max(t, 1) - 1);
}
