"""Training sharded over worker processes, so that a 2-core machine trains two clients at a time.

Small models leave cores idle under intra-op threading (a 5x5 convolution on 32 images is too small to split
well), so each worker trains its share of the clients on one thread. Workers are forked once per run and
inherit the model and the client data; each call ships only the clients' states (through shared memory) and
their generators' states. Results are identical to ``train`` in this process, up to float rounding.
"""

from __future__ import annotations

import itertools
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
    train,
)

__all__ = ["Trainer", "balanced_runs", "default_workers", "generators"]

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


def generators(states: list[Tensor]) -> list[torch.Generator]:
    """Generators from their states (``Generator.get_state()``): how a client's random stream reaches the worker or
    actor that trains it."""
    gens = []
    for s in states:
        g = torch.Generator()
        g.set_state(s)
        gens.append(g)
    return gens


def _grads_shard(args: tuple[Any, ...]) -> Stack:
    stack, rows, batch_size, gen_states = args
    return dense_gradients(_WORKER["model"], stack, _WORKER["data"], rows, batch_size, generators(gen_states))


def _evaluate_shard(args: tuple[Any, ...]) -> tuple[Tensor, Tensor]:
    stack, rows = args
    return evaluate(_WORKER["model"], stack, _WORKER["test_data"], rows)


def _train_shard(args: tuple[Any, ...]) -> tuple[Tensor, Tensor, Tensor]:
    stack, rows, cfg, gen_states, trainable, masks, anchor, engine, out = args
    # ``out``: this shard's rows of the caller's shared-memory result, written in place (nothing sent back)
    res = train(_WORKER["model"], stack, _WORKER["data"], rows, cfg, generators(gen_states), trainable=trainable,
                masks=masks, anchor=anchor, engine=engine, out=out)
    return res.loss, res.steps, res.samples


def _warm_up() -> None:
    """The first optimizer step of a process imports and sets up much of torch (seconds): done once here, before
    the workers fork, instead of once in each worker in every run's first round."""
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    (p * 2).sum().backward()
    opt.step()


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
            _warm_up()
            threads = max(1, torch.get_num_threads() // self.workers)
            ctx = torch.multiprocessing.get_context("fork")
            self._pool = ctx.Pool(self.workers, initializer=_init_worker, initargs=(model, data, test_data, threads))

    def train(self, stack: Mapping[str, Tensor], rows: Tensor, cfg: TrainConfig, gens: Sequence[torch.Generator],
              *, trainable: Collection[str] | None = None, masks: Mapping[str, Tensor] | None = None,
              anchor: Mapping[str, Tensor] | None = None) -> TrainResult:
        if self._pool is None:  # one client too goes to a worker: the same threads, the same bits, however called
            return train(self.model, stack, self.data, rows, cfg, gens, trainable=trainable, masks=masks,
                         anchor=anchor, engine=self.engine)
        shards = balanced_runs(self.data.n[rows].tolist(), self.workers)
        # the result lives in shared memory that each worker writes its rows of: no copy of a trained stack is
        # pickled back, concatenated and reordered; a shard is a run of rows, so its part of ``out`` is a view
        out = {k: _shared_empty(v.shape, v.dtype) for k, v in stack.items()}
        jobs = []
        for a, b in shards:
            sel = slice(a, b)
            jobs.append((_rows(stack, sel), rows[sel], cfg, [gens[i].get_state() for i in range(a, b)],
                         None if trainable is None else list(trainable),
                         None if masks is None else _rows(masks, sel),
                         None if anchor is None else _rows(anchor, sel), self.engine,
                         {k: v[sel] for k, v in out.items()}))
        parts: list[tuple[Tensor, Tensor, Tensor]] = self._pool.map(_train_shard, jobs)
        return TrainResult(out, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                           torch.cat([p[2] for p in parts]))

    def evaluate(self, stack: Mapping[str, Tensor], rows: Tensor) -> tuple[Tensor, Tensor]:
        """Accuracy and loss of each client's model on its test data (``pfl_edge.train.evaluate``)."""
        if self.test_data is None:
            raise ConfigError("this Trainer has no test data")
        if self._pool is None:
            return evaluate(self.model, stack, self.test_data, rows)
        shards = balanced_runs(self.test_data.n[rows].tolist(), self.workers)
        jobs = [(_rows(stack, slice(a, b)), rows[a:b]) for a, b in shards]
        parts: list[tuple[Tensor, Tensor]] = self._pool.map(_evaluate_shard, jobs)
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def dense_gradients(self, stack: Mapping[str, Tensor], rows: Tensor, batch_size: int,
                        gens: Sequence[torch.Generator]) -> Stack:
        """``pfl_edge.train.dense_gradients``, sharded over the workers."""
        if self._pool is None:
            return dense_gradients(self.model, stack, self.data, rows, batch_size, gens)
        shards = balanced_runs([1] * len(rows), self.workers)
        jobs = [(_rows(stack, slice(a, b)), rows[a:b], batch_size, [gens[i].get_state() for i in range(a, b)])
                for a, b in shards]
        parts: list[Stack] = self._pool.map(_grads_shard, jobs)
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rows(stack: Mapping[str, Tensor], sel: slice) -> Stack:
    """Rows ``sel`` of a stack as views (a worker's shard; pickling sends just those rows, and one model seen in
    every row, ``arrays.broadcast_rows``, as one model)."""
    return {k: v[sel] for k, v in stack.items()}


def _shared_empty(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """An uninitialised tensor in shared memory, made there (``share_memory_`` would allocate it privately and then
    copy it over: 6x slower for the 1.8 GB of 1,000 cnn clients)."""
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # torch's own, for tensors sent to workers
    if new_shared is None:
        return torch.empty(shape, dtype=dtype).share_memory_()
    numel = 1
    for n in shape:
        numel *= n
    storage = new_shared(numel * torch.empty((), dtype=dtype).element_size())
    strides: list[int] = []
    step = 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, strides)


def balanced_runs(sizes: Sequence[int], workers: int) -> list[tuple[int, int]]:
    """Positions split into at most ``workers`` non-empty runs ``[a, b)`` of about equal total size: the j-th
    boundary is the prefix whose total is nearest j/k of the whole. Runs, not arbitrary sets, so that a shard's
    rows of a stack are a view."""
    k = min(workers, len(sizes))
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + int(n))
    bounds = [0]
    for j in range(1, k):
        target = prefix[-1] * j / k
        lo, hi = bounds[-1] + 1, len(sizes) - (k - j)  # each run keeps at least one row
        bounds.append(min(range(lo, hi + 1), key=lambda b: (abs(prefix[b] - target), b)))
    bounds.append(len(sizes))
    return list(itertools.pairwise(bounds))
