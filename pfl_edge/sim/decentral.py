"""Decentralized algorithms: DisPFL (personal sparse masks) and D-PSGD (dense neighbourhood averaging).

Every client trains every round; client i receives the models of its in-neighbours of that round
(``pfl_edge.topology``). Bytes are the codec's payload sizes, one transfer per recipient; the busiest node is
the client that sends plus receives the most.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..accounting import payload_bytes
from ..aggregate import neighbourhood_average
from ..flops import forward_flops, layer_sizes
from ..seeding import generator
from ..sparse import erk_densities, init_masks, prune_rate, prune_regrow
from ..topology import mixing_matrix, neighbours
from ..train import Stack, stack_states, unstack
from .algorithms import Algorithm, Context, RoundStats

__all__ = ["DPSGD", "DisPFL", "hamming_matrix", "mask_summary"]


def _traffic(payload: list[int], nbrs: list[list[int]]) -> tuple[list[int], list[int], int]:
    """Per client bytes sent (its payload once per recipient) and received; the busiest node's total."""
    n = len(nbrs)
    up, down = [0] * n, [0] * n
    for i, js in enumerate(nbrs):
        for j in js:
            down[i] += payload[j]
            up[j] += payload[j]
    return up, down, max(u + d for u, d in zip(up, down, strict=True))


class DisPFL(Algorithm):
    """Dai et al., ICML 2022 (ALGORITHMS.md). Each round, from the round's snapshot: client i averages its
    neighbours' sparse models (and its own) over the intersection of masks, keeps its own mask's support,
    trains with masked SGD, then prunes ``ceil(alpha_t * nnz)`` weights per tensor and regrows as many."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        self.shapes = {k: tuple(v.shape) for k, v in ctx.model.named_parameters()}
        by_density: dict[float, dict[str, float]] = {}
        masks = []
        for i in range(ctx.num_clients):
            d = cfg.client_density(i)
            dens = by_density.setdefault(d, erk_densities(self.shapes, d))
            masks.append(init_masks(self.shapes, dens, generator(cfg.seed, "mask", i)))
        self.masks: Stack = stack_states(masks)
        self.weights: Stack = {k: v * self.masks[k] if k in self.masks else v
                               for k, v in stack_states([ctx.init_state] * ctx.num_clients).items()}
        self.rows = torch.arange(ctx.num_clients)
        self.sizes = layer_sizes(ctx.model, ctx.input_shape)
        self._deployed: Stack | None = None
        # per client, the tensors its density leaves dense: sent without a mask (nnz never changes)
        self.dense_keys = [{k for k, m in self.masks.items() if bool(m[i].all())} for i in range(ctx.num_clients)]
        self.label_counts = torch.stack([torch.bincount(ctx.train_data.y[i, : int(ctx.train_data.n[i])],
                                                        minlength=ctx.num_classes) for i in range(ctx.num_clients)])

    def _client_masks(self, i: int) -> dict[str, Tensor]:
        return {k: m[i] for k, m in self.masks.items()}

    def _payload(self, i: int) -> int:
        masks = {k: m.bool() for k, m in self._client_masks(i).items() if k not in self.dense_keys[i]}
        return payload_bytes(unstack(self.weights, i), masks)

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx, cfg = self.ctx, self.ctx.cfg
        nbrs = neighbours(cfg.topology_spec, ctx.num_clients, t, cfg.seed)
        up, down, busiest = _traffic([self._payload(i) for i in range(ctx.num_clients)], nbrs)
        avg = neighbourhood_average(self.weights, mixing_matrix(nbrs), self.masks)
        start = {k: v * self.masks[k] if k in self.masks else v for k, v in avg.items()}
        res = ctx.trainer.train(start, self.rows, ctx.train_config(t), ctx.gens("train", t, self.rows),
                                masks=self.masks)
        flops = [cfg.local_epochs * int(ctx.train_data.n[i]) * 3
                 * forward_flops(ctx.model, ctx.input_shape, self._client_masks(i), self.sizes)
                 for i in range(ctx.num_clients)]
        if cfg.regrow == "gradient":  # the dense-gradient screen: one batch, 3 dense forwards per sample
            flops = [f + min(cfg.batch_size, int(n)) * 3 * ctx.dense_flops
                     for f, n in zip(flops, ctx.train_data.n, strict=True)]
        # What a client deploys this round is its trained sparse model, as in the reference code's
        # evaluation; the prune-and-regrow that follows prepares the next round.
        self._deployed = {k: v.clone() for k, v in res.stack.items()}
        acc, loss = ctx.trainer.evaluate(self._deployed, self.rows)
        density = [self._density(i) for i in range(ctx.num_clients)]
        summary = mask_summary(self.masks, self.label_counts)
        self._update_masks(t, res.stack)
        return RoundStats(acc.tolist(), loss.tolist(), _weighted_loss(res.loss, ctx.train_data.n), up, down,
                          busiest, self.rows.tolist(), flops, density, {"mask": summary})

    def _update_masks(self, t: int, trained: Stack) -> None:
        ctx, cfg = self.ctx, self.ctx.cfg
        # round t (1-based) uses alpha at t - 1, so the first update prunes at alpha0 and the last one is not
        # a no-op (the reference counts rounds from 0)
        alpha = prune_rate(cfg.alpha0, t - 1, cfg.rounds)
        grads = (ctx.trainer.dense_gradients(trained, self.rows, cfg.batch_size, ctx.gens("regrow", t, self.rows))
                 if cfg.regrow == "gradient" else None)
        for i in range(ctx.num_clients):
            sparse = {k: m for k, m in self._client_masks(i).items() if k not in self.dense_keys[i]}
            w, m = prune_regrow({k: trained[k][i] for k in sparse}, sparse, alpha,
                                grads=None if grads is None else {k: grads[k][i] for k in sparse},
                                gen=generator(cfg.seed, "regrow-random", t, i) if grads is None else None)
            for k in sparse:
                trained[k][i] = w[k]
                self.masks[k][i] = m[k]
        self.weights = trained

    def _density(self, i: int) -> float:
        ones = sum(float(m[i].sum()) for m in self.masks.values())
        return ones / sum(m[i].numel() for m in self.masks.values())

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.weights

    def analysis(self) -> dict[str, object]:
        """Pairwise mask Hamming distances beside the cosine similarity of label distributions."""
        ham = hamming_matrix(self.masks)
        cos = _cosine(self.label_counts.float())
        return {"hamming": ham.tolist(), "label_cosine": cos.tolist()}


class DPSGD(Algorithm):
    """Decentralized parallel SGD with multi-epoch local training: every client trains, then averages its
    model with its in-neighbours' (equal weights, dense). Evaluated on that neighbourhood average, the
    client's consensus model; ``dpsgd-ft`` first fine-tunes it locally for ``ft_epochs`` (not kept)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.weights: Stack = stack_states([ctx.init_state] * ctx.num_clients)
        self.rows = torch.arange(ctx.num_clients)
        self.ft = ctx.cfg.algorithm == "dpsgd-ft"
        self._deployed: Stack | None = None

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx, cfg = self.ctx, self.ctx.cfg
        res = ctx.trainer.train(self.weights, self.rows, ctx.train_config(t), ctx.gens("train", t, self.rows))
        nbrs = neighbours(cfg.topology_spec, ctx.num_clients, t, cfg.seed)
        up, down, busiest = _traffic([payload_bytes(unstack(res.stack, i)) for i in range(ctx.num_clients)],
                                     nbrs)
        self.weights = neighbourhood_average(res.stack, mixing_matrix(nbrs))
        deployed = self.weights
        epochs = cfg.local_epochs
        if self.ft and cfg.ft_epochs:
            deployed = ctx.trainer.train(deployed, self.rows, ctx.train_config(t, cfg.ft_epochs),
                                         ctx.gens("finetune", t, self.rows)).stack
            epochs += cfg.ft_epochs
        self._deployed = deployed
        acc, loss = ctx.trainer.evaluate(deployed, self.rows)
        flops = (3 * ctx.dense_flops * epochs * ctx.train_data.n).tolist()
        return RoundStats(acc.tolist(), loss.tolist(), _weighted_loss(res.loss, ctx.train_data.n), up, down,
                          busiest, self.rows.tolist(), flops, [1.0] * ctx.num_clients)

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.weights


