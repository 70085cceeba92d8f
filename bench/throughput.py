"""Simulator training throughput against a plain single-model PyTorch loop, side by side in one run.

Both train the same samples (every client's local data for one round), the same model and batch size; the plain
loop is the textbook ``for x, y in batches: zero_grad / forward / backward / step`` over one model per client.
Writes bench/results/throughput.json.

    .venv/bin/python bench/throughput.py [--clients 10] [--samples 1000] [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from pfl_edge.data import get_dataset, partition
from pfl_edge.models import get_model
from pfl_edge.parallel import Trainer
from pfl_edge.seeding import generator, numpy_rng
from pfl_edge.train import ClientTensors, TrainConfig, batch_schedule, stack_states, train


def plain_loop(model: torch.nn.Module, data: ClientTensors, cfg: TrainConfig, idx: torch.Tensor,
               w: torch.Tensor) -> float:
    """Seconds for the textbook loop over every client's batches, one client after another."""
    start = time.perf_counter()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    for c in range(data.x.shape[0]):
        model.load_state_dict(init)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        for s in range(idx.shape[0]):
            valid = w[s, c] > 0
            if not valid.any():
                break
            b = idx[s, c][valid]
            opt.zero_grad()
            F.cross_entropy(model(data.x[c, b]), data.y[c, b]).backward()
            opt.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "throughput.json")
    args = ap.parse_args()

    ds = get_dataset(args.dataset)
    p = partition("pathological:4", ds.train_y, ds.test_y, args.clients, ds.num_classes, numpy_rng(0, "p"),
                  samples_per_client=args.samples)
    data = ClientTensors.build(ds.train_x, [c.train_idx for c in p.clients], [c.train_y for c in p.clients])
    torch.manual_seed(0)
    model = get_model(args.model, num_classes=10, in_channels=ds.in_channels, image_size=ds.image_size)
    cfg = TrainConfig(epochs=1, batch_size=args.batch_size, lr=0.01, momentum=0.9)
    rows = torch.arange(args.clients)
    stack = stack_states([model.state_dict()] * args.clients)
    samples = int(data.n.sum())

    def gens() -> list[torch.Generator]:
        return [generator(0, "bench", i) for i in range(args.clients)]

    idx, w = batch_schedule(data.n, 1, args.batch_size, gens())
    t_vmap = Trainer(model, data, workers=2, engine="vmap")
    t_loop = Trainer(model, data, workers=2, engine="loop")
    engines = {
        "plain_loop": lambda: plain_loop(model, data, cfg, idx, w),
        "sim_vmap": lambda: _timed(lambda: train(model, stack, data, rows, cfg, gens(), engine="vmap")),
        "sim_loop": lambda: _timed(lambda: train(model, stack, data, rows, cfg, gens(), engine="loop")),
        "sim_2workers_vmap": lambda: _timed(lambda: t_vmap.train(stack, rows, cfg, gens())),
        "sim_2workers_loop": lambda: _timed(lambda: t_loop.train(stack, rows, cfg, gens())),
    }
    for fn in engines.values():  # warm-up: allocator, oneDNN kernels
        fn()
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits every engine alike
        for k, fn in engines.items():
            times[k].append(fn())
    best = {k: min(v) for k, v in times.items()}
    rate = {k: samples / v for k, v in best.items()}
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "samples": samples,
        "seconds": times,
        "samples_per_s": rate,
        "ratio_vs_plain": {k: rate[k] / rate["plain_loop"] for k in rate},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for k in rate:
        print(f"{k:12s} {rate[k]:9.0f} samples/s  x{result['ratio_vs_plain'][k]:.2f} of the plain loop")


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
