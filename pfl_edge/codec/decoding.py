"""Decoding a payload, trusting nothing (see :mod:`pfl_edge.codec` for the layout).

Everything is numpy until the end, where the arrays become torch tensors (zero-copy) unless numpy arrays were
asked for; only then is torch imported, so a process without torch decodes with ``arrays="numpy"``."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from pfl_edge.errors import CodecError

from .header import _Entry, _header_limit, _parse_header
from .layout import _PREFIX, _SHA_LEN, DEFAULT_MAX_BYTES, FORMAT_VERSION, MAGIC, Decoded, NDArray
from .masks import _read_mask


def decode(
    payload: bytes,
    *,
    expected: Mapping[str, Sequence[int]] | None = None,
    model_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    allow_missing: bool = False,
    arrays: Literal["torch", "numpy"] = "torch",
) -> Decoded:
    """The tensors in ``payload``, after checking it whole. ``expected`` (name -> shape) is what may arrive: any
    other name or shape is refused, and so is a missing one unless ``allow_missing``; ``model_id`` must match when
    given. ``max_bytes`` bounds the payload and the dense float32 size of what it decodes to. ``arrays`` says what
    the tensors and masks are: torch tensors (the default), or numpy arrays (float32 and bool, the same values and
    shapes; torch is then not imported)."""
    if arrays not in ("torch", "numpy"):
        raise CodecError(f"arrays must be 'torch' or 'numpy', got {arrays!r}")
    buf = _bytes(payload)
    size = buf.nbytes
    if size > max_bytes:
        raise CodecError(f"payload of {size} bytes is over the limit of {max_bytes} bytes")
    if size < _PREFIX.size + _SHA_LEN:
        raise CodecError(f"payload truncated: {size} bytes, shorter than the fixed {_PREFIX.size + _SHA_LEN}")
    magic, version, head_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CodecError(f"not a pfl-edge payload: starts with {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported payload format version {version}; this build reads version {FORMAT_VERSION}")
    data_start = _PREFIX.size + head_len
    if data_start + _SHA_LEN > size:
        raise CodecError(f"payload truncated: header of {head_len} bytes does not fit in {size} bytes")
    head_limit = _header_limit(expected)
    if head_len > head_limit:
        raise CodecError(f"malformed header: {head_len} bytes, over the limit of {head_limit} for "
                         f"{'the expected tensors' if expected is not None else 'any payload'}")
    if hashlib.sha256(buf[: size - _SHA_LEN]).digest() != bytes(buf[size - _SHA_LEN :]):
        raise CodecError("payload corrupt or truncated: sha256 does not match")

    header = _parse_header(buf[_PREFIX.size : data_start], max_bytes, expected)
    data = buf[data_start : size - _SHA_LEN]
    end = header.entries[-1].end if header.entries else 0
    if end != data.nbytes:
        raise CodecError(f"malformed header: tensors cover {end} bytes of data, the payload holds {data.nbytes}")
    if model_id is not None and header.model != model_id:
        raise CodecError(f"payload is for model {header.model!r}, expected {model_id!r}")
    _check_expected(header.entries, expected, allow_missing)

    tensors, masks = _read_entries(header.entries, data)
    if arrays == "numpy":
        return Decoded(tensors=tensors, masks=masks, model_id=header.model, round=header.round)
    import torch  # only here: a device without torch asks for numpy arrays

    return Decoded(tensors={k: torch.from_numpy(v) for k, v in tensors.items()},
                   masks={k: torch.from_numpy(v) for k, v in masks.items()}, model_id=header.model, round=header.round)


def _read_entries(entries: Sequence[Any], data: memoryview) -> tuple[dict[str, NDArray], dict[str, NDArray]]:
    """Every entry's dense float32 values (zeros off its mask) and, for the sparse ones, its bool mask."""
    tensors: dict[str, NDArray] = {}
    masks: dict[str, NDArray] = {}
    for e in entries:
        values = _read_values(e, data)
        if e.coding is None:
            tensors[e.name] = values.reshape(e.shape)
            continue
        bits, ones_at = _read_mask(e, data[e.offset + e.nbytes : e.end])
        if e.ones == e.numel:
            dense = values
        else:
            dense = np.zeros(e.numel, dtype=np.float32)
            dense[ones_at] = values  # positions, not the bool mask: several times faster
        tensors[e.name] = dense.reshape(e.shape)
        masks[e.name] = bits.reshape(e.shape)
    return tensors, masks


def _bytes(payload: object) -> memoryview:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        return memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"payload is not a contiguous byte buffer ({exc})") from None


def _check_expected(entries: list[_Entry], expected: Mapping[str, Sequence[int]] | None, allow_missing: bool) -> None:
    if expected is None:
        return
    got = {e.name: e.shape for e in entries}
    unexpected = sorted(set(got) - set(expected))
    if unexpected:
        raise CodecError(f"payload holds unexpected tensors {unexpected}")
    missing = sorted(set(expected) - set(got))
    if missing and not allow_missing:
        raise CodecError(f"payload is missing tensors {missing}")
    for name, shape in got.items():
        want = tuple(int(s) for s in expected[name])
        if shape != want:
            raise CodecError(f"tensor {name!r} has shape {shape}, expected {want}")


def _read_values(e: _Entry, data: memoryview) -> NDArray:
    count = e.nbytes // e.dtype.itemsize
    raw = np.frombuffer(data, dtype=e.dtype, count=count, offset=e.offset)
    values = raw.astype(np.float32)  # always a copy: the payload is read-only and maybe unaligned
    if not np.isfinite(values).all():
        raise CodecError(f"tensor {e.name!r} holds NaN or Inf")
    return values
