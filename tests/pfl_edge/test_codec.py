"""The wire format: round trips, mask coding against the entropy, and refusal of anything malformed or corrupt.

The helpers here parse and rebuild payloads from the documented layout (not from the module's internals), so the
tests also pin the format down.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfl_edge.codec import DEFAULT_MAX_BYTES, FORMAT_VERSION, Decoded, decode, encode, encoded_size
from pfl_edge.errors import CodecError

PREFIX = struct.Struct("<4sBI")  # magic, version, header length
SHA = 32


def split(payload: bytes) -> tuple[bytes, int, dict[str, Any], bytes]:
    """(magic, version, header, data) of a well-formed payload."""
    magic, version, head_len = PREFIX.unpack_from(payload, 0)
    head = json.loads(payload[PREFIX.size : PREFIX.size + head_len])
    assert hashlib.sha256(payload[:-SHA]).digest() == payload[-SHA:]
    return magic, version, head, payload[PREFIX.size + head_len : -SHA]


def build(
    header: Any, data: bytes, *, magic: bytes = b"PFLE", version: int = 1, raw_header: bytes | None = None
) -> bytes:
    """A payload with a valid sha256 around whatever header and data we choose."""
    head = json.dumps(header, separators=(",", ":")).encode() if raw_header is None else raw_header
    body = PREFIX.pack(magic, version, len(head)) + head + data
    return body + hashlib.sha256(body).digest()


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


def bernoulli(shape: tuple[int, ...], p: float, seed: int) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p


def sample() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A small payload with a dense tensor and one sparse tensor for each mask coding."""
    g = torch.Generator().manual_seed(1)
    tensors = {
        "dense": torch.randn(3, 4, generator=g),
        "low": torch.randn(200, generator=g),
        "half": torch.randn(10, 10, generator=g),
        "high": torch.randn(150, generator=g),
        "scalar": torch.tensor(2.5),
    }
    masks = {"low": bernoulli((200,), 0.05, 2), "half": bernoulli((10, 10), 0.5, 3), "high": bernoulli((150,), 0.9, 4)}
    return tensors, masks


SAMPLE = encode(sample()[0], model_id="cnn", round=7, masks=sample()[1])

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


# ------------------------------------------------------------------------------------------------------- corruption


LARGE = encode(
    {"a": torch.randn(5000), "b": torch.randn(3000)}, model_id="m", round=2, masks={"a": bernoulli((5000,), 0.1, 9)}
)


def test_every_single_bit_flip_is_refused() -> None:
    for i in range(len(SAMPLE) * 8):
        bad = bytearray(SAMPLE)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises(CodecError):
            decode(bytes(bad))


