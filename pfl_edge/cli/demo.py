"""``pfl-edge demo``: the running system on one machine, or (``--simulate``) a short simulated federation."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import _check_writable
from .simulate import _sim_config


def _cmd_demo(args: argparse.Namespace) -> int:
    """The running system on one machine: the server, the embedded broker and N device processes."""
    if args.simulate:
        return _sim_demo(args)
    from edge_runtime.fleet import DemoConfig, run_demo

    cfg = DemoConfig(devices=args.devices, rounds=args.rounds, algorithm=args.algorithm, fleet=args.fleet,
                     out=str(args.out), dataset=args.dataset, partition=args.partition, seed=args.seed,
                     samples_per_client=args.samples_per_client, broker_url=args.broker_url,
                     database_url=args.database_url, live=not args.no_progress,
                     training_backend=None if args.training_backend == "profile" else args.training_backend)
    _check_writable(Path(args.out) / "metrics.json", None)
    summary = run_demo(cfg)
    return 0 if summary["finished"] else 1


def _sim_demo(args: argparse.Namespace) -> int:
    """A short simulated federation: FedPer against FedAvg on a pathological non-IID split."""
    from ..sim import client_table, plot_rounds, simulate, write_result

    out = Path(args.out)
    _check_writable(out / "fedper.json", None)
    results = {}
    for alg in ("fedper", "fedavg"):
        cfg = _sim_config(args, dataset="fashion-mnist", partition="pathological:2", clients=10, rounds=10,
                          samples_per_client=500, local_epochs=1).replace(algorithm=alg)
        print(f"== {alg}: {cfg.clients} clients, {cfg.rounds} rounds, {cfg.dataset} {cfg.partition}", flush=True)
        res = simulate(cfg, save_dir=out / "checkpoints" / alg, progress=False if args.no_progress else None)
        write_result(res, out / f"{alg}.json")
        print(client_table(res), flush=True)
        results[alg] = res
    plot_rounds(results, out / "accuracy.png", title="FedPer vs FedAvg (simulated)")
    a, b = results["fedper"]["final"]["mean_acc"], results["fedavg"]["final"]["mean_acc"]
    print(f"\nFedPer {a:.3f} vs FedAvg {b:.3f} mean client accuracy. Results, plots and checkpoints in {out}/")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="a federation on this machine: server, embedded broker, N device processes")
    p.add_argument("--devices", type=int, default=6, help="device processes (default 6)")
    p.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    p.add_argument("--algorithm", default="fedper", help="fedper | fedper-ft | fedavg | dispfl")
    p.add_argument("--fleet", default="mixed", help="device fleet the devices are drawn from (pfl-edge list)")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--partition", default="pathological:2", help="non-IID split (default pathological:2)")
    p.add_argument("--samples-per-client", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--broker-url", default="embedded", help="embedded (default) or mqtt://host:port")
    p.add_argument("--database-url", default=None, help="default: SQLite in the run folder")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="run folder (default runs/demo)")
    p.add_argument("--no-progress", action="store_true", help="no live table; one line per round")
    p.add_argument("--training-backend", choices=["torch", "profile"], default="torch",
                   help="torch (default): every device trains in eager PyTorch; profile: each device uses its "
                        "profile's backend (ExecuTorch on the phones: about 85x slower per step on this CPU)")
    p.add_argument("--simulate", action="store_true",
                   help="instead: the in-process simulator, FedPer vs FedAvg (10 clients, 10 rounds)")
    p.set_defaults(func=_cmd_demo, config=None, local_norm_stats=None)
