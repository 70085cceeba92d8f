"""Who takes part in a round: the one definition of the draw, which the simulator, the server and a device
without torch make alike (``Algorithm.sampled`` asks it)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ..seeding import Stream, mt_stream

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["sample_participants", "sampled_slots"]


def sample_participants(seed: int, t: int, num_clients: int, fraction: float, *, poisson: bool = False) -> Tensor:
    """The clients (slots) of round ``t``, sorted: ``max(1, floor(fraction * N))`` drawn from the round's own
    stream (``poisson``: each with probability ``fraction``); everyone when the fraction is 1 (the simulator's
    view of ``sampled_slots``)."""
    import torch  # the coordinator's side: a server or the simulator

    drawn = sampled_slots(seed, t, num_clients, fraction, poisson)
    return torch.arange(num_clients) if drawn is None else torch.tensor(sorted(drawn), dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def sampled_slots(seed: int, t: int, num_clients: int, fraction: float,
                   poisson: bool = False) -> frozenset[int] | None:
    """The one definition of a round's draw, in numpy alone (``mt_stream`` draws torch's ``randperm`` and
    ``rand`` numbers, tests/pfl_edge/test_seeding.py), so that simulator, server and a device without torch draw
    alike; None when every client takes part. ``poisson`` (a federation with differential privacy, whose
    accountant assumes it): each client independently with probability ``fraction``, possibly nobody."""
    if poisson:
        if fraction >= 1:
            return None
        u = mt_stream(seed, Stream.PARTICIPANTS, t).rand(num_clients)
        return frozenset(int(i) for i in np.flatnonzero(u < np.float32(fraction)).tolist())
    m = max(1, min(num_clients, int(fraction * num_clients + 1e-9)))
    if m == num_clients:
        return None
    return frozenset(int(i) for i in mt_stream(seed, Stream.PARTICIPANTS, t).randperm(num_clients)[:m].tolist())
