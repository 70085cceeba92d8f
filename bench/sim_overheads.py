"""The simulator's per-client overheads that issue 19 removed, each side by side with what it replaced, in one run
(single thread): the streaming average's cost per cnn update (a float64 product tensor then a sum, against one
``add_`` with alpha), making the workers' shared result for 1,000 cnn clients (``share_memory_()`` against
``parallel._shared_empty``), and training 100 clients of 60 samples with the plain loop against the batched vmap
engine. Writes ``bench/results/sim_overheads.json``.

    .venv/bin/python bench/sim_overheads.py
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from pfl_edge.aggregate import PartialAverage
from pfl_edge.models import get_model
from pfl_edge.parallel import _shared_empty
from pfl_edge.seeding import generator
from pfl_edge.train import ClientTensors, TrainConfig, train

OUT = Path(__file__).resolve().parent / "results" / "sim_overheads.json"


def _average(model_state: dict[str, torch.Tensor], n: int) -> dict[str, float]:
    ups = [{k: torch.randn_like(v) for k, v in model_state.items()} for _ in range(n)]
    t = time.perf_counter()
    acc: dict[str, torch.Tensor] = {}
    for u in ups:  # what PartialAverage.add did before: a product tensor per update, then the sum
        for k, v in u.items():
            c = v.to(torch.float64) * 60.0
            acc[k] = acc[k] + c if k in acc else c
    before = (time.perf_counter() - t) / n
    t = time.perf_counter()
    avg = PartialAverage()
    for u in ups:
        avg.add(u, 60.0)
    after = (time.perf_counter() - t) / n
    return {"before_ms_per_update": 1e3 * before, "after_ms_per_update": 1e3 * after}


def _shared(model_state: dict[str, torch.Tensor], clients: int) -> dict[str, float]:
    t = time.perf_counter()
    a = {k: torch.empty((clients, *v.shape)).share_memory_() for k, v in model_state.items()}
    before = time.perf_counter() - t
    del a
    t = time.perf_counter()
    b = {k: _shared_empty(torch.Size((clients, *v.shape)), v.dtype) for k, v in model_state.items()}
    after = time.perf_counter() - t
    del b
    return {"share_memory_s": before, "made_shared_s": after}


def _engines(model: torch.nn.Module, clients: int, samples: int) -> dict[str, float]:
    x = torch.randn(clients * samples, 1, 28, 28)
    y = torch.randint(0, 10, (clients * samples,))
    idx = [torch.arange(i * samples, (i + 1) * samples) for i in range(clients)]
    data = ClientTensors.build(x, idx, [y[i] for i in idx])
    stack = {k: v.unsqueeze(0).expand(clients, *v.shape) for k, v in model.state_dict().items()}
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.01, momentum=0.9)
    rows = torch.arange(clients)
    out = {}
    for engine in ("loop", "vmap", "loop", "vmap"):  # the second of each counts (the first warms up)
        t = time.perf_counter()
        train(model, stack, data, rows, cfg, [generator(0, "x", i) for i in range(clients)], engine=engine)  # type: ignore[arg-type]
        out[f"{engine}_ms_per_client"] = 1e3 * (time.perf_counter() - t) / clients
    return out


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = get_model("cnn", num_classes=10, in_channels=1)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    load = os.getloadavg()
    res = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average_start": load,
           "average_200_updates": _average(state, 200), "shared_result_1000_clients": _shared(state, 1000),
           "train_100_clients_of_60": _engines(model, 100, 60), "load_average_end": os.getloadavg()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
