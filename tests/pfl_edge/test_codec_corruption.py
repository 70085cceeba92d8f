"""The wire format: refusal of payloads that are corrupt, truncated, or edited and signed again."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest
import torch
from codec_testkit import SAMPLE, bernoulli, build, split
from hypothesis import given, settings
from hypothesis import strategies as st

from pfl_edge.codec import decode, encode
from pfl_edge.errors import CodecError

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
