"""Versioned binary wire format for a set of named float tensors: what every payload of pfl-edge is on the wire.

No pickle: a payload is plain bytes that any language can parse.

Layout (all integers little-endian)::

    prefix   b"PFLE" | version: u8 | header length: u32          (9 bytes)
    header   compact JSON, UTF-8 (ASCII in practice):
             {"model": str, "round": int, "tensors": [entry, ...]}
             dense entry:  [name, shape, dtype, offset, nbytes]
             sparse entry: [name, shape, dtype, offset, nbytes, coding, k, ones, mask_nbytes]
    data     per tensor, in header order and back to back: its values (``nbytes``), then for a sparse tensor its
             coded mask (``mask_nbytes``); ``offset`` is where the values start, counted from the start of data
    trailer  sha256 of everything before it                        (32 bytes)

``dtype`` is "f4" (float32) or "f2" (float16). Values are in row-major order; a sparse tensor sends only the values
where its mask is 1. ``coding`` says how the mask is sent:

- "bitmap": n bits, most significant bit first (``np.packbits``), padded with zero bits to a whole byte;
- "rice1" / "rice0": Golomb–Rice codes with parameter ``k`` of the gaps (runs of the other symbol) before each 1
  (rice1) or each 0 (rice0); the trailing run is implied by n. For vectorised decoding the codewords are split in
  two bit streams written one after the other: first every gap's k-bit remainder (fixed width, MSB first), then
  every gap's unary quotient (q ones then a zero), then one-bits to a whole byte (so the stream holds exactly
  as many zeros as codewords, and a count that doesn't match is always caught). The zeros of the quotient stream
  are exactly the codeword ends, so decoding is ``np.flatnonzero`` and ``np.cumsum``.

The encoder picks whichever of these is smallest (exact sizes), which stays within a few percent of the entropy of
the mask at any density. ``ones`` is the number of ones in the mask and must equal the number of values sent.

Decoding trusts nothing: every refusal is a :class:`~pfl_edge.errors.CodecError` saying what was wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from pfl_edge.errors import CodecError

__all__ = ["DEFAULT_MAX_BYTES", "FORMAT_VERSION", "Decoded", "decode", "encode", "encoded_size"]

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

MAGIC = b"PFLE"
_PREFIX = struct.Struct("<4sBI")
_SHA_LEN = 32
_DTYPES: dict[str, np.dtype[Any]] = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
_VALUE_DTYPES = {"float32": "f4", "float16": "f2"}
_CODINGS = ("bitmap", "rice1", "rice0")
_MAX_NDIM = 64  # torch's own limit on dimensions
_MAX_K = 62  # a Rice remainder must fit an int64 with room for the quotient
_DENSE_LEN, _SPARSE_LEN = 5, 9

NDArray = np.ndarray[Any, Any]


@dataclass(frozen=True, eq=False)
class Decoded:
    """What a payload carried. ``tensors`` are dense float32 (zeros outside the mask for sparse ones); ``masks``
    has a torch.bool mask for every tensor that was sent sparse."""

    tensors: dict[str, torch.Tensor]
    masks: dict[str, torch.Tensor]
    model_id: str
    round: int


# ---------------------------------------------------------------------------------------------------------- encoding


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    model_id: str,
    round: int,
    masks: Mapping[str, torch.Tensor] | None = None,
    value_dtype: Literal["float32", "float16"] = "float32",
) -> bytes:
    """The payload for ``tensors``: dense, except those named in ``masks`` (bool or 0/1 tensors of the same shape),
    which are sent as their values where the mask is 1 plus the coded mask. The same input gives the same bytes."""
    if not isinstance(model_id, str):
        raise CodecError(f"model_id must be a str, got {type(model_id).__name__}")
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise CodecError(f"round must be a non-negative int, got {round!r}")
    if value_dtype not in _VALUE_DTYPES:
        raise CodecError(f"value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {value_dtype!r}")
    dtype = _VALUE_DTYPES[value_dtype]
    masks = {} if masks is None else masks
    unknown = sorted(set(masks) - set(tensors))
    if unknown:
        raise CodecError(f"masks given for tensors that are not sent: {unknown}")

    entries: list[list[Any]] = []
    data: list[Any] = []  # buffers (bytes or contiguous arrays), written in order
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {name!r}")
        arr = _as_float32(name, tensor)
        shape = list(arr.shape)
        flat = arr.reshape(-1)
        mask = masks.get(name)
        if mask is None:
            values = _values(name, flat, dtype)
            entries.append([name, shape, dtype, offset, values.nbytes])
            data.append(values)
            offset += values.nbytes
            continue
        bits = _as_mask(name, mask, tuple(arr.shape))
        coding, k, stream, positions = _code_mask(bits)
        # fancy indexing with positions is several times faster than boolean indexing here
        active = flat[positions if positions is not None else np.flatnonzero(bits)]
        values = _values(name, active, dtype)
        entries.append([name, shape, dtype, offset, values.nbytes, coding, k, int(active.size), stream.nbytes])
        data += [values, stream]
        offset += values.nbytes + stream.nbytes

    header = json.dumps({"model": model_id, "round": round, "tensors": entries}, separators=(",", ":"))
    head = header.encode("ascii")  # json.dumps escapes everything else, so this cannot fail
    parts: list[Any] = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head, *data]
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part)
    parts.append(sha.digest())
    return b"".join(parts)


def encoded_size(
    tensors: Mapping[str, torch.Tensor],
    *,
    masks: Mapping[str, torch.Tensor] | None = None,
    value_dtype: Literal["float32", "float16"] = "float32",
) -> int:
    """``len(encode(...))`` for these tensors (with an empty model id and round 0)."""
    return len(encode(tensors, model_id="", round=0, masks=masks, value_dtype=value_dtype))


def _as_float32(name: str, tensor: torch.Tensor) -> NDArray:
    if not isinstance(tensor, torch.Tensor):
        raise CodecError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise CodecError(f"tensor {name!r} has layout {tensor.layout}; send it dense with a mask instead")
    if not tensor.is_floating_point():
        raise CodecError(f"tensor {name!r} has dtype {tensor.dtype}; only floating-point tensors can be sent")
    # zero-copy for a contiguous float32 CPU tensor, which is what models hold
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def _values(name: str, values: NDArray, dtype: str) -> NDArray:
    with np.errstate(over="ignore"):  # an overflow to inf is refused just below, with a clearer message
        out = values.astype(_DTYPES[dtype], copy=False)
    # checked after the cast: a finite float32 beyond float16's range becomes inf
    if not np.isfinite(out).all():
        what = "NaN or Inf" if dtype == "f4" else "NaN, Inf or a value outside float16's range"
        raise CodecError(f"tensor {name!r} holds {what}; refusing to send it")
    return np.ascontiguousarray(out)


def _as_mask(name: str, mask: torch.Tensor, shape: tuple[int, ...]) -> NDArray:
    if not isinstance(mask, torch.Tensor):
        raise CodecError(f"mask of {name!r} is a {type(mask).__name__}, not a torch.Tensor")
    if tuple(mask.shape) != shape:
        raise CodecError(f"mask of {name!r} has shape {tuple(mask.shape)}, the tensor has {shape}")
    if mask.dtype != torch.bool:
        if mask.is_complex():
            raise CodecError(f"mask of {name!r} is complex; masks are bool or 0/1")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise CodecError(f"mask of {name!r} holds values other than 0 and 1")
        mask = mask != 0
    return mask.detach().cpu().contiguous().numpy().reshape(-1)


def _code_mask(bits: NDArray) -> tuple[str, int, NDArray, NDArray | None]:
    """The smallest coding of a flat bool mask: (coding, k, stream bytes, positions of the ones if computed)."""
    n = bits.size
    ones = int(np.count_nonzero(bits))
    best: tuple[int, str, int] = ((n + 7) // 8, "bitmap", 0)
    gaps: dict[str, NDArray] = {}
    ones_at: NDArray | None = None
    for coding, symbol, count in (("rice1", True, ones), ("rice0", False, n - ones)):
        if count == 0:
            cost = 0
            k = 0
        elif 2 * count >= n:
            # every codeword takes >= k + 1 bits, so only k = 0 can beat the n-bit bitmap; its cost is exactly the
            # position of the last symbol + 1 bits (it is the bitmap of the other symbol up to there)
            cost, k = _last(bits, symbol) + 1, 0
            if cost >= n:
                continue
        else:
            at = np.flatnonzero(bits) if symbol else np.flatnonzero(~bits)
            if symbol:
                ones_at = at
            d = _gaps(at)
            gaps[coding] = d
            cost, k = _rice_cost(d)
        nbytes = (cost + 7) // 8
        if nbytes < best[0]:
            best = (nbytes, coding, k)
    _, coding, k = best
    if coding == "bitmap":
        return coding, 0, np.packbits(bits), ones_at
    if coding not in gaps:  # the k = 0 shortcut or an empty stream: gaps not computed yet
        at = np.flatnonzero(bits) if coding == "rice1" else np.flatnonzero(~bits)
        if coding == "rice1":
            ones_at = at
        gaps[coding] = _gaps(at)
    return coding, k, _rice_encode(gaps[coding], k), ones_at


def _gaps(at: NDArray) -> NDArray:
    """How many positions each of the increasing positions ``at`` skips since the previous one (or the start)."""
    d = np.empty(at.size, dtype=np.int64)
    if at.size:  # same as np.diff(at, prepend=-1) - 1, without the concatenation and the extra pass
        d[0] = at[0]
        np.subtract(at[1:], at[:-1], out=d[1:])
        d[1:] -= 1
    return d


def _last(bits: NDArray, symbol: bool) -> int:
    """Position of the last ``symbol`` in ``bits`` (which holds at least one)."""
    rev = bits[::-1]
    return bits.size - 1 - int(np.argmax(rev if symbol else ~rev))


def _rice_cost(d: NDArray) -> tuple[int, int]:
    """(bits, k) of the cheapest Rice code for gaps ``d``, trying the k around log2 of the mean gap, where the
    optimum for geometric gaps lies (about log2(mean · ln 2))."""
    g = d.size
    centre = math.floor(math.log2(float(d.mean()) + 1.0))
    best = (-1, 0)
    for k in range(max(0, centre - 1), min(_MAX_K, centre + 1) + 1):
        bits = g * (k + 1) + int(np.sum(d >> k))
        if best[0] < 0 or bits < best[0]:
            best = (bits, k)
    return best


def _rice_encode(d: NDArray, k: int) -> NDArray:
    """Remainder stream, quotient stream, one-bits to a whole byte; packed MSB first."""
    q = d >> k
    rem_len = d.size * k
    ends = np.cumsum(q + 1) + (rem_len - 1)  # where each unary codeword's terminating zero falls
    used = int(ends[-1]) + 1 if d.size else 0
    bits = np.ones(used + (-used) % 8, dtype=np.uint8)
    bits[ends] = 0
    if k:
        small = np.dtype(np.uint8 if k <= 8 else np.uint16 if k <= 16 else np.uint32 if k <= 32 else np.uint64)
        r: NDArray = (d & ((1 << k) - 1)).astype(small)  # narrow, so the (g, k) temporaries stay small
        shifts: NDArray = np.arange(k - 1, -1, -1, dtype=small)
        bits[:rem_len] = ((r[:, None] >> shifts) & 1).reshape(-1)
    return np.packbits(bits)


# ---------------------------------------------------------------------------------------------------------- decoding


def decode(
    payload: bytes,
    *,
    expected: Mapping[str, Sequence[int]] | None = None,
    model_id: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    allow_missing: bool = False,
) -> Decoded:
    """The tensors in ``payload``, after checking it whole. ``expected`` (name -> shape) is what may arrive: any
    other name or shape is refused, and so is a missing one unless ``allow_missing``; ``model_id`` must match when
    given. ``max_bytes`` bounds the payload and the dense float32 size of what it decodes to."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        buf = memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:  # e.g. a non-contiguous memoryview
        raise CodecError(f"payload is not a contiguous byte buffer ({exc})") from None
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
    if hashlib.sha256(buf[: size - _SHA_LEN]).digest() != bytes(buf[size - _SHA_LEN :]):
        raise CodecError("payload corrupt or truncated: sha256 does not match")

    header = _parse_header(buf[_PREFIX.size : data_start], max_bytes)
    data = buf[data_start : size - _SHA_LEN]
    end = header.entries[-1].end if header.entries else 0
    if end != data.nbytes:
        raise CodecError(f"malformed header: tensors cover {end} bytes of data, the payload holds {data.nbytes}")
    if model_id is not None and header.model != model_id:
        raise CodecError(f"payload is for model {header.model!r}, expected {model_id!r}")
    _check_expected(header.entries, expected, allow_missing)

    tensors: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    for e in header.entries:
        values = _read_values(e, data)
        if e.coding is None:
            tensors[e.name] = torch.from_numpy(values).reshape(e.shape)
            continue
        bits, ones_at = _read_mask(e, data[e.offset + e.nbytes : e.end])
        if e.ones == e.numel:
            dense = values
        else:
            dense = np.zeros(e.numel, dtype=np.float32)
            dense[ones_at] = values  # positions, not the bool mask: several times faster
        tensors[e.name] = torch.from_numpy(dense).reshape(e.shape)
        masks[e.name] = torch.from_numpy(bits).reshape(e.shape)
    return Decoded(tensors=tensors, masks=masks, model_id=header.model, round=header.round)


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


