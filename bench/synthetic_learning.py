"""How fast the quick runs learn on the synthetic set (issue 50's redefinition, docs/determinism.md §2) against the
torch-drawn set it replaced: the simulator, 4 clients (iid, 120 samples each), 4 rounds, the `cnn`, for FedAvg,
FedPer, Local and FedPer-FT; the final mean accuracy of each, per data set.
Writes bench/results/synthetic_learning.json.

    .venv/bin/python bench/synthetic_learning.py
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

import pfl_edge.data.sources as sources
from pfl_edge.sim import SimConfig, simulate

ALGORITHMS = ("fedavg", "fedper", "local", "fedper-ft")
QUICK = dict(dataset="synthetic", partition="iid", clients=4, rounds=4, samples_per_client=120, local_epochs=1,
             lr=0.05, batch_size=32)


def torch_drawn() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The set before 2026-12-07: torch's randn prototypes, bilinear upsampling, Gaussian noise of std 1.5."""
    gen = torch.Generator().manual_seed(20261129)
    protos = torch.nn.functional.interpolate(torch.randn(10, 1, 7, 7, generator=gen), size=(28, 28),
                                             mode="bilinear", align_corners=False)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = (torch.arange(n) % 10)[torch.randperm(n, generator=gen)]
        return (protos[y] + 1.5 * torch.randn(n, 1, 28, 28, generator=gen)).numpy(), y.numpy()

    return (*draw(6000), *draw(2000))


def run() -> dict[str, float]:
    return {a: float(simulate(SimConfig.from_dict({**QUICK, "algorithm": a}), progress=False)["final"]["mean_acc"])
            for a in ALGORITHMS}


def main() -> None:
    out: dict[str, object] = {"config": QUICK, "machine": platform.machine(), "torch_threads": torch.get_num_threads(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out["documented"] = run()
    print("documented set", out["documented"], flush=True)
    sources.make_synthetic = torch_drawn  # the loader is cached per process: this run is the second data set's
    sources.make_synthetic_labels = lambda: torch_drawn()[1::2]
    from pfl_edge.data import registry
    registry._load.cache_clear()
    registry._load_labels.cache_clear()
    registry._load_tensors.cache_clear()
    out["torch_drawn"] = run()
    print("torch-drawn set", out["torch_drawn"], flush=True)
    path = Path(__file__).parent / "results" / "synthetic_learning.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
