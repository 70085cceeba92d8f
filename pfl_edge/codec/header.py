"""Parsing and checking a payload's JSON header (see :mod:`pfl_edge.codec` for the layout)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pfl_edge.errors import CodecError

from .layout import (
    _CODINGS,
    _DENSE_LEN,
    _DIM_BYTES,
    _DTYPES,
    _ENTRY_BYTES,
    _MAX_K,
    _MAX_NDIM,
    _SPARSE_LEN,
    MAX_HEADER_BYTES,
)


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: np.dtype[Any]
    offset: int
    nbytes: int
    coding: str | None = None  # None: dense
    k: int = 0
    ones: int = 0
    mask_nbytes: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.nbytes + self.mask_nbytes


@dataclass(frozen=True)
class _Header:
    model: str
    round: int
    entries: list[_Entry]


def _bad(why: str) -> CodecError:
    return CodecError(f"malformed header: {why}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _bad(f"duplicate keys in {keys}")
    return dict(pairs)


def _no_constant(name: str) -> None:
    raise _bad(f"{name} is not valid here")


def _header_limit(expected: Mapping[str, Sequence[int]] | None) -> int:
    """The most header bytes a payload may have: what the expected tensors' entries can take (names escaped at
    up to 6 bytes a character), else :data:`MAX_HEADER_BYTES`."""
    if expected is None:
        return MAX_HEADER_BYTES
    return 4096 + sum(_ENTRY_BYTES + 6 * len(name) + _DIM_BYTES * len(shape) for name, shape in expected.items())


def _parse_header(raw: memoryview, max_bytes: int, expected: Mapping[str, Sequence[int]] | None = None) -> _Header:
    """The header, checked; with ``expected``, it may list no more tensors than that (checked before any entry)."""
    try:
        obj = json.loads(str(raw, "utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except CodecError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _bad(f"not JSON ({exc})") from None
    if not isinstance(obj, dict) or set(obj) != {"model", "round", "tensors"}:
        raise _bad("expected an object with exactly the fields model, round and tensors")
    model, rnd, items = obj["model"], obj["round"], obj["tensors"]
    if not isinstance(model, str):
        raise _bad("model is not a string")
    if not _is_int(rnd) or rnd < 0:
        raise _bad(f"round {rnd!r} is not a non-negative integer")
    if not isinstance(items, list):
        raise _bad("tensors is not a list")
    if expected is not None and len(items) > len(expected):
        listed = {it[0] for it in items if isinstance(it, list) and it and isinstance(it[0], str)}
        raise CodecError(f"payload holds unexpected tensors {sorted(listed - set(expected))[:20]!r:.2000} "
                         f"({len(items)} listed, {len(expected)} expected)")
    entries: list[_Entry] = []
    names: set[str] = set()
    end = 0
    dense_total = 0
    for item in items:
        e = _parse_entry(item, max_bytes)
        if e.name in names:
            raise _bad(f"tensor {e.name!r} appears twice")
        names.add(e.name)
        # sections are back to back in header order: this rules out gaps, overlaps and reordering in one check
        if e.offset != end:
            raise _bad(f"tensor {e.name!r} starts at byte {e.offset} of data, expected {end}")
        dense_total += 4 * e.numel
        if dense_total > max_bytes:
            raise _bad(f"the tensors would decode to over {max_bytes} bytes (max_bytes); {e.name!r} has {e.shape}")
        end = e.end
        entries.append(e)
    return _Header(model=model, round=rnd, entries=entries)


_MAX_ELEMENTS = 2**63 - 1  # what torch (and any int64 index) can address


def _parse_entry(item: object, max_bytes: int) -> _Entry:
    if not isinstance(item, list) or len(item) not in (_DENSE_LEN, _SPARSE_LEN):
        raise _bad(f"a tensor entry must be a list of {_DENSE_LEN} or {_SPARSE_LEN} fields, got {item!r:.200}")
    name, shape, dtype, offset, nbytes = item[:_DENSE_LEN]
    if not isinstance(name, str):
        raise _bad(f"tensor name {name!r:.100} is not a string")
    if (
        not isinstance(shape, list)
        or len(shape) > _MAX_NDIM
        or not all(_is_int(s) and 0 <= s <= max_bytes for s in shape)  # a longer side is absurd even if empty
    ):
        raise _bad(
            f"tensor {name!r} has an invalid shape {shape!r:.200}: at most {_MAX_NDIM} dimensions, each an integer"
            f" from 0 to max_bytes ({max_bytes})"
        )
    numel = math.prod(shape)
    if math.prod(s for s in shape if s) > _MAX_ELEMENTS:  # an empty tensor still has to be reshapeable
        raise _bad(
            f"tensor {name!r} has an invalid shape {shape!r:.200}: its non-zero dimensions multiply past 2^63 - 1"
        )
    if not isinstance(dtype, str) or dtype not in _DTYPES:  # a list or object would not even hash
        raise _bad(f"tensor {name!r} has value dtype {dtype!r:.100}; known: {sorted(_DTYPES)}")
    for field, value in (("offset", offset), ("length", nbytes)):
        if not _is_int(value) or value < 0:
            raise _bad(f"tensor {name!r} has an invalid {field} {value!r:.100}")
    dt = _DTYPES[dtype]
    if len(item) == _DENSE_LEN:
        if nbytes != numel * dt.itemsize:
            raise _bad(
                f"dense tensor {name!r} of shape {shape} needs {numel * dt.itemsize} bytes, header says {nbytes}"
            )
        return _Entry(name, tuple(shape), numel, dt, offset, nbytes)
    coding, k, ones, mask_nbytes = item[_DENSE_LEN:]
    if not isinstance(coding, str) or coding not in _CODINGS:
        raise _bad(f"tensor {name!r} has mask coding {coding!r:.100}; known: {list(_CODINGS)}")
    if not _is_int(k) or not 0 <= k <= (0 if coding == "bitmap" else _MAX_K):
        raise _bad(f"tensor {name!r} has an invalid Rice parameter {k!r:.100}")
    if not _is_int(ones) or not 0 <= ones <= numel:
        raise _bad(f"tensor {name!r} of {numel} elements has an invalid count of ones {ones!r:.100}")
    if nbytes != ones * dt.itemsize:
        raise _bad(f"tensor {name!r} has {ones} ones in its mask but {nbytes} bytes of {dtype} values")
    if not _is_int(mask_nbytes) or mask_nbytes < 0:
        raise _bad(f"tensor {name!r} has an invalid mask length {mask_nbytes!r:.100}")
    _check_mask_size(name, numel, coding, k, ones, mask_nbytes)
    return _Entry(name, tuple(shape), numel, dt, offset, nbytes, coding, k, ones, mask_nbytes)


def _check_mask_size(name: str, n: int, coding: str, k: int, ones: int, nbytes: int) -> None:
    """A mask's byte length against what its coding can take for a tensor of ``n`` elements, checked before
    anything is allocated (decoding costs several times a mask's length). Bitmap: exactly ``ceil(n / 8)``.
    Rice with ``c`` codewords and parameter ``k``: each codeword takes ``k`` remainder bits and ``q + 1``
    quotient bits, and the gaps sum to at most ``n - c``, so ``ceil(c (k + 1) / 8)`` to
    ``ceil((c (k + 1) + ((n - c) >> k)) / 8)`` bytes; ``k`` is at most one above the encoder's choice for the
    mean gap (``floor(log2(n / c)) + 1``), which bounds the remainders too; and no Rice stream is longer than
    the bitmap would be."""
    if coding == "bitmap":
        if nbytes != (n + 7) // 8:
            raise _bad(f"tensor {name!r} of {n} elements has a bitmap of {nbytes} bytes, expected {(n + 7) // 8}")
        return
    c = ones if coding == "rice1" else n - ones
    if c == 0:
        if nbytes:
            raise _bad(f"tensor {name!r} has a mask stream of {nbytes} bytes where no codeword is expected")
        return
    k_max = (n // c).bit_length() + 1
    if k > k_max:
        raise _bad(f"tensor {name!r}: Rice parameter {k} for {c} codewords over {n} elements; at most {k_max}")
    lo = (c * (k + 1) + 7) // 8
    # and never longer than the bitmap: the encoder sends a Rice code only where it is the shorter one
    hi = min((c * (k + 1) + ((n - c) >> k) + 7) // 8, (n + 7) // 8)
    if nbytes < lo:
        raise _bad(f"tensor {name!r}: a mask stream of {nbytes} bytes is too short for {c} codewords with k={k}")
    if nbytes > hi:
        raise _bad(f"tensor {name!r}: a mask stream of {nbytes} bytes for {c} codewords with k={k} over {n} "
                   f"elements; at most {hi} bytes fit, more would point past the end of the tensor")
