"""The wire format: round trips of every kind of tensor and mask, the layout, and mask coding against the entropy."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from codec_testkit import PREFIX, SAMPLE, SHA, bernoulli, build, split
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfl_edge.codec import DEFAULT_MAX_BYTES, FORMAT_VERSION, Decoded, decode, encode, encoded_size


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so that -0.0 and 0.0 differ and NaN payloads would count."""
    return t.contiguous().view(torch.int32)


def coding_of(payload: bytes, name: str) -> tuple[str, int, int]:
    """(coding, k, mask bytes) of a sparse tensor."""
    for entry in split(payload)[2]["tensors"]:
        if entry[0] == name:
            return entry[5], entry[6], entry[8]
    raise KeyError(name)


def entropy_bits(n: int, ones: int) -> float:
    p = ones / n
    if p in (0.0, 1.0):
        return 0.0
    return -n * (p * math.log2(p) + (1 - p) * math.log2(1 - p))



# --------------------------------------------------------------------------------------------------------- round trip

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def tensor_sets(draw: st.DrawFn, elements: st.SearchStrategy[float] = finite32) -> tuple[dict, dict]:
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4, unique=True))
    tensors, masks = {}, {}
    for name in names:
        shape = draw(shapes)
        n = math.prod(shape)
        values = draw(st.lists(elements, min_size=n, max_size=n))
        tensors[name] = torch.tensor(values, dtype=torch.float32).reshape(shape)
        kind = draw(st.sampled_from(["dense", "bernoulli", "explicit"]))
        if kind == "bernoulli":
            masks[name] = bernoulli(
                shape, draw(st.sampled_from([0.0, 0.01, 0.3, 0.5, 0.7, 0.99, 1.0])), draw(st.integers(0, 99))
            )
        elif kind == "explicit":
            masks[name] = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool).reshape(
                shape
            )
    return tensors, masks


def check_round_trip(out: Decoded, tensors: dict, masks: dict, cast: Any = None) -> None:
    assert list(out.tensors) == list(tensors)
    assert set(out.masks) == set(masks)
    for name, x in tensors.items():
        got = out.tensors[name]
        assert got.dtype == torch.float32 and got.shape == x.shape
        want = x if cast is None else cast(x)
        if name in masks:
            assert out.masks[name].dtype == torch.bool
            assert torch.equal(out.masks[name], masks[name])
            want = torch.where(masks[name], want, torch.zeros(()))
        assert torch.equal(bits_of(got), bits_of(want)), name


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets(), st.integers(0, 2**40), st.text(max_size=10))
def test_round_trip_float32_is_exact(data: tuple[dict, dict], rnd: int, model: str) -> None:
    tensors, masks = data
    payload = encode(tensors, model_id=model, round=rnd, masks=masks)
    assert payload == encode(tensors, model_id=model, round=rnd, masks=masks)  # deterministic
    assert encoded_size(tensors, masks=masks) == len(encode(tensors, model_id="", round=0, masks=masks))
    out = decode(payload, expected={k: tuple(v.shape) for k, v in tensors.items()}, model_id=model)
    assert out.model_id == model and out.round == rnd
    check_round_trip(out, tensors, masks)


@settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(tensor_sets(st.floats(-65504, 65504, width=32)))
def test_round_trip_float16_rounds_like_torch(data: tuple[dict, dict]) -> None:
    tensors, masks = data
    payload = encode(tensors, model_id="m", round=0, masks=masks, value_dtype="float16")
    check_round_trip(decode(payload), tensors, masks, cast=lambda x: x.half().float())


@pytest.mark.parametrize("p", [0.0, 0.001, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999, 1.0])
def test_round_trip_large_tensors_at_every_density(p: float) -> None:
    x = torch.randn(300, 1000, generator=torch.Generator().manual_seed(5))
    mask = bernoulli(x.shape, p, 6)
    out = decode(encode({"w": x, "b": x[0]}, model_id="m", round=1, masks={"w": mask}))
    check_round_trip(out, {"w": x, "b": x[0]}, {"w": mask})


def test_edge_masks_and_shapes() -> None:
    cases = {
        "scalar": (torch.tensor(1.5), torch.tensor(True)),
        "scalar_off": (torch.tensor(1.5), torch.tensor(False)),
        "empty": (torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool)),
        "one": (torch.tensor([-0.0]), torch.tensor([True])),
        "first_last": (torch.arange(9.0), torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool)),
        "all_but_first": (torch.arange(20.0), torch.arange(20) > 0),
        "all_but_last": (torch.arange(20.0), torch.arange(20) < 19),
    }
    tensors = {k: v[0] for k, v in cases.items()}
    masks = {k: v[1] for k, v in cases.items()}
    check_round_trip(decode(encode(tensors, model_id="", round=0, masks=masks)), tensors, masks)


