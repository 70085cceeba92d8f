"""Every random source of a run derives from one seed, here.

A stream is named by a label plus integers (``stream(seed, "shuffle", round, client)``), so that adding a new
consumer of randomness never shifts the numbers another consumer sees, and the same seed gives, for example, the
same client sampling to every algorithm.
"""

from __future__ import annotations

import hashlib
import random
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from .compat import StrEnum

if TYPE_CHECKING:  # torch is imported where a torch generator is made: a device without torch draws through MT
    import torch

__all__ = ["MT", "Stream", "derive_seed", "generator", "mt_stream", "numpy_rng", "seed_everything", "stream"]


def derive_seed(seed: int, label: str, *index: int) -> int:
    """A 63-bit seed for the stream ``label`` / ``index`` of run seed ``seed`` (stable across platforms)."""
    text = ":".join([str(int(seed)), label, *(str(int(i)) for i in index)])
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, label: str, *index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for one named stream."""
    import torch

    gen = torch.Generator()
    gen.manual_seed(derive_seed(seed, label, *index))
    return gen


def numpy_rng(seed: int, label: str, *index: int) -> np.random.Generator:
    """A NumPy generator for one named stream."""
    return np.random.default_rng(derive_seed(seed, label, *index))


def seed_everything(seed: int) -> None:
    """Seed the global generators too, for library code that draws from them without a generator argument."""
    random.seed(derive_seed(seed, "python"))
    np.random.seed(derive_seed(seed, "numpy") % (1 << 32))
    try:
        import torch
    except ImportError:  # a torch-free device: nothing of torch's to seed
        return
    torch.manual_seed(derive_seed(seed, "torch"))


class Stream(StrEnum):
    """The named random streams of a federation: each consumer draws from its own, so the simulator and a device
    draw the same numbers for the same client and round."""

    PARTITION = "partition"  # (): who gets which sample
    INIT = "init"  # (): the initial model
    PARTICIPANTS = "participants"  # (t): the clients of a round, when participation < 1
    TOPOLOGY = "topology"  # (t): the round's neighbour graph
    MASK = "mask"  # (slot): a DisPFL client's initial mask
    TRAIN = "train"  # (t, slot): batches of local training
    FINETUNE = "finetune"  # (t, slot): batches of fine-tuning (FedPer-FT, -FT evaluation)
    REGROW = "regrow"  # (t, slot): the batch of the dense-gradient regrowth screen
    REGROW_RANDOM = "regrow-random"  # (t, slot): random regrowth
    PERSONAL = "personal"  # (t, slot): batches of a second, personal model's training (Ditto)
    HOLDOUT = "holdout"  # (slot): which of a device's own images it holds out for testing
    DP_NOISE = "dp-noise"  # (t, slot): a device's share of the noise (distributed DP, secret_noise = false)


def stream(seed: int, name: Stream, *index: int) -> torch.Generator:
    return generator(seed, name.value, *index)


class MT:
    """The numbers a CPU ``torch.Generator`` seeded with ``seed`` draws, drawn with numpy alone, so that a device
    without torch takes exactly the simulator's batches and masks for its slot.

    torch's CPU generator is a 32-bit Mersenne Twister seeded as ``init_genrand(seed mod 2**32)`` (as numpy's
    ``RandomState`` seeds it). ``torch.randperm(n)`` (n < 2**32 / 20) is a Fisher-Yates shuffle of ``arange(n)``
    swapping ``r[i]`` with ``r[i + u_i mod (n - i)]`` for i < n - 1, one 32-bit draw each; ``torch.rand`` in
    float32 is ``(u & (2**24 - 1)) * 2**-24`` per element. tests/pfl_edge/test_seeding.py holds every method to
    torch's own draws, call after call on one generator. The shuffle is a Python loop over its swaps: fine for a
    client's samples, a few seconds for a ResNet-18's initial masks on a board."""

    _MAX_PERM = (2**32 - 1) // 20  # beyond this torch draws 64 bits per swap (never reached by a client's data)

    def __init__(self, seed: int) -> None:
        # RandomState(s) seeds MT19937 as init_genrand(s), as torch does; its state moves to a bit generator whose
        # random_raw gives the 32-bit draws
        legacy: Any = np.random.RandomState(int(seed) & 0xFFFFFFFF).get_state()
        self._bits = np.random.MT19937()
        self._bits.state = {"bit_generator": "MT19937", "state": {"key": legacy[1], "pos": legacy[2]}}

    def randperm(self, n: int) -> NDArray[np.int64]:
        """``torch.randperm(n, generator=g)``, as int64."""
        if not 0 <= n < self._MAX_PERM:
            raise ValueError(f"randperm of {n} is out of the range drawn like torch (0 <= n < {self._MAX_PERM})")
        out = np.arange(n, dtype=np.int64)
        if n < 2:
            return out
        z = self._bits.random_raw(n - 1).astype(np.int64) % np.arange(n, 1, -1, dtype=np.int64)
        for i, j in enumerate((z + np.arange(n - 1)).tolist()):  # sequential: each swap sees the last
            out[i], out[j] = out[j], out[i]
        return out

    def randperm_head(self, n: int, k: int) -> NDArray[np.int64]:
        """``torch.randperm(n, generator=g)[:k]``, moving the generator as the whole permutation does: a swap
        only touches positions at or after its own, so the first k are final after k swaps (O(k) Python work,
        where a neighbour draw of k among a thousand clients would otherwise loop a thousand times)."""
        if not 0 <= n < self._MAX_PERM:
            raise ValueError(f"randperm of {n} is out of the range drawn like torch (0 <= n < {self._MAX_PERM})")
        k = max(0, min(k, n))
        if n < 2:
            self._bits.random_raw(0)
            return np.arange(n, dtype=np.int64)[:k]
        raw = self._bits.random_raw(n - 1)  # every swap's draw, as randperm(n) takes them
        moved: dict[int, int] = {}  # the positions a swap has written, others still hold their own index
        out = np.empty(k, dtype=np.int64)
        for i in range(min(k, n - 1)):
            j = i + int(raw[i]) % (n - i)
            vi, vj = moved.get(i, i), moved.get(j, j)
            moved[i], moved[j] = vj, vi
            out[i] = vj
        if k == n:  # the last position is never a swap's i
            out[n - 1] = moved.get(n - 1, n - 1)
        return out

    def skip(self, n: int) -> None:
        """Move past ``n`` 32-bit draws without making them into numbers (C-speed: a data set's noise, where only
        its labels are wanted)."""
        self._bits.random_raw(n, output=False)

    def rand24(self, n: int) -> NDArray[np.uint64]:
        """The integers k of ``rand(n)``'s draws (each is ``k * 2**-24``): sums of them are exact."""
        return np.bitwise_and(self._bits.random_raw(n), np.uint64(0xFFFFFF))

    def rand(self, n: int) -> NDArray[np.float32]:
        """``torch.rand(n, generator=g)`` in float32."""
        raw = self._bits.random_raw(n)
        return (raw & 0xFFFFFF).astype(np.float32) * np.float32(2.0**-24)


def mt_stream(seed: int, name: Stream, *index: int) -> MT:
    """The stream ``stream`` gives, as numpy draws (``MT``): the same numbers without torch."""
    return MT(derive_seed(seed, name.value, *index))
