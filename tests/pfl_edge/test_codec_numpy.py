"""pfl_edge.codec with numpy arrays instead of torch tensors, for a device that installs no PyTorch: ``encode``
takes numpy arrays and gives the bytes the equal torch tensors give, ``decode(..., arrays="numpy")`` gives the
values the torch decoding gives, bit for bit, and neither imports torch (checked in a child process where
``import torch`` fails)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pfl_edge.codec import decode, encode, encoded_size
from pfl_edge.errors import CodecError

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "docs" / "vectors"
POSITIVE = [p["name"] for p in json.loads((VECTORS / "index.json").read_text())["positive"]]


def _bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float32
    return np.ascontiguousarray(a).view(np.uint32)


def _value_dtype(name: str) -> Any:
    content = json.loads((VECTORS / f"{name}.json").read_text())
    return "float16" if {t["dtype"] for t in content["tensors"]} == {"f2"} else "float32"


# -------------------------------------------------------------------------------------------------- golden vectors


def test_there_are_vectors() -> None:
    assert len(POSITIVE) >= 15


@pytest.mark.parametrize("name", POSITIVE)
def test_numpy_decoding_is_the_torch_decoding(name: str) -> None:
    payload = (VECTORS / f"{name}.bin").read_bytes()
    t, n = decode(payload), decode(payload, arrays="numpy")
    assert (n.model_id, n.round) == (t.model_id, t.round)
    assert list(n.tensors) == list(t.tensors) and list(n.masks) == list(t.masks)
    for k, want in t.tensors.items():
        assert isinstance(want, torch.Tensor) and want.dtype == torch.float32  # the default is unchanged
        got = n.tensors[k]
        assert type(got) is np.ndarray and got.dtype == np.float32 and got.shape == tuple(want.shape), k
        assert np.array_equal(_bits(got), _bits(want.numpy())), k  # bitwise: -0.0 and +0.0 differ here
    for k, want in t.masks.items():
        assert isinstance(want, torch.Tensor) and want.dtype == torch.bool
        got = n.masks[k]
        assert type(got) is np.ndarray and got.dtype == np.bool_ and got.shape == tuple(want.shape), k
        assert np.array_equal(got, want.numpy()), k


@pytest.mark.parametrize("name", POSITIVE)
def test_numpy_decoding_reencodes_to_the_same_bytes(name: str) -> None:
    payload = (VECTORS / f"{name}.bin").read_bytes()
    d = decode(payload, arrays="numpy")
    again = encode(d.tensors, model_id=d.model_id, round=d.round, masks=d.masks, value_dtype=_value_dtype(name))
    assert again == payload


# -------------------------------------------------------------------------------------- numpy input == torch input


def _random(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tensors = {
        "dense": rng.standard_normal((3, 4), dtype=np.float32),
        "scalar": np.array(rng.standard_normal(), dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float32),
        "low": rng.standard_normal(500, dtype=np.float32),  # rice1
        "half": rng.standard_normal((20, 10), dtype=np.float32),  # bitmap
        "high": rng.standard_normal((7, 30), dtype=np.float32) * 100,  # rice0
        "none": rng.standard_normal(40, dtype=np.float32),
        "all": rng.standard_normal((2, 3, 4), dtype=np.float32),
    }
    tensors["dense"][0, 0] = -0.0
    masks = {
        "low": rng.random(500) < 0.03,
        "half": rng.random((20, 10)) < 0.5,
        "high": rng.random((7, 30)) < 0.95,
        "none": np.zeros(40, dtype=bool),
        "all": np.ones((2, 3, 4), dtype=bool),
    }
    return tensors, masks


def _torch(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(v, copy=True)) for k, v in arrays.items()}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
def test_numpy_input_gives_the_bytes_of_torch_input(seed: int, value_dtype: Any) -> None:
    tensors, masks = _random(seed)
    got = encode(tensors, model_id="m", round=seed, masks=masks, value_dtype=value_dtype)
    want = encode(_torch(tensors), model_id="m", round=seed, masks=_torch(masks), value_dtype=value_dtype)
    assert got == want
    codings = {e[5] for e in json.loads(got[9 : 9 + int.from_bytes(got[5:9], "little")])["tensors"] if len(e) > 5}
    assert codings == {"bitmap", "rice1", "rice0"}
    # numpy tensors with torch masks, and the reverse, are the same payload too
    assert encode(tensors, model_id="m", round=seed, masks=_torch(masks), value_dtype=value_dtype) == want
    assert encode(_torch(tensors), model_id="m", round=seed, masks=masks, value_dtype=value_dtype) == want
    assert encoded_size(tensors, masks=masks, value_dtype=value_dtype) == len(want) - 1  # model "" and round 0


def test_float64_and_float16_inputs_are_cast_as_torch_casts_them() -> None:
    rng = np.random.default_rng(5)
    f64 = rng.standard_normal(1000) * 10.0 ** rng.integers(-46, 38, 1000)  # float32's subnormals to near its max
    top = float(np.finfo(np.float32).max)
    # rounding: 0.1, -0.0, to the smallest subnormal, down to float32's max from just under the tie with 2^128,
    # and ties to even (1 + 2^-24 -> 1, 1 + 3 * 2^-24 -> 1 + 2^-22)
    f64[:7] = [0.1, -0.0, 1e-45, top + 2.0**102, -(top + 2.0**102), 1 + 2**-24, 1 + 3 * 2**-24]
    assert np.isfinite(f64.astype(np.float32)).all()
    f16 = rng.standard_normal((4, 5)).astype(np.float16)
    big = np.full((2, 2), 1 + 2**-24, dtype=np.longdouble)
    for arr in (f64, f16, f64.astype(">f8"), big):
        for value_dtype in ("float32", "float16"):
            x = arr if value_dtype == "float32" else np.clip(arr, -6e4, 6e4)
            want = encode({"x": torch.from_numpy(x.astype(np.float64))}, model_id="m", round=0,
                          value_dtype=value_dtype)
            assert encode({"x": x}, model_id="m", round=0, value_dtype=value_dtype) == want, (arr.dtype, value_dtype)
    # float64 beyond float32's range becomes inf in both, and is refused with the same message
    over = np.array([1.0, 1e39])
    messages = []
    for x in (over, torch.from_numpy(over)):
        with pytest.raises(CodecError, match="NaN or Inf") as err:
            encode({"x": x}, model_id="m", round=0)
        messages.append(str(err.value))
    assert messages[0] == messages[1]


def test_non_contiguous_and_foreign_byte_order_arrays() -> None:
    rng = np.random.default_rng(6)
    base = rng.standard_normal((6, 8), dtype=np.float32)
    mask = rng.random((8, 6)) < 0.3
    views = {"t": base.T, "step": base[::2, 1::3], "flip": base[::-1], "be": base.astype(">f4")}
    masks = {"t": mask, "step": mask[:3, :3].copy().T, "flip": mask.T[::-1]}
    want = encode(_torch({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in views.items()}),
                  model_id="m", round=1, masks=_torch({k: np.ascontiguousarray(v) for k, v in masks.items()}))
    assert encode(views, model_id="m", round=1, masks=masks) == want
    assert not base.T.flags.c_contiguous  # the views were not copied by accident
    # read-only arrays (e.g. np.frombuffer of received bytes) are fine
    ro = np.frombuffer(base.tobytes(), dtype=np.float32).reshape(6, 8)
    assert encode({"x": ro}, model_id="m", round=0) == encode({"x": torch.from_numpy(base.copy())}, model_id="m",
                                                              round=0)


def test_zero_one_masks_of_any_real_dtype_are_bool_masks() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    bits = np.arange(12).reshape(3, 4) % 3 == 0
    want = encode({"x": x}, model_id="m", round=0, masks={"x": bits})
    assert want == encode({"x": torch.from_numpy(x)}, model_id="m", round=0, masks={"x": torch.from_numpy(bits)})
    for dtype in (np.int8, np.uint8, np.int64, np.float16, np.float32, np.float64):
        assert encode({"x": x}, model_id="m", round=0, masks={"x": bits.astype(dtype)}) == want, dtype


def test_a_numpy_round_trip() -> None:
    tensors, masks = _random(9)
    d = decode(encode(tensors, model_id="m", round=3, masks=masks), arrays="numpy", model_id="m",
               expected={k: v.shape for k, v in tensors.items()})
    for k, x in tensors.items():
        want = np.where(masks[k], x, np.float32(0)) if k in masks else x  # +0.0 outside the mask
        assert d.tensors[k].shape == x.shape and np.array_equal(_bits(d.tensors[k]), _bits(want)), k
    assert set(d.masks) == set(masks) and all(np.array_equal(d.masks[k], m) for k, m in masks.items())


# ------------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("value", "match"), [
    (np.arange(3), r"tensor 'x' has dtype int64; only floating-point tensors can be sent"),
    (np.ones(3, dtype=np.int32), r"has dtype int32; only floating-point"),
    (np.ones(3, dtype=bool), r"has dtype bool; only floating-point"),
    (np.ones(3, dtype=np.complex64), r"has dtype complex64; only floating-point"),
    (np.array([1.0, 2.0], dtype=object), r"has dtype object; only floating-point"),
    (np.array(["1.0"]), r"has dtype <U3; only floating-point"),
    (np.ma.masked_array(np.ones(3), mask=[False, True, False]), r"'x' is a numpy masked array; send it dense"),
    (np.float32(1.0), r"'x' is a float32, not a torch\.Tensor or a numpy\.ndarray"),
    ([1.0, 2.0, 3.0], r"'x' is a list, not a torch\.Tensor or a numpy\.ndarray"),
])
def test_wrong_tensors_are_refused(value: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode({"x": value}, model_id="m", round=0)


@pytest.mark.parametrize(("mask", "match"), [
    (np.ones(4, dtype=bool), r"mask of 'x' has shape \(4,\), the tensor has \(2, 3\)"),
    (np.ones((3, 2), dtype=bool), r"mask of 'x' has shape \(3, 2\), the tensor has \(2, 3\)"),
    (np.full((2, 3), 0.5), r"mask of 'x' holds values other than 0 and 1"),
    (np.full((2, 3), 2, dtype=np.int16), r"holds values other than 0 and 1"),
    (np.full((2, 3), np.nan), r"holds values other than 0 and 1"),
    (np.ones((2, 3), dtype=np.complex128), r"mask of 'x' is complex; masks are bool or 0/1"),
    (np.ones((2, 3), dtype=object), r"mask of 'x' has dtype object; masks are bool or 0/1"),
    (np.full((2, 3), "1"), r"mask of 'x' has dtype <U1; masks are bool or 0/1"),
    (np.ma.masked_array(np.ones((2, 3), dtype=bool)), r"mask of 'x' is a numpy masked array"),
    ([[True] * 3] * 2, r"mask of 'x' is a list, not a torch\.Tensor or a numpy\.ndarray"),
])
def test_wrong_masks_are_refused(mask: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        encode({"x": np.ones((2, 3), dtype=np.float32)}, model_id="m", round=0, masks={"x": mask})


def test_numpy_inputs_get_the_other_checks_too() -> None:
    x = np.ones(5, dtype=np.float32)
    x[2] = np.nan
    with pytest.raises(CodecError, match="tensor 'x' holds NaN or Inf; refusing to send it"):
        encode({"x": x}, model_id="m", round=0)
    with pytest.raises(CodecError, match="outside float16's range"):
        encode({"x": np.array([7e4], dtype=np.float32)}, model_id="m", round=0, value_dtype="float16")
    # a value outside the mask is not sent
    d = decode(encode({"x": x}, model_id="m", round=0, masks={"x": np.arange(5) != 2}), arrays="numpy")
    assert d.tensors["x"].tolist() == [1, 1, 0, 1, 1]


@pytest.mark.parametrize("arrays", ["jax", "Numpy", None, ""])
def test_decode_refuses_an_unknown_array_kind(arrays: Any) -> None:
    payload = encode({"x": np.ones(2, dtype=np.float32)}, model_id="m", round=0)
    with pytest.raises(CodecError, match="arrays must be 'torch' or 'numpy'"):
        decode(payload, arrays=arrays)


# ------------------------------------------------------------------------------------------------ without torch

_WITHOUT_TORCH = r"""
import importlib.abc, json, sys
block, value_dtype = sys.argv[1:]
tried = []
if block == "none":
    sys.modules["torch"] = None  # `import torch` raises ImportError
