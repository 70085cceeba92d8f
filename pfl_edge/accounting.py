"""Byte accounting: what a message would cost on a real network, taken from the wire codec itself."""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from .codec import encoded_size

__all__ = ["payload_bytes"]


def payload_bytes(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor] | None = None) -> int:
    """Bytes of the payload that carries ``tensors`` (sparse where ``masks`` say so), header and checksum
    included: exactly ``len(codec.encode(...))``."""
    return encoded_size(tensors, masks=masks)
