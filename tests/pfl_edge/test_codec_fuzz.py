"""The wire format under fuzzing: arbitrary headers, mask streams and bytes decode consistently or raise
CodecError, never anything else."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from codec_testkit import bernoulli, build, split
from hypothesis import given, settings
from hypothesis import strategies as st

from pfl_edge.codec import decode, encode
from pfl_edge.errors import CodecError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=10) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(deadline=None, max_examples=300)
@given(json_values, st.binary(max_size=64))
def test_arbitrary_headers_raise_codec_error_only(header: Any, data: bytes) -> None:
    try:
        raw = json.dumps(header).encode()
    except ValueError:
        return
    try:
        out = decode(build(header, data, raw_header=raw))
    except CodecError:
        return
    assert out.tensors == {} and data == b""  # only an empty, well-formed header can get through


@settings(deadline=None, max_examples=300)
@given(
    st.integers(0, 12),
    st.integers(0, 8),
    st.integers(0, 4),
    st.sampled_from(["bitmap", "rice1", "rice0"]),
    st.binary(max_size=12),
)
def test_arbitrary_mask_streams_decode_consistently_or_are_refused(
    n: int, k: int, ones: int, coding: str, stream: bytes
) -> None:
    header = {"model": "m", "round": 0, "tensors": [["w", [n], "f4", 0, 4 * ones, coding, k, ones, len(stream)]]}
    try:
        out = decode(build(header, np.ones(ones, "<f4").tobytes() + stream))
    except CodecError:
        return
    mask = out.masks["w"]
    assert int(mask.sum()) == ones and mask.shape == (n,)
    assert torch.equal(out.tensors["w"], mask.float())


@settings(deadline=None, max_examples=500)
@given(
    st.integers(0, 40),
    st.floats(0, 1),
    st.integers(0, 2**32),
    st.integers(-2, 2),
    st.integers(-2, 2),
    st.sampled_from(["bitmap", "rice1", "rice0", None]),
    st.tuples(st.integers(0, 100), st.integers(0, 255)),
)
def test_edited_valid_mask_streams_decode_consistently_or_are_refused(
    n: int, p: float, seed: int, dk: int, dones: int, coding: str | None, poke: tuple[int, int]
) -> None:
    mask = bernoulli((n,), p, seed)
    _, _, header, data = split(encode({"w": torch.ones(n)}, model_id="m", round=0, masks={"w": mask}))
    e = header["tensors"][0]
    e[5] = coding or e[5]
    e[6] = max(0, e[6] + dk)
    ones = max(0, e[7] + dones)
    values, stream = bytearray(np.ones(ones, "<f4").tobytes()), bytearray(data[e[4] :])
    if stream:
        stream[poke[0] % len(stream)] = poke[1]
    e[4], e[7] = len(values), ones
    try:
        out = decode(build(header, bytes(values + stream)))
    except CodecError:
        return
    assert int(out.masks["w"].sum()) == ones and out.masks["w"].shape == (n,)
    assert torch.equal(out.tensors["w"], out.masks["w"].float())


@settings(deadline=None, max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_raise_codec_error_only(raw: bytes) -> None:
    for payload in (raw, b"PFLE\x01" + raw):
        with pytest.raises(CodecError):
            decode(payload)
