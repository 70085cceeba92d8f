"""Versioned binary wire format for a set of named float tensors: what every payload of pfl-edge is on the wire.

No pickle: a payload is plain bytes that any language can parse. The normative specification, byte for byte, is
docs/codec.md (with golden test vectors in docs/vectors, written by :mod:`pfl_edge.codec.vectors`); this summary
and the code follow it.

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

Decoding trusts nothing: every refusal is a :class:`~pfl_edge.errors.CodecError` saying what was wrong. What it
may cost is bounded before anything is allocated: the header is at most ``MAX_HEADER_BYTES`` (1 MiB), or what the
expected tensors' entries can take, and lists no more tensors than expected; a bitmap is exactly ``ceil(n / 8)``
bytes; a Rice stream of ``c`` codewords has ``k <= floor(log2(n / c)) + 2`` and at most
``ceil((c (k + 1) + ((n - c) >> k)) / 8)`` bytes, never more than the bitmap (the encoder sends it only when it
is shorter); so decoding allocates about 24 bytes per declared element at most, whatever the payload.
"""

from __future__ import annotations

from .decoding import decode
from .encoding import encode, encoded_size
from .layout import DEFAULT_MAX_BYTES, FORMAT_VERSION, Decoded
from .layout import MAGIC as MAGIC  # importable as before, though not in __all__

__all__ = ["DEFAULT_MAX_BYTES", "FORMAT_VERSION", "Decoded", "decode", "encode", "encoded_size"]