else:  # a finder that refuses torch and notes every attempt, so that even a caught `import torch` shows
    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                tried.append(name)
                raise ImportError(f"no {name} here")
            return None
    sys.meta_path.insert(0, NoTorch())
try:
    import torch
except ImportError:
    tried.clear()
else:
    raise SystemExit("torch imported")

import numpy as np
import pfl_edge.codec
from pfl_edge.codec import decode, encode, encoded_size
from pfl_edge.errors import CodecError

x = np.arange(12, dtype=np.float32).reshape(3, 4) / 8 - 0.75
w = np.linspace(-1, 1, 30).reshape(5, 6)  # float64, cast
m = np.arange(30).reshape(5, 6) % 4 == 1
payload = encode({"x": x, "w": w}, model_id="m", round=2, masks={"w": m}, value_dtype=value_dtype)
assert encoded_size({"x": x, "w": w}, masks={"w": m}, value_dtype=value_dtype) == len(payload) - 1
d = decode(payload, arrays="numpy", model_id="m", expected={"x": (3, 4), "w": (5, 6)})
assert type(d.tensors["x"]) is np.ndarray and d.tensors["x"].dtype == np.float32
assert np.array_equal(d.tensors["x"], x) and d.tensors["w"].shape == (5, 6) and np.array_equal(d.masks["w"], m)
assert encode(d.tensors, model_id="m", round=2, masks=d.masks, value_dtype=value_dtype) == payload


