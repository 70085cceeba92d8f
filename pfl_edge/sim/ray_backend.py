"""The simulator's clients trained on a Ray cluster: ``RayTrainer`` has ``pfl_edge.parallel.Trainer``'s methods
(what the algorithms call), over Ray actors instead of forked processes.

Each actor holds a fixed run of clients, its *shard*: their rows of the training and test ``ClientTensors``, sent
once from the driver when the actor starts (the nodes need pfl-edge and torch, never the data set), and the
model. A call sends each actor only its clients' rows of the states (and their generators' states, masks and
anchors), the actor runs the pure ``pfl_edge.train`` function on one thread, and the driver puts the rows back
in the caller's order. A client trains on the same actor in every call, on the same arithmetic as a forked
worker (the plain loop, one thread, one client at a time), so the results equal the fork backend's bit for bit
where its workers run on one thread too (docs/simulation.md: when they do not).

Ray is an optional extra (``pip install 'pfl-edge[ray]'``), imported only when a ``RayTrainer`` is made.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..algorithms.base import Trainer
from ..arrays import is_broadcast
from ..errors import ConfigError, InternalError
from ..parallel import balanced_runs, generators
from ..train import ClientTensors, Engine, Stack, TrainConfig, TrainResult, dense_gradients, evaluate, train

__all__ = ["RAY_MISSING", "RayTrainer", "TrainerLike", "import_ray"]

RAY_MISSING = "the ray backend needs Ray: pip install 'pfl-edge[ray]'"


class TrainerLike(Trainer, Protocol):
    """What the simulator needs of a trainer: the algorithms' ``Trainer`` (train, evaluate, dense_gradients), its
    ``workers`` (the processes or actors it trains on), the ``engine`` it resolved, and ``close``.
    ``pfl_edge.parallel.Trainer`` (forked workers) and ``RayTrainer`` are two."""

    workers: int
    engine: Engine

    def close(self) -> None: ...


def import_ray() -> Any:
    """The ``ray`` module, or a ConfigError that says what to install."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


def _rows(stack: Mapping[str, Tensor], pos: Tensor) -> Stack:
    """Positions ``pos`` of every tensor of a stack, in tensors of their own: one model seen in every row (a
    stride-0 view, ``arrays.broadcast_rows``) is sent as that one model."""
    out = {}
    for k, v in stack.items():
        if is_broadcast(v):
            out[k] = v[0].clone().expand(len(pos), *v.shape[1:])
        else:
            out[k] = v[pos]  # indexing by a tensor copies just these rows
    return out


