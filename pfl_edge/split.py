"""FedPer's layer split: the last K_P blocks are personal, the rest is the shared base.

The base holds every parameter *and buffer* of the base blocks, so K_P = 0 is exactly FedAvg. With
``local_norm_stats`` the running statistics of base blocks stay on the device (FedBN-style); models with
GroupNorm have none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .arrays import Array as Tensor
from .errors import ConfigError

if TYPE_CHECKING:
    from .models.blocks import BlockModel

__all__ = ["Split", "split_keys", "take"]


@dataclass(frozen=True)
class Split:
    """State-dict keys of the shared base and of the personal part, each in state-dict order."""

    base: tuple[str, ...]
    personal: tuple[str, ...]
    personal_blocks: tuple[str, ...]


def split_keys(model: BlockModel, kp: int, *, local_norm_stats: bool = False) -> Split:
    names = model.block_names
    if not 0 <= kp <= len(names):
        raise ConfigError(f"kp must be between 0 and {len(names)} (the model's blocks: {names}), got {kp}")
    personal_blocks = set(names[len(names) - kp:])
    owner = model.block_of()
    buffers = {k for k, _ in model.named_buffers()}
    base: list[str] = []
    personal: list[str] = []
    for key in model.state_dict():
        is_personal = owner[key] in personal_blocks or (local_norm_stats and key in buffers)
        (personal if is_personal else base).append(key)
    return Split(tuple(base), tuple(personal), tuple(n for n in names if n in personal_blocks))


def take(state: Mapping[str, Tensor], keys: Iterable[str]) -> dict[str, Tensor]:
    """The sub-dict of ``state`` with ``keys`` (in that order); a missing key is an error that names it."""
    out: dict[str, Tensor] = {}
    for k in keys:
        if k not in state:
            raise ConfigError(f"state has no tensor {k!r}")
        out[k] = state[k]
    return out