@settings(deadline=None, max_examples=500)
@given(st.data())
def test_bit_flips_in_a_large_payload_are_refused(data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(LARGE) * 8 - 1))
    bad = bytearray(LARGE)
    bad[i // 8] ^= 1 << (i % 8)
    with pytest.raises(CodecError):
        decode(bytes(bad))


def test_every_truncation_and_any_appended_bytes_are_refused() -> None:
    for cut in range(len(SAMPLE)):
        with pytest.raises(CodecError):
            decode(SAMPLE[:cut])
    for extra in (b"\0", b"x" * 7, SAMPLE):
        with pytest.raises(CodecError):
            decode(SAMPLE + extra)


def test_wrong_magic_and_version() -> None:
    _, _, header, data = split(SAMPLE)
    with pytest.raises(CodecError, match="not a pfl-edge payload"):
        decode(build(header, data, magic=b"PFLX"))
    with pytest.raises(CodecError, match="version 2"):
        decode(build(header, data, version=2))
    with pytest.raises(CodecError, match="version 0"):
        decode(build(header, data, version=0))
    assert decode(build(header, data)).round == 7  # the rebuilt original is fine


def resigned(edit: Any) -> bytes:
    """SAMPLE with its header edited by ``edit(header, data) -> data`` and a valid sha256 again."""
    _, _, header, data = split(SAMPLE)
    edited = edit(header, data)
    return build(header, edited if isinstance(edited, bytes) else data)


def entry(header: dict, name: str) -> list:
    return next(e for e in header["tensors"] if e[0] == name)


def shift_after(header: dict, name: str, delta: int) -> None:
    names = [e[0] for e in header["tensors"]]
    for e in header["tensors"][names.index(name) + 1 :]:
        e[3] += delta


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [4, 4]), id="dense-shape"),
        pytest.param(lambda h, d: entry(h, "high").__setitem__(1, [151]), id="rice0-shape-grown"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(1, [20]), id="rice1-shape-shrunk"),
        pytest.param(lambda h, d: entry(h, "half").__setitem__(1, [10, 11]), id="bitmap-shape-grown"),
        pytest.param(lambda h, d: entry(h, "half").__setitem__(3, entry(h, "half")[3] + 1), id="offset-moved"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(3, 4), id="first-offset"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(4, entry(h, "low")[4] + 4), id="values-length"),
        pytest.param(lambda h, d: entry(h, "high").__setitem__(8, entry(h, "high")[8] - 1), id="mask-length"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(7, entry(h, "low")[7] + 1), id="rice1-count"),
        pytest.param(lambda h, d: entry(h, "high").__setitem__(7, entry(h, "high")[7] - 1), id="rice0-count"),
        pytest.param(lambda h, d: entry(h, "half").__setitem__(7, entry(h, "half")[7] + 1), id="bitmap-count"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(6, entry(h, "low")[6] + 1), id="rice-k"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(6, 99), id="rice-k-absurd"),
        pytest.param(lambda h, d: entry(h, "half").__setitem__(6, 1), id="bitmap-k"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(5, "rice0"), id="coding-swapped"),
        pytest.param(lambda h, d: entry(h, "low").__setitem__(5, "zip"), id="coding-unknown"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(2, "f2"), id="dtype-changed"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(2, "f8"), id="dtype-unknown"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [-3, -4]), id="negative-shape"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [3.0, 4]), id="float-shape"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [True, 12]), id="bool-shape"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [1] * 65 + [12]), id="too-many-dims"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(1, [0, 2**40]), id="absurd-empty-shape"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(4, -1), id="negative-length"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(0, "half"), id="duplicate-name"),
        pytest.param(lambda h, d: entry(h, "dense").__setitem__(0, 5), id="name-not-str"),
        pytest.param(lambda h, d: entry(h, "dense").append(0), id="entry-too-long"),
        pytest.param(lambda h, d: entry(h, "low").pop(), id="entry-too-short"),
        pytest.param(lambda h, d: h["tensors"].reverse(), id="entries-reordered"),
        pytest.param(lambda h, d: h["tensors"].pop(), id="entry-dropped"),
        pytest.param(lambda h, d: h.pop("round"), id="round-missing"),
        pytest.param(lambda h, d: h.__setitem__("round", -1), id="round-negative"),
        pytest.param(lambda h, d: h.__setitem__("round", "7"), id="round-str"),
        pytest.param(lambda h, d: h.__setitem__("model", None), id="model-null"),
        pytest.param(lambda h, d: h.__setitem__("extra", 1), id="extra-field"),
        pytest.param(lambda h, d: h.__setitem__("tensors", {}), id="tensors-not-list"),
        pytest.param(lambda h, d: d + b"\0\0\0\0", id="data-not-covered"),
        pytest.param(lambda h, d: d[:-1], id="data-short"),
    ],
)
def test_resigned_header_edits_are_refused(edit: Any) -> None:
    with pytest.raises(CodecError):
        decode(resigned(edit))


@pytest.mark.parametrize("name", ["low", "half", "high"])
def test_one_value_fewer_with_a_consistent_header_is_refused(name: str) -> None:
    # drop the last value of a sparse tensor and fix every count and offset: only the mask can tell
    def edit(h: dict, d: bytes) -> bytes:
        e = entry(h, name)
        cut = e[3] + e[4] - 4
        e[4] -= 4
        e[7] -= 1
        shift_after(h, name, -4)
        return d[:cut] + d[cut + 4 :]

    with pytest.raises(CodecError, match=r"ones|codewords"):
        decode(resigned(edit))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_planted_with_a_valid_sha_are_refused(bad: float) -> None:
    def plant(name: str, fmt: str) -> Any:
        def edit(h: dict, d: bytes) -> bytes:
            at = entry(h, name)[3]
            return d[:at] + struct.pack(fmt, bad) + d[at + struct.calcsize(fmt) :]

        return edit

    for name in ("dense", "low", "scalar"):
        with pytest.raises(CodecError, match="NaN or Inf"):
            decode(resigned(plant(name, "<f")))
    half = encode({"x": torch.ones(4)}, model_id="m", round=0, value_dtype="float16")
    _, _, header, data = split(half)
    with pytest.raises(CodecError, match="NaN or Inf"):
        decode(build(header, struct.pack("<e", bad) + data[2:]))


def test_header_that_is_not_json_or_not_utf8_is_refused() -> None:
    data = split(SAMPLE)[3]
    for raw in (
        b"{",
        b"\xff\xfe",
        b"[]",
        b"null",
        b'{"model":"m","round":NaN,"tensors":[]}',
        b"[" * 100_000,
        b'{"model":"m","model":"n","round":1,"tensors":[]}',
    ):
        with pytest.raises(CodecError, match="malformed header"):
            decode(build(None, data, raw_header=raw))


def test_positions_past_the_end_are_refused() -> None:
    # n = 10, rice1 with k = 0: gaps 5 and 10 put the second one at position 16
    stream = np.packbits(np.array([1, 1, 1, 1, 1, 0] + [1] * 10 + [0] + [1] * 7, dtype=np.uint8)).tobytes()
    header = {"model": "m", "round": 0, "tensors": [["w", [10], "f4", 0, 8, "rice1", 0, 2, len(stream)]]}
    with pytest.raises(CodecError, match="past the end"):
        decode(build(header, np.ones(2, "<f4").tobytes() + stream))
    # a bitmap with a bit set in its padding
    header = {"model": "m", "round": 0, "tensors": [["w", [4], "f4", 0, 4, "bitmap", 0, 1, 1]]}
    with pytest.raises(CodecError, match="past the end"):
        decode(build(header, np.ones(1, "<f4").tobytes() + bytes([0b10001000])))