def _parse_header(raw: memoryview, max_bytes: int) -> _Header:
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
    if dtype not in _DTYPES:
        raise _bad(f"tensor {name!r} has value dtype {dtype!r}; known: {sorted(_DTYPES)}")
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
    if coding not in _CODINGS:
        raise _bad(f"tensor {name!r} has mask coding {coding!r}; known: {list(_CODINGS)}")
    if not _is_int(k) or not 0 <= k <= (0 if coding == "bitmap" else _MAX_K):
        raise _bad(f"tensor {name!r} has an invalid Rice parameter {k!r:.100}")
    if not _is_int(ones) or not 0 <= ones <= numel:
        raise _bad(f"tensor {name!r} of {numel} elements has an invalid count of ones {ones!r:.100}")
    if nbytes != ones * dt.itemsize:
        raise _bad(f"tensor {name!r} has {ones} ones in its mask but {nbytes} bytes of {dtype} values")
    if not _is_int(mask_nbytes) or mask_nbytes < 0:
        raise _bad(f"tensor {name!r} has an invalid mask length {mask_nbytes!r:.100}")
    return _Entry(name, tuple(shape), numel, dt, offset, nbytes, coding, k, ones, mask_nbytes)


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


def _read_mask(e: _Entry, stream: memoryview) -> tuple[NDArray, NDArray]:
    """The flat bool mask of a sparse entry and the positions of its ones, checked to hold exactly ``e.ones`` ones
    inside the tensor."""
    n = e.numel
    raw = np.frombuffer(stream, dtype=np.uint8)
    if e.coding == "bitmap":
        if raw.size != (n + 7) // 8:
            raise CodecError(f"tensor {e.name!r}: bitmap of {raw.size} bytes for {n} elements")
        bits = np.unpackbits(raw)
        if bits[n:].any():
            raise CodecError(f"tensor {e.name!r}: bitmap has bits set past the end of the tensor")
        mask = bits[:n].view(np.bool_)
        ones = int(np.count_nonzero(mask))
        if ones != e.ones:
            raise CodecError(f"tensor {e.name!r}: bitmap has {ones} ones but {e.ones} values were sent")
        return mask, np.flatnonzero(mask)
    symbol = e.coding == "rice1"
    count = e.ones if symbol else n - e.ones  # codewords in the stream: one per coded symbol
    at = _rice_decode(e.name, raw, count, e.k, n)
    if symbol:
        mask = np.zeros(n, dtype=np.bool_)
        mask[at] = True
        return mask, at
    mask = np.ones(n, dtype=np.bool_)
    mask[at] = False
    return mask, np.flatnonzero(mask)


