"""Coding of sparse tensors' masks: bitmap, or Golomb–Rice codes of the gaps (see :mod:`pfl_edge.codec`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from pfl_edge.errors import CodecError

from .layout import _MAX_K, NDArray

if TYPE_CHECKING:
    from .header import _Entry

# ---------------------------------------------------------------------------------------------------------- encoding


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
    stops = np.flatnonzero(bits[rem_len:] == 0)  # the comparison's bools are freed at once
    if stops.size < count:
        raise CodecError(f"tensor {name!r}: mask stream holds fewer than the {count} codewords the values need")
    stops = stops[:count]
    used = rem_len + int(stops[-1]) + 1
    # one-bits pad the stream (zeros would read as more codewords), so any extra codeword shows up here
    if (used + 7) // 8 != raw.size or not bits[used:].all():
        raise CodecError(f"tensor {name!r}: mask stream holds more than the {count} codewords the values need")
    # in place from here on: a stream of c codewords costs a few int64 arrays of c, not one per step
    d = _gaps(stops)
    del stops
    if int(d.max()) > (n - 1) >> k:  # checked before shifting, so the shift cannot overflow
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    d <<= k
    if k:
        rem = bits[:rem_len].reshape(count, k)
        column = np.empty(count, dtype=np.int64)
        for j in range(k):  # a loop over the k bit columns, each one vectorised over every codeword
            np.left_shift(rem[:, j], np.int64(k - 1 - j), out=column)
            d |= column
        del column
    # each gap is < 2n, so the float sum is accurate enough to rule out int64 overflow in the cumsum below
    if float(np.sum(d, dtype=np.float64)) + count > 2.0 * n:
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    d += 1
    at = np.cumsum(d, out=d)
    at -= 1
    if int(at[-1]) >= n:
        raise CodecError(f"tensor {name!r}: mask stream points past the end of the tensor")
    return at