def test_float_masks_equal_bool_masks_and_inputs_are_converted() -> None:
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    m = bernoulli((4, 5), 0.4, 0)
    a = encode({"x": x}, model_id="m", round=0, masks={"x": m})
    assert a == encode({"x": x.detach().float()}, model_id="m", round=0, masks={"x": m.float()})
    nc = torch.randn(5, 4).t()  # not contiguous
    assert torch.equal(decode(encode({"x": nc}, model_id="m", round=0)).tensors["x"], nc)
    bf = torch.randn(6).bfloat16()
    assert torch.equal(decode(encode({"x": bf}, model_id="m", round=0)).tensors["x"], bf.float())


def test_hand_built_rice_payload_decodes() -> None:
    # n = 10, ones at 2, 3, 7: gaps 2, 0, 3; k = 1 -> remainders 0 0 1, quotients 1 0 1 -> "001" + "10" "0" "10"
    stream = bytes([0b00110010])
    values = np.array([1.0, 2.0, 3.0], dtype="<f4").tobytes()
    header = {"model": "m", "round": 3, "tensors": [["w", [10], "f4", 0, 12, "rice1", 1, 3, 1]]}
    out = decode(build(header, values + stream))
    assert out.masks["w"].nonzero().flatten().tolist() == [2, 3, 7]
    assert out.tensors["w"].tolist() == [0, 0, 1, 2, 0, 0, 0, 3, 0, 0]
    # the encoder prefers k = 0 here (8 bits as well, fewer k tried first): "110" "0" "1110"
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[2, 3, 7]] = True
    enc = encode({"w": out.tensors["w"]}, model_id="m", round=3, masks={"w": mask})
    assert split(enc)[2]["tensors"] == [["w", [10], "f4", 0, 12, "rice1", 0, 3, 1]]
    assert split(enc)[3] == values + bytes([0b11001110])


def test_layout_and_header_size() -> None:
    magic, version, header, data = split(SAMPLE)
    assert magic == b"PFLE" and version == FORMAT_VERSION == 1
    assert header["model"] == "cnn" and header["round"] == 7
    assert [e[0] for e in header["tensors"]] == ["dense", "low", "half", "high", "scalar"]
    assert {e[0]: e[5] for e in header["tensors"] if len(e) == 9} == {"low": "rice1", "half": "bitmap", "high": "rice0"}
    head_len = len(SAMPLE) - len(data) - PREFIX.size - SHA
    assert head_len < 60 * len(header["tensors"])  # small: a few dozen bytes per tensor
    assert DEFAULT_MAX_BYTES == 256 * 1024 * 1024


# ----------------------------------------------------------------------------------------------- mask coding quality


@pytest.mark.parametrize(
    "p",
    [
        0.01,
        0.02,
        0.05,
        0.1,
        0.15,
        0.2,
        0.25,
        0.3,
        0.35,
        0.382,
        0.4,
        0.45,
        0.5,
        0.55,
        0.6,
        0.618,
        0.65,
        0.7,
        0.75,
        0.8,
        0.85,
        0.9,
        0.95,
        0.98,
        0.99,
    ],
)
def test_mask_coding_is_close_to_entropy(p: float) -> None:
    n = 200_000
    mask = bernoulli((n,), p, int(p * 1000))
    coding, _, mask_bytes = coding_of(encode({"w": torch.ones(n)}, model_id="", round=0, masks={"w": mask}), "w")
    floor = entropy_bits(n, int(mask.sum()))
    # Rice codes of geometric gaps stay within ~4.2 % of the entropy (worst near p = 0.382); 5 % leaves slack
    assert 8 * mask_bytes <= 1.05 * floor, (coding, 8 * mask_bytes / floor)
    if 0.45 <= p <= 0.55:
        assert coding == "bitmap"
    elif p <= 0.3:
        assert coding == "rice1"
    elif p >= 0.7:
        assert coding == "rice0"


def test_smallest_coding_is_chosen() -> None:
    # all ones except the first entry: a bitmap would take n bits, zero-gap coding a handful
    n = 10_000
    mask = torch.ones(n, dtype=torch.bool)
    mask[0] = False
    coding, _, nbytes = coding_of(encode({"w": torch.ones(n)}, model_id="", round=0, masks={"w": mask}), "w")
    assert coding == "rice0" and nbytes <= 2
    # an all-ones or all-zeros mask costs no mask bytes at all
    for full in (torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)):
        assert coding_of(encode({"w": torch.ones(n)}, model_id="", round=0, masks={"w": full}), "w")[2] == 0
