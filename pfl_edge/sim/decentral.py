"""The simulator's decentralized runners: DisPFL (personal sparse masks) and D-PSGD (dense neighbourhood
averaging), rounds as ``pfl_edge.algorithms`` defines them.

Every client trains every round; client i receives the models of its in-neighbours of that round
(``pfl_edge.topology``). Bytes are the codec's payload sizes, one transfer per recipient; the busiest node is
the client that sends plus receives the most.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..accounting import payload_bytes
from ..algorithms import Algorithm, dispfl, dpsgd
from ..errors import InternalError
from ..flops import forward_flops, layer_sizes
from ..topology import mixing_matrix
from ..train import Stack, stack_states, unstack
from .algorithms import Context, RoundStats, Runner, weighted_loss

__all__ = ["DPSGDRunner", "DisPFLRunner", "hamming_matrix", "mask_summary"]


def graph(algo: Algorithm, t: int) -> list[list[int]]:
    nbrs = algo.neighbours(t)
    if nbrs is None:
        raise InternalError(f"{algo.name} is decentralised but has no neighbour graph")
    return nbrs


def _traffic(payload: list[int], nbrs: list[list[int]]) -> tuple[list[int], list[int], int, int]:
    """Per client bytes sent (its payload once per recipient) and received; the busiest node's sent + received,
    and the most any node receives (one direction, as the DisPFL paper counts)."""
    n = len(nbrs)
    up, down = [0] * n, [0] * n
    for i, js in enumerate(nbrs):
        for j in js:
            down[i] += payload[j]
            up[j] += payload[j]
    return up, down, max(u + d for u, d in zip(up, down, strict=True)), max(down)


class DisPFLRunner(Runner):
    """DisPFL (``pfl_edge.algorithms.dispfl``) over every client at once: each round's graph as a sparse mixing
    matrix, one ``neighbourhood_average`` for all clients."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        cl = ctx.clients
        self.state = dispfl.init_clients(cl, ctx.init_state, [ctx.cfg.client_density(i) for i in range(len(cl))])
        self.sizes = layer_sizes(ctx.model, ctx.input_shape)
        self._deployed: Stack | None = None
        self.label_counts = torch.stack([torch.bincount(ctx.train_data.y[i, : int(ctx.train_data.n[i])],
                                                        minlength=ctx.num_classes) for i in range(len(cl))])

    def _payload(self, i: int) -> int:
        return payload_bytes(unstack(self.state.weights, i), dispfl.sent_masks(unstack(self.state.support, i)))

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx, cfg = self.ctx, self.ctx.cfg
        cl = ctx.clients
        nbrs = graph(self.algo, t)
        up, down, busiest, received = _traffic([self._payload(i) for i in range(len(cl))], nbrs)
        masks = self.state.masks  # what each client trains under this round
        summary = mask_summary(masks, self.label_counts)
        self.state, res, trained, _ = dispfl.round_step(cl, self.state, mixing_matrix(nbrs), t)
        flops = [cfg.local_epochs * int(ctx.train_data.n[i]) * 3
                 * forward_flops(ctx.model, ctx.input_shape, {k: m[i] for k, m in masks.items()}, self.sizes)
                 for i in range(len(cl))]
        if cfg.regrow == "gradient":  # the dense-gradient screen: one batch, 3 dense forwards per sample
            flops = [f + min(cfg.batch_size, int(n)) * 3 * ctx.dense_flops
                     for f, n in zip(flops, ctx.train_data.n, strict=True)]
        # what a client deploys this round is its trained sparse model, as the reference code evaluates it
        self._deployed = trained
        acc, loss = ctx.trainer.evaluate(trained, cl.slots)
        density = [_density(masks, i) for i in range(len(cl))]
        return RoundStats(acc.tolist(), loss.tolist(), weighted_loss(res.loss, ctx.train_data.n), up, down,
                          busiest, received, cl.slots.tolist(), flops, density, {"mask": summary})

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.state.weights

    def analysis(self) -> dict[str, object]:
        """Pairwise mask Hamming distances beside the cosine similarity of label distributions."""
        ham = hamming_matrix(self.state.masks)
        cos = _cosine(self.label_counts.float())
        return {"hamming": ham.tolist(), "label_cosine": cos.tolist()}


def _density(masks: Stack, i: int) -> float:
    ones = sum(float(m[i].sum()) for m in masks.values())
    return ones / sum(m[i].numel() for m in masks.values())


class DPSGDRunner(Runner):
    """D-PSGD(-FT) (``pfl_edge.algorithms.dpsgd``) over every client at once."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        if not isinstance(self.algo, dpsgd.DPSGD):
            raise InternalError(f"{ctx.cfg.algorithm} is not D-PSGD")
        self.dpsgd: dpsgd.DPSGD = self.algo
        self.weights: Stack = stack_states([ctx.init_state] * ctx.num_clients)
        self._deployed: Stack | None = None

    def run_round(self, t: int, participants: Tensor) -> RoundStats:
        ctx = self.ctx
        cl = ctx.clients
        nbrs = graph(self.algo, t)
        self.weights, res, deployed = self.dpsgd.round(cl, self.weights, mixing_matrix(nbrs), t)
        up, down, busiest, received = _traffic([payload_bytes(unstack(res.stack, i)) for i in range(len(cl))],
                                               nbrs)
        self._deployed = deployed
        acc, loss = ctx.trainer.evaluate(deployed, cl.slots)
        flops = (3 * ctx.dense_flops * self.dpsgd.train_epochs(t) * ctx.train_data.n).tolist()
        return RoundStats(acc.tolist(), loss.tolist(), weighted_loss(res.loss, ctx.train_data.n), up, down,
                          busiest, received, cl.slots.tolist(), flops, [1.0] * len(cl))

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
