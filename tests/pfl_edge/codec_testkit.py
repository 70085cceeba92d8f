"""Helpers shared by the codec tests (``test_codec_*.py``).

They parse and rebuild payloads from the documented layout (not from the module's internals), so the tests also
pin the format down.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import torch

from pfl_edge.codec import encode

PREFIX = struct.Struct("<4sBI")  # magic, version, header length
SHA = 32


def split(payload: bytes) -> tuple[bytes, int, dict[str, Any], bytes]:
    """(magic, version, header, data) of a well-formed payload."""
    magic, version, head_len = PREFIX.unpack_from(payload, 0)
    head = json.loads(payload[PREFIX.size : PREFIX.size + head_len])
    assert hashlib.sha256(payload[:-SHA]).digest() == payload[-SHA:]
    return magic, version, head, payload[PREFIX.size + head_len : -SHA]


def build(
    header: Any, data: bytes, *, magic: bytes = b"PFLE", version: int = 1, raw_header: bytes | None = None
) -> bytes:
    """A payload with a valid sha256 around whatever header and data we choose."""
    head = json.dumps(header, separators=(",", ":")).encode() if raw_header is None else raw_header
    body = PREFIX.pack(magic, version, len(head)) + head + data
    return body + hashlib.sha256(body).digest()



def bernoulli(shape: tuple[int, ...], p: float, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p


def sample() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A small payload with a dense tensor and one sparse tensor for each mask coding."""
    g = torch.Generator().manual_seed(1)
    tensors = {
        "dense": torch.randn(3, 4, generator=g),
        "low": torch.randn(200, generator=g),
        "half": torch.randn(10, 10, generator=g),
        "high": torch.randn(150, generator=g),
        "scalar": torch.tensor(2.5),
    }
    masks = {"low": bernoulli((200,), 0.05, 2), "half": bernoulli((10, 10), 0.5, 3), "high": bernoulli((150,), 0.9, 4)}
    return tensors, masks


SAMPLE = encode(sample()[0], model_id="cnn", round=7, masks=sample()[1])
