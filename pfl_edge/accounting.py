"""Byte accounting: what a message would cost on a real network, taken from the wire codec itself."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .codec import encoded_size

__all__ = ["payload_bytes"]


def payload_bytes(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor] | None = None) -> int:
    """Bytes of the payload that carries ``tensors`` (sparse where ``masks`` say so), header and checksum
    included: exactly ``len(codec.encode(...))``. Integer buffers (BatchNorm's batch counter) travel as
    float32, as the codec carries floats only."""
    floats = {k: v if v.is_floating_point() else v.to(torch.float32) for k, v in tensors.items()}
    return encoded_size(floats, masks=masks)
