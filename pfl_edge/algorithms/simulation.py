"""An algorithm over every client at once, as the simulator runs it: the algorithm's own ``Simulation`` keeps
every client's state, composes the round from the same pieces a device's round calls (over every row instead of
one) and accounts for it (bytes from the wire codec, FLOPs from the model); the simulator's one runner
(``pfl_edge.sim``) only draws the participants, evaluates what the clients deploy and records the round.

Coordinator side only (torch): imported by the simulator, and by an algorithm's ``simulation`` when it is asked.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..arrays import Array as Tensor
from ..arrays import Stack
from .base import Clients

if TYPE_CHECKING:
    from .algorithm import Algorithm

__all__ = ["SimRound", "Simulation", "World", "hamming_matrix", "label_cosine", "mask_summary", "traffic"]


@dataclass(frozen=True, eq=False)
class World:
    """What a simulation knows beyond the config: every client (``Clients`` over every row), the federation's
    initial model, the dense model's forward FLOPs per sample and its input's shape, and each client's training
    label counts, ``(clients, classes)``."""

    clients: Clients
    init: Mapping[str, Tensor]
    dense_flops: int
    input_shape: tuple[int, ...]
    label_counts: Tensor


@dataclass(frozen=True, eq=False)
class SimRound:
    """One round of every client as its algorithm accounts for it: what each deploys after the round (the
    runner evaluates it), the training loss of the clients that trained and their samples (the weights of the
    round's mean loss), bytes each client sent and received, the busiest node's sent + received and the most
    any node received (one direction, as the DisPFL paper counts), FLOPs and mask density per client, and what
    else the round reports (DisPFL: its masks against label similarity)."""

    deployed: Stack
    loss: Tensor
    loss_n: Tensor
    bytes_up: list[int]
    bytes_down: list[int]
    busiest: int
    received: int
    flops: list[int]
    density: list[float]
    extra: dict[str, object] = field(default_factory=dict)


class Simulation(ABC):
    """An algorithm's clients, all of them, round by round (``Algorithm.simulation``)."""

    def __init__(self, algo: Algorithm, world: World) -> None:
        self.algo = algo
        self.world = world

    @abstractmethod
    def round(self, t: int, participants: Tensor) -> SimRound:
        """Round ``t`` (1-based) with the drawn ``participants`` (sorted client ids)."""

    @abstractmethod
    def deployed(self) -> Stack:
        """Every client's model as it would deploy it now, stacked."""

    def shared(self) -> dict[str, Tensor] | None:
        """The shared part (a global model or base), if the algorithm has one."""
        return None

    def analysis(self) -> dict[str, object]:
        """Extra end-of-run analysis for the result JSON (DisPFL: masks against label similarity)."""
        return {}


def traffic(payload: Sequence[int], nbrs: Sequence[Sequence[int]]) -> tuple[list[int], list[int], int, int]:
    """Where clients send their model to their out-neighbours (one transfer per recipient): per client the bytes
    sent and received; the busiest node's sent + received, and the most any node receives."""
    n = len(nbrs)
    up, down = [0] * n, [0] * n
    for i, js in enumerate(nbrs):
        for j in js:
            down[i] += payload[j]
            up[j] += payload[j]
    return up, down, max(u + d for u, d in zip(up, down, strict=True)), max(down)


def hamming_matrix(masks: Stack) -> Tensor:
    """Fraction of coordinates where two clients' masks differ, over every masked tensor: (C, C).
    Tensor by tensor (no copy of the whole stack); float32 products are exact for counts below 2**24, so
    larger tensors are split into chunks; sums in float64."""
    import torch

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


def label_cosine(counts: Tensor) -> Tensor:
    """The cosine similarity of every two clients' label counts: (C, C)."""
    v = counts / counts.norm(dim=1, keepdim=True).clamp_min(1e-12)
    return v @ v.T


def mask_summary(masks: Stack, label_counts: Tensor, threshold: float = 0.5) -> dict[str, float | int | None]:
    """Mean Hamming distance between masks of clients whose label distributions are similar (cosine >=
    ``threshold``) and of those that are not."""
    import torch

    ham = hamming_matrix(masks)
    cos = label_cosine(label_counts.float())
    off = ~torch.eye(len(ham), dtype=torch.bool)
    sim = (cos >= threshold) & off
    dis = (cos < threshold) & off
    return {
        "hamming_similar": float(ham[sim].mean()) if sim.any() else None,
        "hamming_dissimilar": float(ham[dis].mean()) if dis.any() else None,
        "similar_pairs": int(sim.sum()) // 2,
        "dissimilar_pairs": int(dis.sum()) // 2,
    }
