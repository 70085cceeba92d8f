"""Every random source of a run derives from one seed, here.

A stream is named by a label plus integers (``stream(seed, "shuffle", round, client)``), so that adding a new
consumer of randomness never shifts the numbers another consumer sees, and the same seed gives, for example, the
same client sampling to every algorithm.
"""

from __future__ import annotations

import hashlib
import random
from enum import StrEnum

import numpy as np
import torch

__all__ = ["Stream", "derive_seed", "generator", "numpy_rng", "seed_everything", "stream"]


def derive_seed(seed: int, label: str, *index: int) -> int:
    """A 63-bit seed for the stream ``label`` / ``index`` of run seed ``seed`` (stable across platforms)."""
    text = ":".join([str(int(seed)), label, *(str(int(i)) for i in index)])
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(seed: int, label: str, *index: int) -> torch.Generator:
    """A CPU ``torch.Generator`` for one named stream."""
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


def stream(seed: int, name: Stream, *index: int) -> torch.Generator:
    return generator(seed, name.value, *index)
