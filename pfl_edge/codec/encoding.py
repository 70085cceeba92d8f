"""Encoding named float tensors into a payload (see :mod:`pfl_edge.codec` for the layout).

Tensors and masks are torch tensors or numpy arrays, which give the same bytes. Nothing here imports torch: a
torch tensor can only exist once torch is imported, so an argument is checked against ``torch.Tensor`` only when
torch is already loaded, and a process without torch encodes numpy arrays."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pfl_edge.errors import CodecError

from .layout import _DTYPES, _PREFIX, _VALUE_DTYPES, FORMAT_VERSION, MAGIC, Array, NDArray
from .masks import _code_mask

if TYPE_CHECKING:
    import torch


def encode(
    tensors: Mapping[str, Array],
    *,
    model_id: str,
    round: int,
    masks: Mapping[str, Array] | None = None,
    value_dtype: Literal["float32", "float16"] = "float32",
) -> bytes:
    """The payload for ``tensors`` (floating-point torch tensors or numpy arrays, sent as float32 or float16):
    dense, except those named in ``masks`` (bool or 0/1 tensors or arrays of the same shape), which are sent as
    their values where the mask is 1 plus the coded mask. The same input gives the same bytes, whether torch
    tensors or the equal numpy arrays."""
    if not isinstance(model_id, str):
        raise CodecError(f"model_id must be a str, got {type(model_id).__name__}")
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise CodecError(f"round must be a non-negative int, got {round!r}")
    if value_dtype not in _VALUE_DTYPES:
        raise CodecError(f"value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {value_dtype!r}")
    dtype = _VALUE_DTYPES[value_dtype]
    masks = {} if masks is None else masks
    unknown = sorted(set(masks) - set(tensors))
    if unknown:
        raise CodecError(f"masks given for tensors that are not sent: {unknown}")

    entries: list[list[Any]] = []
    data: list[Any] = []  # buffers (bytes or contiguous arrays), written in order
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            raise CodecError(f"tensor names must be str, got {name!r}")
        arr = _as_float32(name, tensor)
        shape = list(arr.shape)
        flat = arr.reshape(-1)
        mask = masks.get(name)
        if mask is None:
            values = _values(name, flat, dtype)
            entries.append([name, shape, dtype, offset, values.nbytes])
            data.append(values)
            offset += values.nbytes
            continue
        bits = _as_mask(name, mask, tuple(arr.shape))
        coding, k, stream, positions = _code_mask(bits)
        # fancy indexing with positions is several times faster than boolean indexing here
        active = flat[positions if positions is not None else np.flatnonzero(bits)]
        values = _values(name, active, dtype)
        entries.append([name, shape, dtype, offset, values.nbytes, coding, k, int(active.size), stream.nbytes])
        data += [values, stream]
        offset += values.nbytes + stream.nbytes

    header = json.dumps({"model": model_id, "round": round, "tensors": entries}, separators=(",", ":"))
    head = header.encode("ascii")  # json.dumps escapes everything else, so this cannot fail
    parts: list[Any] = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)), head, *data]
    sha = hashlib.sha256()
    for part in parts:
        sha.update(part)
    parts.append(sha.digest())
    return b"".join(parts)


def encoded_size(
    tensors: Mapping[str, Array],
    *,
    masks: Mapping[str, Array] | None = None,
    value_dtype: Literal["float32", "float16"] = "float32",
) -> int:
    """``len(encode(...))`` for these tensors (with an empty model id and round 0)."""
    return len(encode(tensors, model_id="", round=0, masks=masks, value_dtype=value_dtype))


def _is_torch_tensor(x: object) -> bool:
    """Whether ``x`` is a torch.Tensor, without importing torch (no torch loaded: no torch tensor to be had)."""
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    return isinstance(tensor_type, type) and isinstance(x, tensor_type)


def _as_float32(name: str, tensor: Array) -> NDArray:
    if isinstance(tensor, np.ndarray):
        return _numpy_float32(name, tensor)
    if _is_torch_tensor(tensor):
        return _torch_float32(name, tensor)
    raise CodecError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor or a numpy.ndarray")


def _torch_float32(name: str, tensor: torch.Tensor) -> NDArray:
    import torch

    if tensor.layout != torch.strided:
        raise CodecError(f"tensor {name!r} has layout {tensor.layout}; send it dense with a mask instead")
    if not tensor.is_floating_point():
        raise CodecError(f"tensor {name!r} has dtype {tensor.dtype}; only floating-point tensors can be sent")
    # zero-copy for a contiguous float32 CPU tensor, which is what models hold
    return tensor.detach().to("cpu", torch.float32).contiguous().numpy()


def _numpy_float32(name: str, arr: NDArray) -> NDArray:
    if isinstance(arr, np.ma.MaskedArray):
        raise CodecError(f"tensor {name!r} is a numpy masked array; send it dense with a mask instead")
    if arr.dtype.kind != "f":
        raise CodecError(f"tensor {name!r} has dtype {arr.dtype}; only floating-point tensors can be sent")
    # rounds to nearest even like torch's cast; beyond float32's range becomes inf, as in torch, refused in _values
    with np.errstate(over="ignore"):
        # zero-copy for a C-contiguous float32 array in the machine's byte order
        return np.asarray(arr, dtype=np.float32, order="C")


def _values(name: str, values: NDArray, dtype: str) -> NDArray:
    with np.errstate(over="ignore"):  # an overflow to inf is refused just below, with a clearer message
        out = values.astype(_DTYPES[dtype], copy=False)
    # checked after the cast: a finite float32 beyond float16's range becomes inf
    if not np.isfinite(out).all():
        what = "NaN or Inf" if dtype == "f4" else "NaN, Inf or a value outside float16's range"
        raise CodecError(f"tensor {name!r} holds {what}; refusing to send it")
    return np.ascontiguousarray(out)


def _as_mask(name: str, mask: Array, shape: tuple[int, ...]) -> NDArray:
    """The flat bool mask, from a torch tensor or a numpy array of ``shape``, bool or holding only 0 and 1."""
    if isinstance(mask, np.ndarray):
        return _numpy_mask(name, mask, shape)
    if _is_torch_tensor(mask):
        return _torch_mask(name, mask, shape)
    raise CodecError(f"mask of {name!r} is a {type(mask).__name__}, not a torch.Tensor or a numpy.ndarray")


def _torch_mask(name: str, mask: torch.Tensor, shape: tuple[int, ...]) -> NDArray:
    import torch

    if tuple(mask.shape) != shape:
        raise CodecError(f"mask of {name!r} has shape {tuple(mask.shape)}, the tensor has {shape}")
    if mask.dtype != torch.bool:
        if mask.is_complex():
            raise CodecError(f"mask of {name!r} is complex; masks are bool or 0/1")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise CodecError(f"mask of {name!r} holds values other than 0 and 1")
        mask = mask != 0
    return mask.detach().cpu().contiguous().numpy().reshape(-1)


def _numpy_mask(name: str, mask: NDArray, shape: tuple[int, ...]) -> NDArray:
    if isinstance(mask, np.ma.MaskedArray):
        raise CodecError(f"mask of {name!r} is a numpy masked array; masks are bool or 0/1")
    if tuple(mask.shape) != shape:
        raise CodecError(f"mask of {name!r} has shape {tuple(mask.shape)}, the tensor has {shape}")
    if mask.dtype.kind != "b":
        if mask.dtype.kind == "c":
            raise CodecError(f"mask of {name!r} is complex; masks are bool or 0/1")
        if mask.dtype.kind not in "iuf":  # objects, strings, dates, records
            raise CodecError(f"mask of {name!r} has dtype {mask.dtype}; masks are bool or 0/1")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise CodecError(f"mask of {name!r} holds values other than 0 and 1")
        mask = mask != 0
    return np.asarray(mask, dtype=np.bool_, order="C").reshape(-1)