def refused(why, tensors, masks=None):
    try:
        encode(tensors, model_id="m", round=0, masks=masks)
    except CodecError as e:
        assert why in str(e), e
    else:
        raise SystemExit(f"not refused: {why}")


refused("only floating-point", {"x": np.arange(3)})
refused("not a torch.Tensor or a numpy.ndarray", {"x": [1.0]})
refused("not a torch.Tensor or a numpy.ndarray", {"w": w}, {"w": m.tolist()})
refused("masks are bool or 0/1", {"w": w}, {"w": m.astype(object)})
assert not tried, tried  # nothing above tried to import torch
try:
    decode(payload)  # the default is torch tensors: needs torch
except ImportError:
    pass
else:
    raise SystemExit("decode to torch tensors worked without torch")
if block == "finder":
    assert tried == ["torch"], tried
    assert "torch" not in sys.modules, "torch in sys.modules"
else:
    assert sys.modules["torch"] is None
assert not [k for k in sys.modules if k.startswith("torch.")], "a torch submodule was loaded"
print(json.dumps({"payload": payload.hex(), "x": x.tolist(), "w": w.tolist(), "m": m.tolist(),
                  "modules": sorted(k for k in sys.modules if k.startswith("pfl_edge"))}))
"""


@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
@pytest.mark.parametrize("block", ["none", "finder"])
def test_encode_and_decode_without_torch(block: str, value_dtype: Any) -> None:
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, block, value_dtype], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    got = json.loads(out.stdout)
    assert "pfl_edge.codec" in got["modules"]
    # the payload made without torch is the one made here from the equal torch tensors
    tensors = {"x": torch.tensor(got["x"], dtype=torch.float32), "w": torch.tensor(got["w"], dtype=torch.float64)}
    want = encode(tensors, model_id="m", round=2, masks={"w": torch.tensor(got["m"])}, value_dtype=value_dtype)
    assert bytes.fromhex(got["payload"]) == want


def test_the_vectors_generate_without_torch(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pathlib import Path\n"
            "from pfl_edge.codec.vectors import generate\n"
            "generate(Path(sys.argv[1]))\n"
            "assert sys.modules['torch'] is None\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in VECTORS.iterdir() if p.is_file())  # not secagg/, its own generator's
    assert [n for n in written if (tmp_path / n).read_bytes() != (VECTORS / n).read_bytes()] == []
