"""Byte accounting for what travels between nodes.

Until the wire codec exists, a payload's size is its tensors' raw bytes (float32: 4 per element), header not
included; every figure that uses it says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

__all__ = ["dense_bytes"]


def dense_bytes(state: Mapping[str, Tensor]) -> int:
    return sum(int(t.numel()) * t.element_size() for t in state.values())
