"""The textbook side of ``bench/flower_side_by_side.py``: a plain PyTorch client loop, and Flower's simulation
engine running it.

Two users:

* the ceiling's child processes (``flower_side_by_side.py --child ceiling``, in the project's venv) take
  ``setup``, ``train_client`` and ``evaluate_client``;
* the Flower run, ``python bench/flower_app.py --workload JSON --out PATH`` in the Flower venv
  (``.bench-venvs/flower``, made by ``flower_side_by_side.py``), with ``PYTHONPATH=<repo>:<repo>/bench`` so that
  the clients use pfl_edge's model, deal and split, and so that Ray's actors import this module by name.

flwr is imported only inside the Flower functions: this module imports without it. Every client of a process
shares one ``setup`` (the data set as pfl_edge deals it, the model skeleton), made on its first message: a Ray
actor loads the data set once, in round 1, not once per client.

The Flower app uses the Message API of Flower 1.2x+: a ``ServerApp`` whose main runs ``flwr.serverapp.strategy.
FedAvg.start`` (every node trains and evaluates each round), and a ``ClientApp`` with a train and an evaluate
function. FedPer: the server's arrays are the base alone; a client keeps its personal blocks (the last K_P blocks,
``pfl_edge.split``) in ``context.state`` between rounds and sends only its base. Each round is timed on the server
(from ``configure_train`` to the end of ``aggregate_evaluate``): training, aggregation, evaluation of every
client's deployed model on its own test split, as pfl_edge's simulator does in a round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp

    from pfl_edge.checkpoint import ModelSpec
    from pfl_edge.data import Dataset, Partition
    from pfl_edge.federation import FederationConfig
    from pfl_edge.models import BlockModel
    from pfl_edge.split import Split


# ------------------------------------------------------------------------------------------ the textbook loop

@dataclass(frozen=True, eq=False)
class Setup:
    """What every client of a process shares: the deal (pfl_edge's), the model skeleton, the split, the init."""

    cfg: FederationConfig
    ds: Dataset
    part: Partition
    spec: ModelSpec
    model: BlockModel
    split: Split
    init: dict[str, Tensor]

    def train_data(self, i: int) -> tuple[Tensor, Tensor]:
        c = self.part.clients[i]
        return self.ds.train_x[c.train_idx], c.train_y

    def test_data(self, i: int) -> tuple[Tensor, Tensor]:
        c = self.part.clients[i]
        return self.ds.test_x[c.test_idx], c.test_y

    def personal_init(self) -> dict[str, Tensor]:
        return {k: self.init[k].clone() for k in self.split.personal}


_SETUP: dict[str, Setup] = {}


def setup(config: dict[str, Any]) -> Setup:
    """The federation ``config`` (``SimConfig`` keywords) as pfl_edge's simulator builds it (``build_context``):
    the deal, the model, the algorithm's split, the initial state. Cached per process."""
    key = json.dumps(config, sort_keys=True)
    if key not in _SETUP:
        from pfl_edge.algorithms import get_algorithm
        from pfl_edge.checkpoint import build_model
        from pfl_edge.federation import SimConfig, deal, init_state

        _SETUP.clear()
        cfg = SimConfig.from_dict(dict(config))
        ds, part, spec = deal(cfg)
        model = build_model(spec)
        split = get_algorithm(cfg, model).split
        _SETUP[key] = Setup(cfg, ds, part, spec, model, split, init_state(cfg, spec))
    return _SETUP[key]


def generator(seed: int, t: int, client: int) -> torch.Generator:
    """Client ``client``'s batch order in round ``t``."""
    return torch.Generator().manual_seed((seed * 1_000_003 + t) * 1_000_003 + client)


def train_client(model: nn.Module, x: Tensor, y: Tensor, *, epochs: int, batch_size: int, lr: float,
                 momentum: float, gen: torch.Generator) -> tuple[float, int]:
    """The textbook loop: a fresh SGD optimizer, each epoch a fresh permutation, zero_grad / forward / backward /
    step per batch (the last batch partial). Returns the mean batch loss and the steps taken."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    total, steps = 0.0, 0
    for _ in range(epochs):
        perm = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            b = perm[i:i + batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[b]), y[b])
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
    return total / max(steps, 1), steps


@torch.no_grad()
def evaluate_client(model: nn.Module, x: Tensor, y: Tensor, chunk: int = 1000) -> tuple[float, float]:
    """Accuracy and mean loss of ``model`` on ``(x, y)``."""
    model.eval()
    correct, loss = 0, 0.0
    for i in range(0, len(x), chunk):
        out = model(x[i:i + chunk])
        correct += int((out.argmax(-1) == y[i:i + chunk]).sum())
        loss += float(F.cross_entropy(out, y[i:i + chunk], reduction="sum"))
    return correct / max(len(x), 1), loss / max(len(x), 1)


# ------------------------------------------------------------------------------------------ Flower: clients

def _workload(msg: Message) -> tuple[dict[str, Any], int]:
    cfg = msg.content.config_records["config"]
    return json.loads(str(cfg["workload"])), int(str(cfg["server-round"]))


def _metric(m: Message, key: str) -> float:
    return float(str(m.content.metric_records["metrics"][key]))


def _load(s: Setup, msg: Message, context: Context) -> None:
    """The model as the client deploys it: the server's base under its own personal blocks."""
    base = msg.content.array_records["arrays"].to_torch_state_dict()
    personal: dict[str, Tensor] = {}
    if s.split.personal:
        kept = context.state.array_records
        personal = kept["personal"].to_torch_state_dict() if "personal" in kept else s.personal_init()
    s.model.load_state_dict({**base, **personal})


def flower_train(msg: Message, context: Context) -> Message:
    """One client's local training: base in, base out; personal blocks kept in ``context.state``."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    torch.set_num_threads(1)
    w, t = _workload(msg)
    pid = int(context.node_config["partition-id"])
    s = setup(w["config"])
    cfg = s.cfg
    _load(s, msg, context)
    x, y = s.train_data(pid)
    loss, steps = train_client(s.model, x, y, epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr,
                               momentum=cfg.momentum, gen=generator(cfg.seed, t, pid))
    state = s.model.state_dict()
    if s.split.personal:
        context.state["personal"] = ArrayRecord(torch_state_dict={k: state[k] for k in s.split.personal})
    reply = RecordDict({
        "arrays": ArrayRecord(torch_state_dict={k: state[k] for k in s.split.base}),
        "metrics": MetricRecord({"num-examples": len(x), "train-loss": loss, "steps": steps}),
    })
    return Message(content=reply, reply_to=msg)


def flower_evaluate(msg: Message, context: Context) -> Message:
    """One client's deployed model (the new base under its personal blocks) on its own test split."""
    from flwr.app import Message, MetricRecord, RecordDict

    torch.set_num_threads(1)
    w, _ = _workload(msg)
    pid = int(context.node_config["partition-id"])
    s = setup(w["config"])
    _load(s, msg, context)
    x, y = s.test_data(pid)
    acc, loss = evaluate_client(s.model, x, y)
    reply = RecordDict({"metrics": MetricRecord({"num-examples": len(x), "accuracy": acc, "eval-loss": loss,
                                                 "partition-id": pid})})
    return Message(content=reply, reply_to=msg)


def client_app() -> ClientApp:
    """The ClientApp: module-level functions, so Ray's actors import them from this module by name (and keep
    this module's ``setup`` cache between messages)."""
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.train()(flower_train)
    app.evaluate()(flower_evaluate)
    return app


# ------------------------------------------------------------------------------------------ Flower: server

_RUN: dict[str, Any] = {}  # the workload, and what the server records (the ServerApp runs in this process)


def server_main(grid: Grid, context: Context) -> None:
    """FedAvg over every node, ``rounds`` rounds; each round's wall time, per-client accuracy and failures."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
    from flwr.serverapp.strategy import FedAvg

    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.checkpoint import build_model
    from pfl_edge.federation import SimConfig, deal_labels, init_state

    w = _RUN["workload"]
    cfg = SimConfig.from_dict(dict(w["config"]))
    _, spec = deal_labels(cfg)  # the model's shape, from the labels alone: the server holds no images
    model = build_model(spec)
    split = get_algorithm(cfg, model).split
    init = init_state(cfg, spec)
    rounds: dict[int, dict[str, Any]] = {}

    def failures(replies: list[Message], what: str) -> None:
        bad = [m for m in replies if m.has_error()]
        if bad:
            raise RuntimeError(f"{len(bad)} {what} replies failed, e.g.: {bad[0].error.reason}")

    class TimedFedAvg(FedAvg):
        def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                            grid: Grid) -> Any:
            rounds[server_round] = {"round": server_round, "start": time.perf_counter()}
            return super().configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round: int, replies: Any) -> Any:
            replies = list(replies)
            failures(replies, "train")
            r = rounds[server_round]
            r["train_replies"] = len(replies)
            r["train_loss"] = (sum(_metric(m, "train-loss") * _metric(m, "num-examples") for m in replies)
                               / sum(_metric(m, "num-examples") for m in replies))
            out = super().aggregate_train(server_round, replies)
            r["train_done"] = time.perf_counter()
            return out

        def aggregate_evaluate(self, server_round: int, replies: Any) -> MetricRecord | None:
            replies = list(replies)
            failures(replies, "evaluate")
            out = super().aggregate_evaluate(server_round, replies)
            end = time.perf_counter()
            r = rounds[server_round]
            acc = {int(_metric(m, "partition-id")): _metric(m, "accuracy") for m in replies}
            r.update(eval_replies=len(replies), end=end, wall_s=end - r["start"],
                     train_s=r["train_done"] - r["start"], eval_s=end - r["train_done"],
                     mean_acc=sum(acc.values()) / len(acc), client_acc=[acc[i] for i in sorted(acc)])
            print(f"    flower round {server_round}: {r['wall_s']:.2f} s, acc {r['mean_acc']:.3f}", file=sys.stderr,
                  flush=True)
            return out

    n = cfg.clients
    strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=n, min_evaluate_nodes=n,
                           min_available_nodes=n)
    conf = ConfigRecord({"workload": json.dumps(w)})
    _RUN["server_start"] = time.perf_counter()
    strategy.start(grid=grid, initial_arrays=ArrayRecord(torch_state_dict={k: init[k] for k in split.base}),
                   num_rounds=cfg.rounds, timeout=float(w.get("timeout", 24 * 3600)), train_config=conf,
                   evaluate_config=ConfigRecord({"workload": json.dumps(w)}))
    _RUN["rounds"] = [rounds[t] for t in sorted(rounds)]


def server_app() -> ServerApp:
    from flwr.serverapp import ServerApp

    app = ServerApp()
    app.main()(server_main)
    return app


def versions() -> dict[str, str]:
    from importlib.metadata import version

    out = {"python": sys.version.split()[0]}
    for p in ("flwr", "ray", "torch", "numpy"):
        out[p] = version(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="one Flower simulation of a workload (bench/flower_side_by_side.py)")
    ap.add_argument("--workload", required=True, help="JSON: {name, config: SimConfig keywords}")
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--ray-temp-dir", required=True, help="Ray's temp dir (its session dir lies under it)")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs Ray may use (actors: num_cpus / client_cpus)")
    ap.add_argument("--client-cpus", type=float, default=1.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    from flwr.simulation import run_simulation

    w = json.loads(args.workload)
    _RUN["workload"] = w
    backend_config: dict[str, Any] = {
        "client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0},
        "init_args": {"num_cpus": args.num_cpus, "_temp_dir": args.ray_temp_dir, "include_dashboard": False},
    }
    run_simulation(server_app=server_app(), client_app=client_app(), num_supernodes=int(w["config"]["clients"]),
                   backend_config=backend_config)
    if "rounds" not in _RUN:
        raise SystemExit("the ServerApp did not finish its rounds (see the log above)")
    rounds = _RUN["rounds"]
    out = {
        "versions": versions(),
        "backend_config": backend_config,
        "setup_s": rounds[0]["start"] - t0,
        "total_s": time.perf_counter() - t0,
        "rounds": [{k: v for k, v in r.items() if k not in ("start", "end", "train_done")} for r in rounds],
        "pid": os.getpid(),
    }
    args.out.write_text(json.dumps(out))


if __name__ == "__main__":
    # Run as a script, this file is __main__; Ray must import the client functions by module name (from
    # PYTHONPATH) so that an actor keeps one module, and its setup cache, across messages.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import flower_app

    flower_app.main()
