"""The pfl-edge payload format (docs/codec.md, format version 1), written from that page alone: struct, json,
hashlib and numpy. Section numbers below are the page's.

``decode`` refuses a payload at the first failed check of section 7 (prefix, header, entries, whole payload,
then each tensor), before allocating anything sized by the payload beyond what the limits allow. ``encode``
writes the canonical bytes of sections 2.2 and 5.3 (the coding and Rice parameter the reference encoder picks),
so its output is byte-identical to any conforming encoder's."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAGIC, VERSION, PREFIX, TRAILER = b"PFLE", 1, 9, 32
DEFAULT_MAX_BYTES = 268_435_456
MAX_HEADER = 1_048_576
SIZES = {"f4": 4, "f2": 2}
DTYPES: dict[str, np.dtype[Any]] = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}


class CodecError(ValueError):
    """A payload refused by a check of docs/codec.md section 7."""


@dataclass
class Payload:
    model_id: str
    round: int
    tensors: dict[str, np.ndarray] = field(default_factory=dict)  # float32, zeros outside a mask
    masks: dict[str, np.ndarray] = field(default_factory=dict)  # bool, for every tensor sent sparse
    codings: dict[str, str] = field(default_factory=dict)  # the mask coding of each sparse tensor


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise CodecError(f"malformed header: duplicate keys in {keys}")
    return dict(pairs)


def _nan(word: str) -> Any:
    raise CodecError("malformed header: NaN is not valid here")


# ---------------------------------------------------------------- decoding (section 7)

def decode(data: bytes, *, expected: dict[str, tuple[int, ...]] | None = None, model_id: str | None = None,
           max_bytes: int = DEFAULT_MAX_BYTES, allow_missing: bool = False) -> Payload:
    size = len(data)
    if size > max_bytes:
        raise CodecError(f"payload of {size} bytes is over the limit of {max_bytes} bytes")  # D1
    if size < PREFIX + TRAILER:
        raise CodecError(f"payload truncated: {size} bytes, shorter than the fixed 41")  # D2
    if data[:4] != MAGIC:
        raise CodecError(f"not a pfl-edge payload: starts with {data[:4]!r}")  # D3
    if data[4] != VERSION:
        raise CodecError(f"unsupported payload format version {data[4]}; this build reads version 1")  # D4
    (hlen,) = struct.unpack_from("<I", data, 5)
    if PREFIX + hlen + TRAILER > size:
        raise CodecError(f"payload truncated: header of {hlen} bytes does not fit in {size} bytes")  # D5
    limit = MAX_HEADER if expected is None else min(MAX_HEADER, 4096 + sum(
        256 + 6 * len(k) + 21 * len(s) for k, s in expected.items()))
    if hlen > limit:
        raise CodecError(f"malformed header: {hlen} bytes, over the limit of {limit}")  # D6
    if hashlib.sha256(data[:-TRAILER]).digest() != data[-TRAILER:]:
        raise CodecError("payload corrupt or truncated: sha256 does not match")  # D7
    head = _header(data[PREFIX:PREFIX + hlen], expected)
    entries = [_entry(e, max_bytes) for e in head["tensors"]]
    _layout(entries, max_bytes, size - PREFIX - hlen - TRAILER)
    if model_id is not None and head["model"] != model_id:
        raise CodecError(f"payload is for model {head['model']!r}, expected {model_id!r}")  # D9
    if expected is not None:
        _against(entries, expected, allow_missing)  # D10
    out = Payload(head["model"], head["round"])
    body = memoryview(data)[PREFIX + hlen:size - TRAILER]
    for e in entries:
        _tensor(e, body, out)
    return out


def _header(raw: bytes, expected: dict[str, tuple[int, ...]] | None) -> dict[str, Any]:
    try:
        head = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dupes, parse_constant=_nan)  # H1
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CodecError(f"malformed header: not JSON ({e})") from None
    if not isinstance(head, dict) or set(head) != {"model", "round", "tensors"}:
        raise CodecError("malformed header: expected an object with exactly the fields model, round and tensors")
    if not isinstance(head["model"], str):
        raise CodecError("malformed header: model is not a string")  # H3
    if not _is_int(head["round"]) or head["round"] < 0:
        raise CodecError(f"malformed header: round {head['round']!r} is not a non-negative integer")  # H4
    if not isinstance(head["tensors"], list):
        raise CodecError("malformed header: tensors is not a list")  # H5
    if expected is not None and len(head["tensors"]) > len(expected):
        raise CodecError(f"payload holds unexpected tensors ({len(head['tensors'])} listed, "
                         f"{len(expected)} expected)")  # H6
    return head


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int
    coding: str | None = None
    k: int = 0
    ones: int = 0
    mask_nbytes: int = 0

    @property
    def n(self) -> int:
        return math.prod(self.shape)


def _entry(e: Any, max_bytes: int) -> _Entry:  # E1 ... E15
    bad = "malformed header: "
    if not isinstance(e, list) or len(e) not in (5, 9):
        raise CodecError(bad + "a tensor entry must be a list of 5 or 9 fields")
    name, shape, dtype, offset, nbytes = e[:5]
    if not isinstance(name, str):
        raise CodecError(bad + f"tensor name {name!r} is not a string")
    if not isinstance(shape, list) or len(shape) > 64 or not all(_is_int(d) and 0 <= d <= max_bytes for d in shape):
        raise CodecError(bad + f"tensor {name!r} has an invalid shape")
    if dtype not in SIZES:
        raise CodecError(bad + f"tensor {name!r} has value dtype {dtype!r}")
    if not _is_int(offset) or offset < 0:
        raise CodecError(bad + f"tensor {name!r} has an invalid offset")
    if not _is_int(nbytes) or nbytes < 0:
        raise CodecError(bad + f"tensor {name!r} has an invalid length")
    ent = _Entry(name, tuple(shape), dtype, offset, nbytes)
    n, size = ent.n, SIZES[dtype]
    if len(e) == 5:
        if nbytes != n * size:
            raise CodecError(bad + f"dense tensor {name!r} of shape {shape} needs {n * size} bytes, header says "
                             f"{nbytes}")
        return ent
    coding, k, ones, mask_nbytes = e[5:]
    if coding not in ("bitmap", "rice1", "rice0"):
        raise CodecError(bad + f"tensor {name!r} has mask coding {coding!r}")
    if not _is_int(k) or (coding == "bitmap" and k != 0) or not 0 <= k <= 62:
        raise CodecError(bad + f"tensor {name!r} has an invalid Rice parameter")
    if not _is_int(ones) or not 0 <= ones <= n:
        raise CodecError(bad + f"tensor {name!r} has an invalid count of ones")
    if nbytes != ones * size:
        raise CodecError(bad + f"tensor {name!r} has {ones} ones in its mask but {nbytes} bytes of {dtype} values")
    if not _is_int(mask_nbytes) or mask_nbytes < 0:
        raise CodecError(bad + f"tensor {name!r} has an invalid mask length")
    ent.coding, ent.k, ent.ones, ent.mask_nbytes = coding, k, ones, mask_nbytes
    _check_mask_length(ent)
    return ent


def _check_mask_length(e: _Entry) -> None:  # E12 ... E15
    n, bad = e.n, f"malformed header: tensor {e.name!r} "
    if e.coding == "bitmap":
        if e.mask_nbytes != -(-n // 8):
            raise CodecError(bad + f"has a bitmap of {e.mask_nbytes} bytes, expected {-(-n // 8)}")
        return
    c = e.ones if e.coding == "rice1" else n - e.ones
    if c == 0:
        if e.mask_nbytes != 0:
            raise CodecError(bad + f"has a mask stream of {e.mask_nbytes} bytes where no codeword is expected")
        return
    if e.k > (n // c).bit_length() + 1:
        raise CodecError(bad + f"Rice parameter {e.k} for {c} codewords over {n} elements")
    low = -(-c * (e.k + 1) // 8)
    high = min(-(-(c * (e.k + 1) + ((n - c) >> e.k)) // 8), -(-n // 8))
    if not low <= e.mask_nbytes <= high:
        raise CodecError(bad + f"is too short for {c} codewords, or longer than the {high} bytes that fit")


def _layout(entries: list[_Entry], max_bytes: int, data_len: int) -> None:  # E16 ... E18, D8
    seen: set[str] = set()
    end = decoded = 0
    for e in entries:
        if e.name in seen:
            raise CodecError(f"malformed header: tensor {e.name!r} appears twice")
        seen.add(e.name)
        if e.offset != end:
            raise CodecError(f"malformed header: tensor {e.name!r} starts at byte {e.offset} of data, expected {end}")
        decoded += 4 * e.n
        if decoded > max_bytes:
            raise CodecError(f"malformed header: the tensors would decode to over {max_bytes} bytes (max_bytes)")
        end = e.offset + e.nbytes + e.mask_nbytes
    if end != data_len:
        raise CodecError(f"malformed header: tensors cover {end} bytes of data, the payload holds {data_len}")


def _against(entries: list[_Entry], expected: dict[str, tuple[int, ...]], allow_missing: bool) -> None:
    names = {e.name for e in entries}
    if names - set(expected):
        raise CodecError(f"payload holds unexpected tensors {sorted(names - set(expected))}")
    if not allow_missing and set(expected) - names:
        raise CodecError(f"payload is missing tensors {sorted(set(expected) - names)}")
    for e in entries:
        if tuple(expected[e.name]) != e.shape:
            raise CodecError(f"tensor {e.name!r} has shape {e.shape}, expected {tuple(expected[e.name])}")


def _tensor(e: _Entry, body: memoryview, out: Payload) -> None:  # V1, M1 ... M5
    values = np.frombuffer(body[e.offset:e.offset + e.nbytes], dtype=DTYPES[e.dtype]).astype(np.float32)
    if not np.isfinite(values).all():
        raise CodecError(f"tensor {e.name!r} holds NaN or Inf")
    if e.coding is None:
        out.tensors[e.name] = values.reshape(e.shape)
        return
    stream = np.frombuffer(body[e.offset + e.nbytes:e.offset + e.nbytes + e.mask_nbytes], dtype=np.uint8)
    mask = _bitmap(stream, e) if e.coding == "bitmap" else _rice(stream, e)
    dense = np.zeros(e.n, dtype=np.float32)
    dense[mask] = values
    out.tensors[e.name], out.masks[e.name], out.codings[e.name] = dense.reshape(e.shape), mask.reshape(e.shape), \
        e.coding


def _bitmap(stream: np.ndarray, e: _Entry) -> np.ndarray:  # 5.1
    bits = np.unpackbits(stream)  # MSB first
    if bits[e.n:].any():
        raise CodecError("bitmap has bits set past the end of the tensor")
    mask = bits[:e.n].astype(bool)
    if int(mask.sum()) != e.ones:
        raise CodecError(f"bitmap has {int(mask.sum())} ones but {e.ones} values were sent")
    return mask


def _rice(stream: np.ndarray, e: _Entry) -> np.ndarray:  # 5.2, "Decoding a Rice mask"
    n, k = e.n, e.k
    c = e.ones if e.coding == "rice1" else n - e.ones
    coded = np.zeros(n, dtype=bool)
    if c > 0:
        bits = np.unpackbits(stream)
        r = np.zeros(c, dtype=np.int64)
        if k:
            rbits = bits[:c * k].reshape(c, k).astype(np.int64)
            r = rbits @ (1 << np.arange(k - 1, -1, -1, dtype=np.int64))
        zeros = np.flatnonzero(bits[c * k:] == 0)
        if len(zeros) < c:
            raise CodecError(f"mask stream holds fewer than the {c} codewords the values need")
        q = np.diff(zeros[:c], prepend=-1) - 1
        used = c * k + int(zeros[c - 1]) + 1
        if -(-used // 8) != len(stream) or not bits[used:].all():
            raise CodecError(f"mask stream holds more than the {c} codewords the values need")
        if int(q.max()) > (n - 1) >> k:
            raise CodecError("mask stream points past the end of the tensor")
        pos = np.cumsum((q << k) + r + 1) - 1
        if int(pos[-1]) >= n:
            raise CodecError("mask stream points past the end of the tensor")
        coded[pos] = True
    return coded if e.coding == "rice1" else ~coded


# ---------------------------------------------------------------- encoding (sections 2.2, 3, 4, 5.3)

def encode(tensors: dict[str, np.ndarray], *, model_id: str, round: int,
           masks: dict[str, np.ndarray] | None = None) -> bytes:
    """Dense f4 for every tensor, except those in ``masks`` (bool arrays of the same shape): their values where
    the mask is 1 (in flat index order) followed by the mask in the coding section 5.3 picks."""
    masks = masks or {}
    entries: list[list[Any]] = []
    chunks: list[bytes] = []
    offset = 0
    for name, a in tensors.items():
        flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
        if not np.isfinite(flat).all():
            raise CodecError(f"tensor {name!r} holds NaN or Inf")
        shape = [int(d) for d in np.shape(a)]
        if name not in masks:
            values = flat.astype("<f4").tobytes()
            entries.append([name, shape, "f4", offset, len(values)])
            chunks.append(values)
            offset += len(values)
            continue
        m = np.asarray(masks[name], dtype=bool).reshape(-1)
        values = flat[m].astype("<f4").tobytes()
        coding, k, coded = _choose(m)
        entries.append([name, shape, "f4", offset, len(values), coding, k, int(m.sum()), len(coded)])
        chunks += [values, coded]
        offset += len(values) + len(coded)
    header = json.dumps({"model": model_id, "round": round, "tensors": entries}, separators=(",", ":")).encode()
    body = MAGIC + bytes([VERSION]) + struct.pack("<I", len(header)) + header + b"".join(chunks)
    return body + hashlib.sha256(body).digest()


def _choose(m: np.ndarray) -> tuple[str, int, bytes]:
    """Section 5.3: the strictly shortest in bytes, bitmap first, then rice1, then rice0."""
    n = len(m)
    best: tuple[int, str, int] = (-(-n // 8), "bitmap", 0)
    for coding, symbol in (("rice1", True), ("rice0", False)):
        p = np.flatnonzero(m == symbol)
        c = len(p)
        if c == 0:
            bits, k = 0, 0
        elif 2 * c >= n:
            bits, k = int(p[-1]) + 1, 0
            if bits >= n:
                continue
        else:
            bits, k = _cheapest_k(np.diff(p, prepend=-1) - 1)
        if -(-bits // 8) < best[0]:
            best = (-(-bits // 8), coding, k)
    _, coding, k = best
    if coding == "bitmap":
        return coding, 0, np.packbits(m).tobytes()  # zero padding to a whole byte
    return coding, k, _rice_stream(np.flatnonzero(m == (coding == "rice1")), k)


def _cheapest_k(d: np.ndarray) -> tuple[int, int]:
    c, s = len(d), int(d.sum())
    centre = 0
    while c * ((1 << (centre + 1)) - 1) <= s:
        centre += 1
    options = [(c * (k + 1) + int((d >> k).sum()), k) for k in range(max(0, centre - 1), min(62, centre + 1) + 1)]
    return min(options)  # fewest bits; on a tie the smallest k


def _rice_stream(p: np.ndarray, k: int) -> bytes:
    """Section 5.2: the remainders (k bits each, MSB first), then the quotients in unary (q ones, one zero),
    then one-bits up to a whole byte."""
    if len(p) == 0:
        return b""
    d = np.diff(p, prepend=-1) - 1
    q, r = d >> k, d & ((1 << k) - 1)
    rbits = ((r[:, None] >> np.arange(k - 1, -1, -1)) & 1).reshape(-1).astype(np.uint8)
    qbits = np.ones(int((q + 1).sum()), dtype=np.uint8)
    qbits[np.cumsum(q + 1) - 1] = 0
    bits = np.concatenate([rbits, qbits])
    pad = -len(bits) % 8
    return np.packbits(np.concatenate([bits, np.ones(pad, dtype=np.uint8)])).tobytes()