def test_a_huge_shape_in_a_tiny_payload_is_refused() -> None:
    # an all-zero mask costs nothing to send, so without a bound this would allocate 4 TB
    header: dict[str, Any] = {"model": "m", "round": 0, "tensors": [["w", [2**40], "f4", 0, 0, "rice1", 0, 0, 0]]}
    with pytest.raises(CodecError, match="max_bytes"):
        decode(build(header, b""))
    header["tensors"][0][1] = [1000]
    assert decode(build(header, b"")).tensors["w"].shape == (1000,)
    with pytest.raises(CodecError, match="max_bytes"):
        decode(build(header, b""), max_bytes=3999)


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


# ------------------------------------------------------------------------------------------- expectations and limits


def test_expected_names_and_shapes() -> None:
    tensors = sample()[0]
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert set(decode(SAMPLE, expected=shapes).tensors) == set(tensors)
    with pytest.raises(CodecError, match="missing tensors \\['extra'\\]"):
        decode(SAMPLE, expected={**shapes, "extra": (1,)})
    assert set(decode(SAMPLE, expected={**shapes, "extra": (1,)}, allow_missing=True).tensors) == set(tensors)
    with pytest.raises(CodecError, match="unexpected tensors \\['scalar'\\]"):
        decode(SAMPLE, expected={k: v for k, v in shapes.items() if k != "scalar"}, allow_missing=True)
    with pytest.raises(CodecError, match="'dense' has shape \\(3, 4\\), expected \\(4, 3\\)"):
        decode(SAMPLE, expected={**shapes, "dense": (4, 3)})
    with pytest.raises(CodecError, match="shape \\(\\), expected \\(1,\\)"):
        decode(SAMPLE, expected={**shapes, "scalar": (1,)})


def test_model_id_and_max_bytes() -> None:
    assert decode(SAMPLE, model_id="cnn").model_id == "cnn"
    with pytest.raises(CodecError, match="model 'cnn', expected 'mlp'"):
        decode(SAMPLE, model_id="mlp")
    assert decode(SAMPLE, max_bytes=len(SAMPLE) + 2000).round == 7
    with pytest.raises(CodecError, match="over the limit"):
        decode(SAMPLE, max_bytes=len(SAMPLE) - 1)
    with pytest.raises(CodecError, match="over the limit"):
        decode(b"\0" * 100, max_bytes=99)  # checked before anything else
    with pytest.raises(CodecError, match="bytes"):
        decode("PFLE")  # type: ignore[arg-type]
    # other byte buffers are read in place too
    assert decode(bytearray(SAMPLE)).round == decode(memoryview(SAMPLE)).round == 7  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="contiguous"):
        decode(memoryview(SAMPLE + SAMPLE)[::2])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_encoding_refuses_non_finite_values(bad: float) -> None:
    x = torch.ones(5)
    x[3] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode({"x": x}, model_id="m", round=0)
    with pytest.raises(CodecError, match="NaN or Inf"):
        encode({"x": x}, model_id="m", round=0, masks={"x": torch.arange(5) >= 2})
    # a value outside the mask is not sent, so it cannot poison the payload
    out = decode(encode({"x": x}, model_id="m", round=0, masks={"x": torch.arange(5) != 3}))
    assert out.tensors["x"].tolist() == [1, 1, 1, 0, 1]


def test_encoding_refuses_what_it_cannot_send() -> None:
    x = torch.ones(2, 3)
    with pytest.raises(CodecError, match="float16"):
        encode({"x": torch.tensor([1e5])}, model_id="m", round=0, value_dtype="float16")
    with pytest.raises(CodecError, match="floating-point"):
        encode({"x": torch.ones(3, dtype=torch.int64)}, model_id="m", round=0)
    with pytest.raises(CodecError, match="floating-point"):
        encode({"x": torch.ones(3, dtype=torch.bool)}, model_id="m", round=0)
    with pytest.raises(CodecError, match="shape"):
        encode({"x": x}, model_id="m", round=0, masks={"x": torch.ones(3, 2, dtype=torch.bool)})
    with pytest.raises(CodecError, match="other than 0 and 1"):
        encode({"x": x}, model_id="m", round=0, masks={"x": torch.full((2, 3), 0.5)})
    with pytest.raises(CodecError, match="not sent"):
        encode({"x": x}, model_id="m", round=0, masks={"y": torch.ones(2, 3, dtype=torch.bool)})
    with pytest.raises(CodecError, match="round"):
        encode({"x": x}, model_id="m", round=-1)
    with pytest.raises(CodecError, match="model_id"):
        encode({"x": x}, model_id=3, round=0)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="value_dtype"):
        encode({"x": x}, model_id="m", round=0, value_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="layout"):
        encode({"x": x.to_sparse()}, model_id="m", round=0)
    with pytest.raises(CodecError, match=r"not a torch\.Tensor"):
        encode({"x": np.ones(3)}, model_id="m", round=0)  # type: ignore[dict-item]
