"""A property-based fuzzer on ``pfl_edge.codec.decode``: valid payloads of random tensors and masks, mutated
(header fields set to hostile values, bytes flipped, sections cut or grown, mask streams replaced; re-signed or
not). Whatever arrives, decode either returns exactly what the header declares (names, shapes, masks holding
``ones`` ones, zeros outside them, finite values) or raises CodecError; never another exception, and never
allocating beyond a bound linear in what the header declares (measured with tracemalloc).

``PFL_CODEC_FUZZ_EXAMPLES`` examples (200 by default); ``bench/fuzz.py`` runs many more."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import struct
import tracemalloc
from typing import Any, Literal

import torch
from codec_testkit import build, split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfl_edge.codec import decode, encode
from pfl_edge.errors import CodecError

EXAMPLES = int(os.environ.get("PFL_CODEC_FUZZ_EXAMPLES", "200"))
MAX_BYTES = 1 << 22  # decode's limit here: declared sizes stay small enough to fuzz quickly

HOSTILE: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([0, 1, -1, 7, 64, 2**31, 2**53 + 1, 2**63, 10**30, 0.5, float("inf"), True, None, "", "rice1",
                     "bitmap", "f2", [], [0], [2**40], [1] * 65, {}, "x" * 300]),
    st.integers(-(2**70), 2**70),
    st.lists(st.integers(0, 2**20), max_size=4),
).map(copy.deepcopy)  # a fresh copy each time: a mutation must not change the constants for the next example


@st.composite
def payloads(draw: st.DrawFn) -> tuple[bytes, dict[str, tuple[int, ...]]]:
    """A valid payload of 1-4 tensors (dense or sparse at any density, float32 or float16) and their shapes."""
    tensors: dict[str, torch.Tensor] = {}
    masks: dict[str, torch.Tensor] = {}
    seed = draw(st.integers(0, 2**32 - 1))
    g = torch.Generator().manual_seed(seed)
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(0, 40), max_size=3)))
        name = draw(st.sampled_from(["w", "conv.weight", "b", "é"])) + str(i)
        tensors[name] = torch.randn(shape, generator=g)
        if draw(st.booleans()):
            masks[name] = torch.rand(shape, generator=g) < draw(st.sampled_from([0.0, 0.02, 0.3, 0.5, 0.9, 1.0]))
    dtype: Literal["float32", "float16"] = draw(st.sampled_from(["float32", "float16"]))
    payload = encode(tensors, model_id="m", round=draw(st.integers(0, 2**40)), masks=masks, value_dtype=dtype)
    return payload, {k: tuple(v.shape) for k, v in tensors.items()}


def _resign(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, dict[str, tuple[int, ...]]]:
    payload, shapes = draw(payloads())
    _, _, header, data = split(payload)
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["field", "entry", "top", "data", "stream"]))
        entries = header.get("tensors")
        entries = entries if isinstance(entries, list) else []
        lists = [e for e in entries if isinstance(e, list) and e]
        if kind == "field" and lists:
            e = draw(st.sampled_from(lists))
            e[draw(st.integers(0, len(e) - 1))] = draw(HOSTILE)
        elif kind == "entry" and isinstance(header.get("tensors"), list):
            entries.insert(draw(st.integers(0, len(entries))), draw(st.lists(HOSTILE, max_size=10)))
        elif kind == "top":
            header[draw(st.sampled_from(["model", "round", "tensors", "extra"]))] = draw(HOSTILE)
        elif kind == "data":
            cut = draw(st.integers(0, len(data)))
            data = data[:cut] + draw(st.binary(max_size=64)) + data[cut + draw(st.integers(0, 8)):]
        elif kind == "stream" and lists and len(lists[-1]) == 9 and all(isinstance(x, int) for x in lists[-1][3:5]):
            # the last sparse entry's mask stream, replaced
            stream = draw(st.binary(max_size=200))
            e = lists[-1]
            data = data[: e[3] + e[4]] + stream
            if draw(st.booleans()):
                e[8] = len(stream)
    try:
        body = build(header, data)
    except (TypeError, ValueError):  # a value JSON cannot hold: send the original
        body = payload
    if draw(st.booleans()):  # a flipped byte anywhere, then re-signed or not
        raw = bytearray(body[:-32])
        raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
        body = _resign(bytes(raw)) if draw(st.booleans()) else bytes(raw) + body[-32:]
    return body, shapes


def _declared(payload: bytes) -> tuple[int, int]:
    """(elements the header declares, header length), read leniently; (0, 0) where it is not readable."""
    try:
        head_len = struct.unpack_from("<I", payload, 5)[0]
        header = json.loads(payload[9 : 9 + head_len])
        numel = sum(math.prod(e[1]) for e in header["tensors"]
                    if isinstance(e, list) and len(e) > 1 and isinstance(e[1], list)
                    and all(isinstance(s, int) and s >= 0 for s in e[1]))
        return min(numel, MAX_BYTES // 4), head_len
    except Exception:  # anything unreadable declares nothing
        return 0, min(len(payload), 1 << 20)


def check(payload: bytes, expected: dict[str, tuple[int, ...]] | None) -> None:
    """The property: a consistent result or CodecError, within the allocation bound."""
    numel, head_len = _declared(payload)
    tracemalloc.start()
    try:
        try:
            out = decode(payload, expected=expected, max_bytes=MAX_BYTES, allow_missing=True)
        except CodecError:
            out = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = 32 * numel + 64 * head_len + 2 * len(payload) + (256 << 10)
    assert peak <= bound, f"decode allocated {peak} bytes; bound {bound} ({numel} elements declared)"
    if out is None:
        return
    _, _, header, _ = split(payload)
    entries = {e[0]: e for e in header["tensors"]}
    assert set(out.tensors) == set(entries) and set(out.masks) == {k for k, e in entries.items() if len(e) == 9}
    for name, t in out.tensors.items():
        e = entries[name]
        assert tuple(t.shape) == tuple(e[1]) and t.dtype == torch.float32 and bool(torch.isfinite(t).all())
        if expected is not None:
            assert tuple(t.shape) == expected[name]
        if name in out.masks:
            m = out.masks[name]
            assert m.shape == t.shape and int(m.sum()) == e[7]
            assert not bool(t[~m].any())


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated(), st.booleans())
def test_mutated_payloads_decode_consistently_or_raise_codec_error(case: tuple[bytes, Any], with_shapes: bool) -> None:
    payload, shapes = case
    check(payload, shapes if with_shapes else None)


@settings(max_examples=EXAMPLES, deadline=None)
@given(payloads())
def test_valid_payloads_decode_to_what_was_sent(case: tuple[bytes, dict[str, tuple[int, ...]]]) -> None:
    payload, shapes = case
    check(payload, shapes)
    assert {k: tuple(v.shape) for k, v in decode(payload, expected=shapes).tensors.items()} == shapes


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes_after_a_valid_prefix_raise_codec_error_only(tail: bytes, resign: bool) -> None:
    body = b"PFLE\x01" + struct.pack("<I", len(tail) // 2) + tail
    check(_resign(body) if resign else body, None)
