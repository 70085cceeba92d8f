"""The fixed parts of the wire format (see :mod:`pfl_edge.codec`): prefix, trailer, dtypes, codings, limits."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

MAGIC = b"PFLE"
_PREFIX = struct.Struct("<4sBI")
_SHA_LEN = 32
_DTYPES: dict[str, np.dtype[Any]] = {"f4": np.dtype("<f4"), "f2": np.dtype("<f2")}
_VALUE_DTYPES = {"float32": "f4", "float16": "f2"}
_CODINGS = ("bitmap", "rice1", "rice0")
_MAX_NDIM = 64  # torch's own limit on dimensions
_MAX_K = 62  # a Rice remainder must fit an int64 with room for the quotient
_DENSE_LEN, _SPARSE_LEN = 5, 9
# JSON parsing allocates up to ~30x its input (an empty list per 3 bytes), so the header is bounded before it is
# parsed: at most this, and (when the tensors to expect are known) what their entries can take
MAX_HEADER_BYTES = 1 << 20
_ENTRY_BYTES = 256  # an entry's fields but name and shape: brackets, dtype, coding and five integers
_DIM_BYTES = 21  # a dimension: up to 20 digits and a comma

NDArray = np.ndarray[Any, Any]
#: a torch.Tensor or a numpy.ndarray: what :func:`~pfl_edge.codec.encode` takes, and what
#: :func:`~pfl_edge.codec.decode` returns (torch tensors unless asked for ``arrays="numpy"``)
Array: TypeAlias = Any


@dataclass(frozen=True, eq=False)
class Decoded:
    """What a payload carried. ``tensors`` are dense float32 (zeros outside the mask for sparse ones); ``masks``
    has a bool mask for every tensor that was sent sparse. They are torch tensors (torch.float32, torch.bool), or
    numpy arrays (float32, bool) when decoded with ``arrays="numpy"``; of the shapes in the payload either way."""

    tensors: dict[str, Array]
    masks: dict[str, Array]
    model_id: str
    round: int
