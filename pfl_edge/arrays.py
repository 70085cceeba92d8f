"""The one array interface of the code a device and the simulator share: client stacks, masks, averaging and
random draws on torch tensors or numpy arrays, the same definition for both.

The simulator's stacks are torch tensors; a device that installs no PyTorch holds numpy arrays. The rounds of
``pfl_edge.algorithms`` are written against the functions here, which dispatch on the array they are given (a
numpy array stays numpy, anything else is torch, imported only then), so that there is one definition of each
round and a device without torch computes its slot's row of the simulator's round. Random draws take a
``torch.Generator`` or its numpy twin ``seeding.MT`` (the same numbers); ``draws_numpy`` says which a client set
uses. Selections with ties (prune-and-regrow) break them by the lower index, the same on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from .seeding import MT

if TYPE_CHECKING:
    import torch

__all__ = [
    "Array",
    "Stack",
    "as_bool",
    "as_float",
    "broadcast_rows",
    "copy",
    "expand_rows",
    "is_broadcast",
    "is_numpy",
    "ones",
    "ones_like",
    "rand",
    "randperm",
    "select_largest",
    "select_smallest",
    "stack",
    "stack_states",
    "to_numpy",
    "unstack",
    "where",
    "zeros",
]

#: a torch.Tensor or a numpy.ndarray (the functions here take either and keep it)
Array: TypeAlias = Any
#: clients' states: every array carries a leading client dimension
Stack: TypeAlias = dict[str, Array]


def is_numpy(x: object) -> bool:
    return isinstance(x, np.ndarray | np.generic)


def _torch() -> Any:
    import torch

    return torch


def copy(x: Array) -> Array:
    return x.copy() if is_numpy(x) else x.clone()


def stack(xs: Sequence[Array]) -> Array:
    return np.stack(xs) if is_numpy(xs[0]) else _torch().stack(list(xs))


def expand_rows(x: Array, n: int) -> Array:
    """``n`` copies of ``x`` stacked (a new array)."""
    if is_numpy(x):
        return np.broadcast_to(x, (n, *x.shape)).copy()
    return x.unsqueeze(0).expand(n, *x.shape).clone()


def broadcast_rows(x: Array, n: int) -> Array:
    """``x`` in ``n`` rows that nobody may write: a view with no memory of its own (torch), so a round in which every
    client starts from one model holds it once, not ``n`` times; a copy on numpy (a device's one row)."""
    if is_numpy(x):
        return expand_rows(x, n)
    return x.unsqueeze(0).expand(n, *x.shape)


def is_broadcast(x: Array) -> bool:
    """Is ``x`` rows of one tensor (``broadcast_rows``)?"""
    return not is_numpy(x) and x.dim() > 0 and x.stride(0) == 0 and x.shape[0] > 1


def zeros(shape: Sequence[int], like: Array) -> Array:
    """float32 zeros, of ``like``'s kind."""
    if is_numpy(like):
        return np.zeros(tuple(shape), np.float32)
    return _torch().zeros(tuple(shape))


def ones(shape: Sequence[int], like: Array) -> Array:
    """float32 ones, of ``like``'s kind."""
    if is_numpy(like):
        return np.ones(tuple(shape), np.float32)
    return _torch().ones(tuple(shape))


def ones_like(x: Array) -> Array:
    return np.ones_like(x) if is_numpy(x) else _torch().ones_like(x)


def as_float(x: Array, like: Array) -> Array:
    """``x`` in ``like``'s dtype."""
    return x.astype(like.dtype) if is_numpy(x) else x.to(like.dtype)


def as_bool(x: Array) -> Array:
    return x.astype(bool) if is_numpy(x) else x.bool()


def where(cond: Array, a: Array, b: Array | float) -> Array:
    return np.where(cond, a, b) if is_numpy(cond) else _torch().where(cond, a, b)


def to_numpy(x: Array) -> np.ndarray:
    return x if is_numpy(x) else x.detach().cpu().numpy()


def _select(x: Array, k: int, *, largest: bool) -> Array:
    """Indices (int64, ascending) of the ``k`` smallest (largest) elements of the 1-D ``x``; among equal values
    at the boundary, the lowest indices. One rule for both kinds, in O(n): the k-th value, everything strictly
    beyond it, then the first of its equals."""
    n = int(x.shape[0])
    if not 0 <= k <= n:
        raise ValueError(f"cannot select {k} of {n} elements")
    if k == 0:
        return np.zeros(0, np.int64) if is_numpy(x) else _torch().zeros(0, dtype=_torch().int64)
    if bool((x != x).any()):  # NaN matches no cut: fewer than k would be picked
        raise ValueError("cannot select among NaN values")
    if is_numpy(x):
        key = -x if largest else x
        kth = np.partition(key, k - 1)[k - 1]
        below = np.flatnonzero(key < kth)
        tied = np.flatnonzero(key == kth)[: k - len(below)]
        return np.sort(np.concatenate([below, tied])).astype(np.int64)
    torch = _torch()
    key = -x if largest else x
    kth = torch.kthvalue(key, k).values
    below = torch.nonzero(key < kth).flatten()
    tied = torch.nonzero(key == kth).flatten()[: k - len(below)]
    return torch.cat([below, tied]).sort().values


def select_smallest(x: Array, k: int) -> Array:
    return _select(x, k, largest=False)


def select_largest(x: Array, k: int) -> Array:
    return _select(x, k, largest=True)


def randperm(gen: torch.Generator | MT, n: int) -> Array:
    """``torch.randperm(n)`` from ``gen``: a numpy array from an ``MT``, a tensor from a torch generator."""
    if isinstance(gen, MT):
        return gen.randperm(n)
    return _torch().randperm(n, generator=gen)


def rand(gen: torch.Generator | MT, n: int) -> Array:
    """``torch.rand(n)`` (float32) from ``gen``."""
    if isinstance(gen, MT):
        return gen.rand(n)
    return _torch().rand(n, generator=gen)


def stack_states(states: Sequence[Mapping[str, Array]]) -> Stack:
    return {k: stack([s[k] for s in states]) for k in states[0]}


def unstack(st: Mapping[str, Array], i: int) -> dict[str, Array]:
    return {k: v[i, ...] for k, v in st.items()}  # a 0-d array, not a scalar, for a stack of 1-d rows