class _Shard:
    """One actor's clients (a run of the data's rows, re-indexed from 0) and the model; what it computes is the
    pure ``pfl_edge.train`` functions, on one thread as a forked worker does."""

    def __init__(self, model: nn.Module, data: ClientTensors, test_data: ClientTensors | None,
                 engine: Engine) -> None:
        torch.set_num_threads(1)
        self.model, self.data, self.test_data, self.engine = model, data, test_data, engine

    def node_id(self) -> str:
        """The Ray node this actor runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def train(self, stack: Stack, rows: Tensor, cfg: TrainConfig, gen_states: list[Tensor],
              trainable: list[str] | None, masks: Stack | None, anchor: Stack | None) -> TrainResult:
        return train(self.model, stack, self.data, rows, cfg, generators(gen_states), trainable=trainable, masks=masks,
                     anchor=anchor, engine=self.engine)

    def evaluate(self, stack: Stack, rows: Tensor) -> tuple[Tensor, Tensor]:
        if self.test_data is None:  # the driver checks first
            raise InternalError("this actor holds no test data")
        return evaluate(self.model, stack, self.test_data, rows)

    def dense_gradients(self, stack: Stack, rows: Tensor, batch_size: int, gen_states: list[Tensor]) -> Stack:
        return dense_gradients(self.model, stack, self.data, rows, batch_size, generators(gen_states))


class RayTrainer:
    """``train``, ``evaluate`` and ``dense_gradients`` of ``pfl_edge.parallel.Trainer`` over Ray actors, each
    holding a fixed run of clients (``parallel.balanced_runs`` by training samples). Use as a context manager, or call
    ``close``.

    ``address``: the cluster to join (``ray.init(address=...)``, e.g. ``HEAD:6379`` of ``ray start --head``).
    Without it, ``ray.init()`` joins a cluster started on this machine (``RAY_ADDRESS``, or the last
    ``ray start``) or else starts a local one on this machine's cores. Where this process is connected to Ray
    already, that connection is used. ``workers``: the number of actors, each on one CPU (default: the
    cluster's CPUs), at most the number of clients.
    """

    def __init__(self, model: nn.Module, data: ClientTensors, test_data: ClientTensors | None = None, *,
                 workers: int | None = None, engine: Engine = "auto", address: str | None = None) -> None:
        ray = import_ray()
        if workers is not None and workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        self.model, self.data, self.test_data = model, data, test_data
        # as parallel.Trainer: "auto" is the plain loop, whatever the actor count, so the numbers do not depend on it
        self.engine: Engine = "loop" if engine == "auto" else engine
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        self._actors: list[Any] = []
        if self._owns_ray:
            ray.init(address=address)
        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            want = cpus if workers is None else workers
            if want > cpus or cpus < 1:
                # an actor asks for one CPU; more actors than CPUs would wait for ever
                raise ConfigError(f"{want} actors (workers) but the Ray cluster has {cpus} CPUs")
            self.bounds = balanced_runs(data.n.tolist(), want)
            self.workers = len(self.bounds)
            actor = ray.remote(num_cpus=1)(_Shard)
            self._actors = [
                # SPREAD: actors over every node before doubling up on one (the default packs a node first)
                actor.options(scheduling_strategy="SPREAD").remote(
                    model, data.shard(a, b), None if test_data is None else test_data.shard(a, b), self.engine)
                for a, b in self.bounds]
            # a client's owner: the run its index falls in
            self._starts = torch.tensor([a for a, _ in self.bounds], dtype=torch.int64)
        except BaseException:
            self.close()
            raise

    def node_ids(self) -> list[str]:
        """The Ray node of each actor, in shard order."""
        return list(self._ray.get([a.node_id.remote() for a in self._actors]))

    def _split(self, rows: Tensor) -> list[tuple[int, Tensor]]:
        """``rows`` by owning actor: (actor, positions in ``rows``) for each actor that owns any."""
        owner = torch.searchsorted(self._starts, rows, right=True) - 1
        out = []
        for i in range(self.workers):
            pos = torch.nonzero(owner == i).flatten()
            if len(pos):
                out.append((i, pos))
        return out

    def _call(self, method: str, rows: Tensor, args: Callable[[Tensor, Tensor], tuple[Any, ...]]
              ) -> tuple[list[Any], Callable[[list[Tensor]], Tensor]]:
        """``method`` on every actor owning some of ``rows``, with the arguments ``args(positions in rows, its
        local rows)``: the actors' results, and a function that puts the rows of the results' concatenation back
        in the caller's order."""
        parts = self._split(rows)
        refs = [getattr(self._actors[i], method).remote(*args(pos, rows[pos] - self._starts[i])) for i, pos in parts]
        inverse = torch.argsort(torch.cat([pos for _, pos in parts]))

        def cat(ts: list[Tensor]) -> Tensor:
            return torch.cat(ts)[inverse]

        return list(self._ray.get(refs)), cat

    def train(self, stack: Mapping[str, Tensor], rows: Tensor, cfg: TrainConfig, gens: Sequence[torch.Generator],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainResult:
        if len(rows) != len(gens):
            raise ConfigError(f"{len(rows)} clients but {len(gens)} generators")
        if len(rows) == 0:  # nothing to train: no actor is asked
            return train(self.model, stack, self.data, rows, cfg, gens, trainable=trainable, masks=masks,
                         anchor=anchor, engine=self.engine)
        names = None if trainable is None else list(trainable)
        parts, cat = self._call("train", rows, lambda pos, local: (
            _rows(stack, pos), local, cfg, [gens[i].get_state() for i in pos.tolist()], names,
            None if masks is None else _rows(masks, pos), None if anchor is None else _rows(anchor, pos)))
        return TrainResult({k: cat([p.stack[k] for p in parts]) for k in parts[0].stack},
                           cat([p.loss for p in parts]), cat([p.steps for p in parts]),
                           cat([p.samples for p in parts]))

    def evaluate(self, stack: Mapping[str, Tensor], rows: Tensor) -> tuple[Tensor, Tensor]:
        """Accuracy and loss of each client's model on its test data (``pfl_edge.train.evaluate``)."""
        if self.test_data is None:
            raise ConfigError("this Trainer has no test data")
        if len(rows) == 0:
            return evaluate(self.model, stack, self.test_data, rows)
        parts, cat = self._call("evaluate", rows, lambda pos, local: (_rows(stack, pos), local))
        return cat([p[0] for p in parts]), cat([p[1] for p in parts])

    def dense_gradients(self, stack: Mapping[str, Tensor], rows: Tensor, batch_size: int,
                        gens: Sequence[torch.Generator]) -> Stack:
        """``pfl_edge.train.dense_gradients``, each client on its actor."""
        if len(rows) == 0:
            return dense_gradients(self.model, stack, self.data, rows, batch_size, gens)
        parts, cat = self._call("dense_gradients", rows, lambda pos, local: (
            _rows(stack, pos), local, batch_size, [gens[i].get_state() for i in pos.tolist()]))
        return {k: cat([p[k] for p in parts]) for k in parts[0]}

    def close(self) -> None:
        """Kill the actors; shut Ray down where this object started (or joined) it."""
        for a in self._actors:
            self._ray.kill(a)
        self._actors = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
        self._owns_ray = False

    def __enter__(self) -> RayTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