def _rice_decode(name: str, raw: NDArray, count: int, k: int, n: int) -> NDArray:
    """Positions of the ``count`` coded symbols, strictly increasing and below ``n``."""
    if count == 0:
        if raw.size:
            raise CodecError(f"tensor {name!r}: mask stream of {raw.size} bytes where none was expected")
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(raw)
    rem_len = count * k
    if rem_len > bits.size:
        raise CodecError(f"tensor {name!r}: mask stream too short for {count} Rice codewords with k={k}")
    stops = np.flatnonzero(bits[rem_len:] == 0)
    if stops.size < count:
        raise CodecError(f"tensor {name!r}: mask stream holds fewer than the {count} codewords the values need")
    stops = stops[:count]
    used = rem_len + int(stops[-1]) + 1
    # one-bits pad the stream (zeros would read as more codewords), so any extra codeword shows up here
    if (used + 7) // 8 != raw.size or not bits[used:].all():
        raise CodecError(f"tensor {name!r}: mask stream holds more than the {count} codewords the values need")
    q = _gaps(stops)
    if int(q.max()) > (n - 1) >> k:  # checked before shifting, so the shift cannot overflow
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    d = q << k
    if k:
        rem = bits[:rem_len].reshape(count, k)
        for j in range(k):  # a loop over the k bit columns, each one vectorised over every codeword
            d |= rem[:, j].astype(np.int64) << (k - 1 - j)
    # each gap is < 2n, so the float sum is accurate enough to rule out int64 overflow in the cumsum below
    if float(np.sum(d, dtype=np.float64)) + count > 2.0 * n:
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    at = np.cumsum(d + 1) - 1
    if int(at[-1]) >= n:
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    return at
