"""Training sharded over worker processes, so that a 2-core machine trains two clients at a time.

Small models leave cores idle under intra-op threading (a 5x5 convolution on 32 images is too small to split
well), so each worker trains its share of the clients on one thread. Workers are forked once per run and
inherit the model and the client data; each call ships only the clients' states (through shared memory) and
their generators' states. Results are identical to ``train`` in this process, up to float rounding.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .errors import ConfigError
from .train import (
    ClientTensors,
    Engine,
    Stack,
    TrainConfig,
    TrainResult,
    dense_gradients,
    evaluate,
    index_stack,
    train,
)

__all__ = ["Trainer", "default_workers"]

_WORKER: dict[str, Any] = {}


def default_workers() -> int:
    """One worker per usable core (at most 8), or 1 where processes cannot be forked."""
    if "fork" not in mp.get_all_start_methods():
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 8))


def _init_worker(model: nn.Module, data: ClientTensors, test_data: ClientTensors | None, threads: int) -> None:
    torch.set_num_threads(threads)
    _WORKER["model"], _WORKER["data"], _WORKER["test_data"] = model, data, test_data


def _gens(states: list[Tensor]) -> list[torch.Generator]:
    gens = []
    for s in states:
        g = torch.Generator()
        g.set_state(s)
        gens.append(g)
    return gens


def _grads_shard(args: tuple[Any, ...]) -> Stack:
    stack, rows, batch_size, gen_states = args
    return dense_gradients(_WORKER["model"], stack, _WORKER["data"], rows, batch_size, _gens(gen_states))


def _evaluate_shard(args: tuple[Any, ...]) -> tuple[Tensor, Tensor]:
    stack, rows = args
    return evaluate(_WORKER["model"], stack, _WORKER["test_data"], rows)


def _train_shard(args: tuple[Any, ...]) -> TrainResult:
    stack, rows, cfg, gen_states, trainable, masks, anchor, engine = args
    return train(_WORKER["model"], stack, _WORKER["data"], rows, cfg, _gens(gen_states), trainable=trainable,
                 masks=masks, anchor=anchor, engine=engine)


class Trainer:
    """``train`` and ``evaluate`` over a fixed model and client data, in this process (``workers=1``) or
    sharded over forked worker processes. Use as a context manager, or call ``close``."""

    def __init__(self, model: nn.Module, data: ClientTensors, test_data: ClientTensors | None = None, *,
                 workers: int | None = None, engine: Engine = "auto") -> None:
        self.model, self.data, self.test_data = model, data, test_data
        self.workers = default_workers() if workers is None else workers
        # "auto" is the plain loop whatever the worker count, so that a run's numbers do not depend on the
        # machine's cores; on one thread per worker it is also the faster engine (bench/throughput.py).
        # vmap (all clients' steps in one call) is opt-in.
        self.engine: Engine = "loop" if engine == "auto" else engine
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        self._pool: Any = None
        if self.workers > 1:
            if "fork" not in mp.get_all_start_methods():
                raise ConfigError("workers > 1 needs the 'fork' start method (Linux); use workers=1")
            threads = max(1, torch.get_num_threads() // self.workers)
            ctx = torch.multiprocessing.get_context("fork")
            self._pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(model, data, test_data, threads))

    def train(self, stack: Mapping[str, Tensor], rows: Tensor, cfg: TrainConfig, gens: Sequence[torch.Generator],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainResult:
        if self._pool is None or len(rows) < 2:
            return train(self.model, stack, self.data, rows, cfg, gens, trainable=trainable, masks=masks,
                         anchor=anchor, engine=self.engine)
        shards = _balance(self.data.n[rows].tolist(), self.workers)
        jobs = []
        for pos in shards:
            sel = torch.tensor(pos, dtype=torch.int64)
            jobs.append((index_stack(stack, sel), rows[sel], cfg, [gens[i].get_state() for i in pos],
                         None if trainable is None else list(trainable),
                         None if masks is None else index_stack(masks, sel),
                         None if anchor is None else index_stack(anchor, sel), self.engine))
        parts: list[TrainResult] = self._pool.map(_train_shard, jobs)
        cat = _concat_in_order(shards)
        stack_out = {k: cat([p.stack[k] for p in parts]) for k in parts[0].stack}
        return TrainResult(stack_out, cat([p.loss for p in parts]), cat([p.steps for p in parts]),
                           cat([p.samples for p in parts]))

    def evaluate(self, stack: Mapping[str, Tensor], rows: Tensor) -> tuple[Tensor, Tensor]:
        """Accuracy and loss of each client's model on its test data (``pfl_edge.train.evaluate``)."""
        if self.test_data is None:
            raise ConfigError("this Trainer has no test data")
        if self._pool is None or len(rows) < 2:
            return evaluate(self.model, stack, self.test_data, rows)
        shards = _balance(self.test_data.n[rows].tolist(), self.workers)
        jobs = [(index_stack(stack, torch.tensor(pos)), rows[torch.tensor(pos)]) for pos in shards]
        parts: list[tuple[Tensor, Tensor]] = self._pool.map(_evaluate_shard, jobs)
        cat = _concat_in_order(shards)
        return cat([p[0] for p in parts]), cat([p[1] for p in parts])

    def dense_gradients(self, stack: Mapping[str, Tensor], rows: Tensor, batch_size: int,
                        gens: Sequence[torch.Generator]) -> Stack:
        """``pfl_edge.train.dense_gradients``, sharded over the workers."""
        if self._pool is None or len(rows) < 2:
            return dense_gradients(self.model, stack, self.data, rows, batch_size, gens)
        shards = _balance([1] * len(rows), self.workers)
        jobs = [(index_stack(stack, torch.tensor(pos)), rows[torch.tensor(pos)], batch_size,
                 [gens[i].get_state() for i in pos]) for pos in shards]
        parts: list[Stack] = self._pool.map(_grads_shard, jobs)
        cat = _concat_in_order(shards)
        return {k: cat([p[k] for p in parts]) for k in parts[0]}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _concat_in_order(shards: list[list[int]]) -> Any:
    """A function that concatenates per-shard results back into the callers' order."""
    order = torch.tensor([i for pos in shards for i in pos], dtype=torch.int64)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))

    def cat(ts: list[Tensor]) -> Tensor:
        return torch.cat(ts)[inverse]

    return cat


def _balance(sizes: list[int], workers: int) -> list[list[int]]:
    """Positions split into at most ``workers`` non-empty shards of about equal total size (greedy LPT)."""
    loads = [0] * min(workers, len(sizes))
    shards: list[list[int]] = [[] for _ in loads]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = loads.index(min(loads))
        shards[j].append(i)
        loads[j] += sizes[i]
    return [sorted(s) for s in shards]
