"""The wire format: what the decoder is told to expect (names, shapes, model, size) and what the encoder refuses."""

from __future__ import annotations

import pytest
import torch
from codec_testkit import SAMPLE, sample

from pfl_edge.codec import decode, encode
from pfl_edge.errors import CodecError

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
    with pytest.raises(CodecError, match=r"'x' is a list, not a torch\.Tensor or a numpy\.ndarray"):
        encode({"x": [1.0, 2.0]}, model_id="m", round=0)
    with pytest.raises(CodecError, match=r"mask of 'x' is a list, not a torch\.Tensor or a numpy\.ndarray"):
        encode({"x": x}, model_id="m", round=0, masks={"x": [[True] * 3] * 2})
