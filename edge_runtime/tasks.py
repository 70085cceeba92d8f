"""What a device acts on: its task as the server states it over HTTP (authenticated), never its broker's word.

MQTT is a doorbell: a task or round message makes the agent ask the server for its current task
(``GET /v1/rounds/current/task``) and act on that answer only; the broker's copy is compared only to log a
mismatch (a stale retained message, or a forged one). Likewise a "finished" announcement ends a device only
once the server says its federation has finished. And a model a device receives (a base, a neighbour's) is
used only if every value is finite: anything else makes it skip the round (``UnusableModel``), never crash.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from pfl_edge.algorithms import Neighbour, Received
from pfl_edge.arrays import Array as Tensor
from pfl_edge.arrays import is_numpy
from pfl_edge.codec import Decoded, decode
from pfl_edge.errors import CodecError
from pfl_edge.protocol import API_PREFIX, Task

from .http import Http, ServerError

__all__ = ["Downloads", "TaskSource", "UnusableModel", "all_finite", "finite_metric", "mismatch"]

log = logging.getLogger("pfl_edge.client")


class UnusableModel(CodecError):
    """A model the device received does not decode against its own, or holds NaN/Inf: it skips the round."""


def all_finite(tensors: Mapping[str, Tensor]) -> bool:
    """No NaN or Inf in any floating tensor (torch or numpy)."""
    return all(bool(np.isfinite(v).all()) if is_numpy(v) else bool(v.isfinite().all())
               for v in tensors.values() if (np.issubdtype(v.dtype, np.floating) if is_numpy(v)
                                             else v.is_floating_point()))


def finite_metric(m: Mapping[str, Any]) -> bool:
    """A metric record whose accuracy and loss are finite numbers (the server refuses any other)."""
    return all(isinstance(m.get(k), (int, float)) and math.isfinite(m[k]) for k in ("accuracy", "loss"))


def mismatch(hint: Task, task: Task | None) -> str | None:
    """How the broker's task ``hint`` differs from the server's ``task`` (None: it does not, or it is only stale)."""
    if task is None:
        return f"the broker's task of round {hint.round} is not the server's: the server has no task for it now"
    if hint.round != task.round or hint.final != task.final:
        return None  # an older or newer round's retained task: stale, not forged
    if hint.base != task.base:
        return f"round {task.round}: the broker names base {hint.base}, the server {task.base}"
    if [n.model_dump() for n in hint.neighbours] != [n.model_dump() for n in task.neighbours]:
        return f"round {task.round}: the broker's neighbours differ from the server's"
    return None


class TaskSource:
    """The server's word on this device's task and its federation's state."""

    def __init__(self, http: Http, federation: str) -> None:
        self.http = http
        self.federation = federation

    def current(self) -> Task | None:
        """This device's task now, as the server states it; None when it has none (404)."""
        try:
            r = self.http.call("GET", f"{API_PREFIX}/rounds/current/task")
        except ServerError as e:
            if e.status == 404:
                return None
            raise
        task = Task.model_validate(r.json())
        if task.federation != self.federation:
            raise ServerError(f"the server sent a task of federation {task.federation!r}, not {self.federation!r}")
        return task

    def finished(self) -> bool:
        """Has the federation finished, as the server says?"""
        info = self.http.call("GET", f"{API_PREFIX}/federations/{self.federation}").json()
        return bool(info.get("state") == "finished")


class Downloads:
    """The models a task names, fetched over HTTP and checked before use: sha256, names, shapes and model id
    against this device's model, and every value finite (else ``UnusableModel``)."""

    def __init__(self, http: Http, device_id: str, shapes: Mapping[str, tuple[int, ...]], model_id: str,
                 max_bytes: int, *, arrays: Literal["torch", "numpy"] = "torch") -> None:
        self.http = http
        self.device_id = device_id
        self.expected = dict(shapes)  # the device's model: every tensor's shape
        self.arrays: Literal["torch", "numpy"] = arrays  # what the models it fetched are decoded to
        self.model_id = model_id
        self.max_bytes = max_bytes
        self.down = 0  # bytes fetched by the last ``received`` or ``model``
        self.fetch_s = 0.0  # seconds those fetches took

    def fetch(self, digest: str) -> bytes:
        start = time.monotonic()
        data = self.http.call("GET", f"{API_PREFIX}/blobs/{digest}", max_bytes=self.max_bytes).content
        self.fetch_s += time.monotonic() - start
        if hashlib.sha256(data).hexdigest() != digest:
            raise ServerError(f"blob {digest} arrived with other content (sha256 mismatch); not using it")
        self.down += len(data)
        return data

    def decode(self, payload: bytes) -> Decoded:
        """A model (or a part) checked against this device's model: names, shapes, model id, finite values."""
        try:
            d = decode(payload, expected=self.expected, model_id=self.model_id, max_bytes=self.max_bytes,
                       allow_missing=True, arrays=self.arrays)
        except CodecError as e:
            raise UnusableModel(f"a model it received is unusable: {e}") from e
        if not all_finite(d.tensors):  # decode refuses NaN/Inf too; checked here where it is used
            raise UnusableModel("a model it received holds NaN or Inf")
        return d

    def model(self, digest: str) -> dict[str, Tensor]:
        self.down, self.fetch_s = 0, 0.0
        return self.decode(self.fetch(digest)).tensors

    def received(self, task: Task) -> tuple[Received, int]:
        """What ``task`` names, fetched and checked: the shared base, or the neighbours' models; bytes down."""
        self.down, self.fetch_s = 0, 0.0
        base = None if task.base is None else self.decode(self.fetch(task.base)).tensors
        nbrs = []
        for n in task.neighbours:
            if n.device_id != self.device_id:
                d = self.decode(self.fetch(n.digest))
                nbrs.append(Neighbour(n.index, d.tensors, d.masks))
        return Received(base, nbrs), self.down
