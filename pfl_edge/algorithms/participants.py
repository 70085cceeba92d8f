"""Who takes part in a round: the one definition of the draw, which the simulator, the server and a device
without torch make alike (``Algorithm.sampled`` asks it).

A federation whose draw must stay hidden from its devices (differential privacy with the server's secret noise:
``pfl_edge.privacy.secret_draw``) draws under a key the server keeps (``secret_slots``); the simulator given the
same key draws the same slots. Every other sampled federation draws from its seed, in public."""

from __future__ import annotations

import functools
import hashlib
import hmac
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InternalError
from ..seeding import Stream, mt_stream

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DRAW_LABEL", "sample_participants", "sampled_slots", "secret_slots"]

#: the HMAC message's prefix of the secret draw (``secret_slots``)
DRAW_LABEL = b"pfl-participants"


def sample_participants(seed: int, t: int, num_clients: int, fraction: float, *, poisson: bool = False,
                        key: bytes | None = None) -> Tensor:
    """The clients (slots) of round ``t``, sorted: ``max(1, floor(fraction * N))`` drawn from the round's own
    stream (``poisson``: each with probability ``fraction``; under ``key``: ``secret_slots``); everyone when the
    fraction is 1 (the simulator's view of ``sampled_slots``)."""
    import torch  # the coordinator's side: a server or the simulator

    drawn = sampled_slots(seed, t, num_clients, fraction, poisson, key)
    return torch.arange(num_clients) if drawn is None else torch.tensor(sorted(drawn), dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def sampled_slots(seed: int, t: int, num_clients: int, fraction: float,
                  poisson: bool = False, key: bytes | None = None) -> frozenset[int] | None:
    """The one definition of a round's draw, in numpy alone (``mt_stream`` draws torch's ``randperm`` and
    ``rand`` numbers, tests/pfl_edge/test_seeding.py), so that simulator, server and a device without torch draw
    alike; None when every client takes part. ``poisson`` (a federation with differential privacy, whose
    accountant assumes it): each client independently with probability ``fraction``, possibly nobody; under
    ``key`` (the server's sampling key) the draw is ``secret_slots``', which the seed does not decide."""
    if poisson:
        if fraction >= 1:
            return None
        if key is not None:
            return secret_slots(key, t, num_clients, fraction)
        u = mt_stream(seed, Stream.PARTICIPANTS, t).rand(num_clients)
        return frozenset(int(i) for i in np.flatnonzero(u < np.float32(fraction)).tolist())
    if key is not None:
        raise InternalError("a sampling key draws Poisson rounds only (a federation with a [privacy] table)")
    m = max(1, min(num_clients, int(fraction * num_clients + 1e-9)))
    if m == num_clients:
        return None
    return frozenset(int(i) for i in mt_stream(seed, Stream.PARTICIPANTS, t).randperm(num_clients)[:m].tolist())


def secret_slots(key: bytes, t: int, num_clients: int, fraction: float) -> frozenset[int]:
    """Round ``t``'s Poisson draw under the server's sampling ``key``: slot i takes part when the first 8 bytes of
    HMAC-SHA256(key, ``DRAW_LABEL`` || t || i) (t and i as 8-byte big-endian integers), read as a big-endian
    integer x, are below floor(fraction x 2^64): probability ``fraction`` (to 2^-64), independently per slot.

    Why HMAC per slot and not a seed derived from the key fed into the seeded stream: HMAC-SHA256 is a
    pseudorandom function, so the draws of the other slots (and of other rounds) are independent of everything a
    device or a coalition of devices learns (each its own draws), with the key's whole 256 bits; the seeded stream
    is MT19937 under a 64-bit seed, whose state a coalition's observed draws narrow down. Integer arithmetic only:
    any implementation given the key (the simulator, another server, a test) draws exactly these slots."""
    if len(key) < 16:
        raise InternalError("a sampling key has at least 128 bits")
    bar = int(fraction * 2**64)  # fraction < 1 as a float64: fraction x 2^64 is exact, its floor an integer
    head = DRAW_LABEL + int(t).to_bytes(8, "big")
    return frozenset(i for i in range(num_clients)
                     if int.from_bytes(hmac.digest(key, head + i.to_bytes(8, "big"), hashlib.sha256)[:8], "big") < bar)