def hamming_matrix(masks: Stack) -> Tensor:
    """Fraction of coordinates where two clients' masks differ, over every masked tensor: (C, C).
    Tensor by tensor (no copy of the whole stack); float32 products are exact for counts below 2**24, so
    larger tensors are split into chunks; sums in float64."""
    n = next(iter(masks.values())).shape[0]
    inter = torch.zeros(n, n, dtype=torch.float64)
    ones = torch.zeros(n, dtype=torch.float64)
    total = 0
    for m in masks.values():
        flat = m.reshape(n, -1)
        for s in range(0, flat.shape[1], 1 << 23):
            part = flat[:, s: s + (1 << 23)].to(torch.float32)
            inter += (part @ part.T).to(torch.float64)
            ones += part.sum(1, dtype=torch.float64)
        total += flat.shape[1]
    return ((ones[:, None] + ones[None, :] - 2 * inter) / total).to(torch.float32)


def _weighted_loss(loss: Tensor, n: Tensor) -> float:
    """Mean training loss over clients weighted by their samples, as the central algorithms report it."""
    w = n.to(torch.float64)
    return float((loss.to(torch.float64) * w).sum() / w.sum())


def _cosine(counts: Tensor) -> Tensor:
    v = counts / counts.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return v @ v.T


def mask_summary(masks: Stack, label_counts: Tensor, threshold: float = 0.5) -> dict[str, float | int | None]:
    """Mean Hamming distance between masks of clients whose label distributions are similar (cosine >=
    ``threshold``) and of those that are not."""
    ham = hamming_matrix(masks)
    cos = _cosine(label_counts.float())
    off = ~torch.eye(len(ham), dtype=torch.bool)
    sim = (cos >= threshold) & off
    dis = (cos < threshold) & off
    return {
        "hamming_similar": float(ham[sim].mean()) if sim.any() else None,
        "hamming_dissimilar": float(ham[dis].mean()) if dis.any() else None,
        "similar_pairs": int(sim.sum()) // 2,
        "dissimilar_pairs": int(dis.sum()) // 2,
    }
