"""The wire format against a hostile uploader: payloads built to make the decoder allocate far more than they
weigh (issue 10: a 63 MB upload cost 5.2 GB, ~82x, through a mask stream longer than its tensor; a header of
long JSON lists ~30x) are refused before anything is allocated, measured with tracemalloc (numpy's allocations
are traced)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from codec_testkit import bernoulli, build, split
from hypothesis import given, settings
from hypothesis import strategies as st

from pfl_edge.codec import decode, encode
from pfl_edge.codec.layout import MAX_HEADER_BYTES
from pfl_edge.errors import CodecError


def peak_refusal(payload: bytes, match: str, **kw: Any) -> int:
    """Decode ``payload``, which must be refused with ``match``; the peak bytes allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match=match):
            decode(payload, **kw)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("coding", ["rice1", "rice0", "bitmap"])
def test_a_mask_stream_longer_than_its_tensor_is_refused_before_decoding(coding: str) -> None:
    # the attack, at 8 MB: one value of a 1000-element tensor, then megabytes of zero bits that would
    # each have decoded to an int64 position (rice) or a byte (bitmap)
    stream = b"\0" * (8 << 20)
    ones = 1 if coding != "rice0" else 999
    header = {"model": "m", "round": 0, "tensors": [["w", [1000], "f4", 0, 4 * ones, coding, 0, ones, len(stream)]]}
    payload = build(header, np.ones(ones, "<f4").tobytes() + stream)
    peak = peak_refusal(payload, "past the end|bitmap of")
    assert peak < len(payload) // 100, f"{peak} bytes allocated to refuse {len(payload)}"


def test_a_rice_parameter_beyond_any_gap_is_refused() -> None:
    # k = 30 for 10 codewords over 1000 elements: 300 remainder bits nobody needs, decoded as int64 columns
    stream = b"\xff" * 40
    header = {"model": "m", "round": 0, "tensors": [["w", [1000], "f4", 0, 40, "rice1", 30, 10, len(stream)]]}
    with pytest.raises(CodecError, match=r"Rice parameter 30 .* at most 8"):
        decode(build(header, np.ones(10, "<f4").tobytes() + stream))


def test_a_header_of_long_lists_is_refused_cheaply() -> None:
    data = split(encode({"w": torch.ones(3)}, model_id="m", round=0))[3]
    # over the fixed limit: refused by its length, before JSON parsing
    raw = b'{"model":"m","round":0,"tensors":[' + b"[]," * (MAX_HEADER_BYTES // 3) + b"[]]}"
    payload = build(None, data, raw_header=raw)
    assert peak_refusal(payload, "over the limit") < 64 << 10
    # under it, but far over what the expected tensors' entries take
    raw = b'{"model":"m","round":0,"tensors":[["w",[' + b"1," * 200_000 + b'3],"f4",0,12]]}'
    payload = build(None, data, raw_header=raw)
    assert peak_refusal(payload, "over the limit", expected={"w": (3,)}) < 64 << 10
    # without expectations, parsing what the fixed limit lets through costs a bounded multiple of it
    assert peak_refusal(payload, "invalid shape") < 40 * MAX_HEADER_BYTES
    # more entries than expected tensors: refused before any entry is checked, naming the strangers
    entries = [["w", [3], "f4", 0, 12]] + [[f"x{i}", [0], "f4", 12, 0] for i in range(50)]
    payload = build({"model": "m", "round": 0, "tensors": entries}, data)
    with pytest.raises(CodecError, match=r"unexpected tensors \['x0', 'x1'.*\(51 listed, 1 expected\)"):
        decode(payload, expected={"w": (3,)})


@pytest.mark.parametrize("dtype", [[], {}, ["f4"], 4])
def test_a_dtype_that_is_not_a_string_is_refused(dtype: Any) -> None:
    # found by test_codec_property: an unhashable dtype raised TypeError instead of CodecError
    header = {"model": "m", "round": 0, "tensors": [["w", [3], dtype, 0, 12]]}
    with pytest.raises(CodecError, match="value dtype"):
        decode(build(header, b"\0" * 12))
    header = {"model": "m", "round": 0, "tensors": [["w", [3], "f4", 0, 0, dtype, 0, 0, 1]]}
    with pytest.raises(CodecError, match="mask coding"):
        decode(build(header, b"\0"))


def test_the_encoders_output_fits_the_header_limit_of_its_expectation() -> None:
    tensors = {f"layer{i}." + "w" * 200: torch.ones(1, 2, 3, 4) for i in range(30)}
    payload = encode(tensors, model_id="m" * 300, round=2**40, masks={k: torch.rand(1, 2, 3, 4) < 0.5
                                                                      for k in list(tensors)[::2]})
    got = decode(payload, expected={k: tuple(v.shape) for k, v in tensors.items()})
    assert set(got.tensors) == set(tensors) and len(got.masks) == 15


@settings(deadline=None, max_examples=150)
@given(st.integers(1, 3000), st.floats(0, 1), st.integers(0, 2**32), st.sampled_from(["float32", "float16"]))
def test_every_mask_the_encoder_makes_is_within_the_bounds(n: int, p: float, seed: int, dtype: Any) -> None:
    # the bounds on k and on a stream's length are tight: they must never refuse what the encoder sends
    mask = bernoulli((n,), p, seed)
    x = torch.arange(1, n + 1, dtype=torch.float32)
    out = decode(encode({"w": x}, model_id="m", round=0, masks={"w": mask}, value_dtype=dtype))
    assert torch.equal(out.masks["w"], mask)
    assert torch.equal(out.tensors["w"], torch.where(mask, x.to(getattr(torch, dtype)).float(), 0.0))


WORST: list[Callable[[int], tuple[str, int, int, bytes]]] = [
    lambda n: ("rice0", 0, 0, b"\0" * (n // 8)),  # every element a codeword: the most positions per byte
    lambda n: ("rice1", 0, n, b"\0" * (n // 8)),
    lambda n: ("rice1", 2, n // 4, b"\0" * (3 * n // 32)),
    lambda n: ("bitmap", 0, 0, b"\0" * (n // 8)),
]


@pytest.mark.parametrize("worst", WORST)
def test_what_passes_the_bounds_costs_a_bounded_multiple_of_the_tensor(
    worst: Callable[[int], tuple[str, int, int, bytes]],
) -> None:
    n = 1 << 20
    coding, k, ones, stream = worst(n)
    header = {"model": "m", "round": 0, "tensors": [["w", [n], "f4", 0, 4 * ones, coding, k, ones, len(stream)]]}
    payload = build(header, np.ones(ones, "<f4").tobytes() + stream)
    tracemalloc.start()
    try:
        out = decode(payload)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert int(out.masks["w"].sum()) == ones
    assert peak < 24 * n, f"{coding}: {peak / n:.1f} bytes per element"
