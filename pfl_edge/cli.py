"""The ``pfl-edge`` command. Subcommands import what they need lazily, so ``pfl-edge --help`` stays fast."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError, PflEdgeError

__all__ = ["main"]

# flag -> (SimConfig field, type, help)
_SIM_FLAGS: list[tuple[str, type, str]] = [
    ("algorithm", str, "local | fedavg | fedavg-ft | fedper | fedper-ft | dispfl | dpsgd | dpsgd-ft"),
    ("model", str, "registered model (pfl-edge list)"),
    ("dataset", str, "registered data set (pfl-edge list)"),
    ("data-dir", str, "folder of the data set's files"),
    ("partition", str, "iid | pathological:K | dirichlet:ALPHA | preference[:P]"),
    ("clients", int, "number of clients"),
    ("rounds", int, "communication rounds"),
    ("local-epochs", int, "local epochs per round"),
    ("batch-size", int, "local batch size"),
    ("lr", float, "SGD learning rate"),
    ("lr-decay", float, "learning rate of round t: lr * lr_decay ** (t - 1)"),
    ("clip-norm", float, "clip each client's gradient norm to this"),
    ("momentum", float, "SGD momentum (state reset every round)"),
    ("weight-decay", float, "SGD weight decay"),
    ("kp", int, "FedPer: number of personal (trailing) blocks"),
    ("base", str, "deep | linear (FedPer's linear-base control)"),
    ("participation", float, "fraction of clients sampled per round"),
    ("samples-per-client", int, "cap on training samples per client"),
    ("test-per-client", int, "test samples per client (default ceil(test split / clients))"),
    ("ft-epochs", int, "-ft algorithms: fine-tuning epochs"),
    ("topology", str, "decentralized: random:K | ring | full"),
    ("density", float, "DisPFL: every client's density (1 - sparsity)"),
    ("densities", str, "DisPFL: comma-separated densities cycled over clients, e.g. 0.2,0.4,0.6,0.8,1.0"),
    ("alpha0", float, "DisPFL: initial prune rate (cosine-annealed)"),
    ("regrow", str, "DisPFL: gradient (the paper) | random (the released scripts)"),
    ("engine", str, "auto | vmap | loop (training engine)"),
    ("workers", int, "training processes (default: one per core)"),
    ("seed", int, "the one seed every random stream derives from"),
]


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    for flag, typ, help_ in _SIM_FLAGS:
        p.add_argument(f"--{flag}", type=typ, default=None, help=help_)
    p.add_argument("--local-norm-stats", action="store_true", default=None,
                   help="keep base normalisation statistics on the client (FedBN-style)")
    p.add_argument("--fleet", help="DisPFL: take the clients' densities from a device fleet (pfl-edge list)")
    p.add_argument("--config", type=Path, help="re-run a config: TOML, or the JSON of an earlier run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _sim_config(args: argparse.Namespace, **defaults: Any) -> Any:
    from .sim import SimConfig, load_config_file

    values: dict[str, Any] = dict(defaults)
    if args.config is not None:
        values.update(load_config_file(args.config))
    for flag, _, _ in _SIM_FLAGS:
        v = getattr(args, flag.replace("-", "_"))
        if v is not None:
            values[flag.replace("-", "_")] = v
    if isinstance(values.get("densities"), str):
        try:
            values["densities"] = tuple(float(d) for d in values["densities"].split(","))
        except ValueError:
            raise ConfigError(f"--densities takes comma-separated numbers, got {values['densities']!r}") from None
    if args.local_norm_stats:
        values["local_norm_stats"] = True
    if getattr(args, "fleet", None):
        from device_profiles import get_fleet

        # the fleet's densities in dealing order, cycled over clients; recorded as plain densities
        values["densities"] = get_fleet(args.fleet).densities()
    return SimConfig.from_dict(values)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .sim import client_table, simulate, write_result

    cfg = _sim_config(args)
    out = args.out or Path("runs") / f"{cfg.algorithm}.json"
    _check_writable(out, args.save_dir)
    result = simulate(cfg, save_dir=args.save_dir, progress=False if args.no_progress else None)
    write_result(result, out)
    print(client_table(result))
    print(f"results: {out}  plot: {Path(out).with_suffix('.png')}"
          + (f"  checkpoints: {args.save_dir}" if args.save_dir else ""))
    return 0


def _check_writable(out: Path, save_dir: Path | None) -> None:
    """Fail before a long run, not after it, when its results could not be written."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as {out / 'result.json'}")
    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        raise ConfigError(f"--save-dir {save_dir} exists and is not a folder")
    for d in (out.parent, save_dir):
        if d is None:
            continue
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {d}: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"{d} is not writable")


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
    from .sim import client_table, plot_rounds, simulate, write_result

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


def _cmd_server(args: argparse.Namespace) -> int:
    from server.main import serve
    from server.settings import load_settings

    overrides: dict[str, Any] = {}
    if args.data_dir is not None:
        overrides["data_dir"] = args.data_dir
    if args.broker_url:
        overrides["broker_url"] = args.broker_url
    if args.database_url:
        overrides["database_url"] = args.database_url
    serve(load_settings(args.settings, **overrides), host=args.host, port=args.port)
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    import logging

    from edge_runtime.agent import Agent, AgentConfig, install_signal_handlers

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in (("dataset", args.dataset), ("partition", args.partition),
                                   ("clients", args.num_partitions), ("seed", args.seed)) if v is not None}
    cfg = AgentConfig(server=args.server, federation=args.federation, enrol_secret=args.enrol_secret,
                      profile=args.profile, state_dir=str(args.state_dir), name=args.name,
                      partition_id=args.partition_id, threads=args.threads, data_dir=args.dataset_dir,
                      image_dir=args.data_dir, patience_s=args.patience, data_overrides=overrides,
                      training_backend=args.training_backend, training_program=args.training_program)
    agent = Agent(cfg)
    install_signal_handlers(agent)
    return agent.run()


def _cmd_check(args: argparse.Namespace) -> int:
    """Does a model fit each device class at its density and batch size?"""
    from device_profiles import check, get_profile, list_profiles

    from .data import get_dataset
    from .models import get_model
    from .table import format_table

    ds = get_dataset(args.dataset, data_dir=args.data_dir)
    model = get_model(args.model, num_classes=ds.num_classes, in_channels=ds.in_channels, image_size=ds.image_size)
    names = list_profiles() if args.profiles == "all" else args.profiles.split(",")
    rows = [("profile", "density", "batch", "params", "active", "train MB", "ceiling", "infer MB", "budget", "fits")]
    for name in names:
        prof = get_profile(name)
        fit = check(prof, model, (ds.in_channels, ds.image_size, ds.image_size))
        rows.append((name, f"{fit.density:.2f}", str(prof.batch_size), f"{fit.params:,}", f"{fit.active_params:,}",
                     f"{fit.train_mb:.1f}", str(prof.train_memory_mb), f"{fit.infer_mb:.1f}", str(prof.ram_budget_mb),
                     "yes" if fit.ok else "NO: " + "; ".join(fit.reasons())))
    print(format_table(rows))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """Export a device's model for a profile, verify it against eager PyTorch, record it in the manifest."""
    from device_profiles import get_profile
    from export import (
        lower_executorch,
        lower_executorch_int8,
        lower_executorch_training,
        lower_onnx,
        package,
        prepare,
        verify,
        verify_int8,
        verify_training,
    )

    from .checkpoint import ModelSpec
    from .data import get_dataset
    from .errors import DataError

    profile = get_profile(args.profile)
    spec = None if args.checkpoint else ModelSpec(args.model, args.num_classes, args.in_channels, args.image_size)
    prep = prepare(profile, checkpoint=args.checkpoint, spec=spec, seed=args.seed)
    if args.checkpoint is None:
        print(f"no --checkpoint: exporting a fresh, untrained {args.model} (for sizes and latency, not accuracy)")
    real_x = real_y = calib = None
    try:
        ds = get_dataset(args.dataset, data_dir=args.data_dir)
        if tuple(ds.test_x.shape[1:]) == prep.input_shape:
            # int8 calibrates on training images and is checked on test images it never saw
            real_x, real_y, calib = ds.test_x[:1000], ds.test_y[:1000], ds.train_x[:256]
    except DataError as e:
        print(f"verifying on random inputs only: {e}")
    formats = ["onnx", "executorch", "executorch-int8", "executorch-training"] if args.format == "all" \
        else [args.format]
    for fmt in formats:
        if fmt in ("onnx", "executorch"):
            packaged = package((lower_onnx if fmt == "onnx" else lower_executorch)(prep), args.out)
            ver = verify(packaged, real=None if real_x is None else real_x[:32])
            print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  density {prep.density:.2f}  verified on "
                  f"{', '.join(ver.inputs)}: max abs error {ver.max_abs_err:.2e}, max rel error "
                  f"{ver.max_rel_err:.2e}")
        elif fmt == "executorch-int8":
            if args.format == "all" and args.checkpoint is None:
                print("executorch-int8 skipped: an untrained model's near-uniform logits make its int8 accuracy "
                      "check meaningless; give --checkpoint (or --format executorch-int8 to force it)")
                continue
            if real_x is None or real_y is None or calib is None:
                print("executorch-int8 skipped: it calibrates and is checked on real labelled images, and "
                      f"{args.dataset} does not match the model's input")
                continue
            packaged = package(lower_executorch_int8(prep, calib), args.out)
            rep = verify_int8(packaged, real_x, real_y)
            print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  int8: accuracy {rep['int8_accuracy']:.3f} "
                  f"vs fp32 {rep['fp32_accuracy']:.3f} on {len(real_y)} real test images, top-1 agreement "
                  f"{rep['top1_agreement']:.3f}")
        else:
            mask = None
            if args.mode == "dispfl":  # the checkpoint's zeros are its mask (a fresh model: dense)
                mask = {k: (p != 0).float() for k, p in prep.model.named_parameters()}
            lowered = lower_executorch_training(prep, mode=args.mode, batch_size=profile.batch_size,
                                                kp=profile.kp if args.mode == "personal" else None, mask=mask)
            packaged = package(lowered, args.out)
            tv = verify_training(packaged, mask=mask)
            print(f"{packaged.path}  {packaged.entry['bytes']:,} bytes  training program ({args.mode}, batch "
                  f"{profile.batch_size}): one step's gradients max abs error {tv.grad_max_abs_err:.2e}, weights "
                  f"{tv.weight_max_abs_err:.2e} against eager PyTorch")
    print(f"manifest: {Path(args.out) / 'manifest.json'}")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    """Export the model once per runtime the profiles need, then measure each device class."""
    from device_profiles import get_profile, list_profiles
    from edge_runtime import profile_devices
    from export import lower_executorch, lower_onnx, package, prepare, verify

    from .checkpoint import ModelSpec
    from .table import format_table

    names = list_profiles() if args.profiles == "all" else args.profiles.split(",")
    profiles = [get_profile(n) for n in names]
    spec = None if args.checkpoint else ModelSpec(args.model, args.num_classes, args.in_channels, args.image_size)
    artefacts: dict[str, Path] = {}
    for runtime, lower in (("onnxruntime", lower_onnx), ("executorch", lower_executorch)):
        needing = [p for p in profiles if p.inference_runtime == runtime]
        if needing:
            prep = prepare(needing[0], checkpoint=args.checkpoint, spec=spec)
            packaged = package(lower(prep), args.out / "artefacts")
            verify(packaged)
            artefacts[runtime] = packaged.path
            spec = prep.spec
    assert spec is not None
    report = profile_devices(profiles, spec, artefacts, args.out, repeats=args.repeats)
    print(f"{spec.model}: {report['note']} ({report['host']})")
    header = ("profile", "thr", "runtime", "artefact KB", "infer b1 ms (p95)", "infer bN ms (p95)",
              "train step ms (p95)", "peak RSS MB b1/bN/train")
    rows: list[tuple[str, ...]] = [header]
    for r in report["profiles"]:
        m = r["measurements"]
        rows.append((r["profile"], str(r["threads"]), r["inference_runtime"], f"{r['artefact_bytes'] / 1024:.0f}",
                     *(f"{x['median_ms']:.2f} ({x['p95_ms']:.2f}) b{x['batch']}" for x in m),
                     "/".join(f"{x['peak_rss_mb']:.0f}" for x in m)))
    print(format_table(rows))
    print(f"results: {args.out / 'profile.json'}  chart: {args.out / 'profile.png'}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    from device_profiles import get_fleet, get_profile, list_fleets, list_profiles

    from .data import list_datasets, list_partitioners
    from .models import list_models, model_entry
    from .sim import ALGORITHMS

    print("models:")
    for name in list_models():
        print(f"  {name:14s} {model_entry(name).description}")
    print("datasets:     " + ", ".join(list_datasets()))
    print("partitioners: " + ", ".join(list_partitioners()))
    print("algorithms:   " + ", ".join(ALGORITHMS))
    print("device profiles:")
    for name in list_profiles():
        prof = get_profile(name)
        print(f"  {name:17s} density {prof.density:.1f}, K_P {prof.kp}, batch {prof.batch_size:3d}, "
              f"{prof.inference_runtime}/{prof.training_backend}: {prof.description}")
    print("fleets:")
    for name in list_fleets():
        print(f"  {name:17s} {get_fleet(name).description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pfl-edge", description="Personalized federated learning on edge fleets")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="run a federation in-process and write its results")
    _add_sim_flags(p)
    p.add_argument("--out", type=Path, help="results JSON (a PNG is written beside it); default runs/ALG.json")
    p.add_argument("--save-dir", type=Path, help="write each client's final model and the base (safetensors)")
    p.set_defaults(func=_cmd_simulate)

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

    p = sub.add_parser("server", help="the coordination and aggregation server (FastAPI)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--settings", type=Path, help="settings file (.env or TOML); PFL_* environment variables win")
    p.add_argument("--data-dir", type=Path, help="where SQLite and the blobs live (default ./pfl-server-data)")
    p.add_argument("--broker-url", help="embedded (default) or mqtt://host:port")
    p.add_argument("--database-url", help="default: SQLite in the data dir; postgresql+psycopg://... for PostgreSQL")
    p.set_defaults(func=_cmd_server)

    p = sub.add_parser("client", help="a device: enrol, follow rounds, train on local data, upload")
    p.add_argument("--server", required=True, help="the server's URL, e.g. http://10.0.0.2:8080")
    p.add_argument("--federation", default="demo", help="federation id (default demo)")
    p.add_argument("--enrol-secret", required=True, help="the federation's enrolment secret")
    p.add_argument("--profile", required=True, help="this device's profile (pfl-edge list)")
    p.add_argument("--state-dir", type=Path, required=True, help="enrolment, personal blocks, mask, progress")
    p.add_argument("--name", default="", help="a label for tables")
    p.add_argument("--dataset", help="registered data set (default: the federation's)")
    p.add_argument("--partition", help="split (default: the federation's)")
    p.add_argument("--num-partitions", type=int, help="partitions (default: the federation's clients)")
    p.add_argument("--partition-id", type=int, help="this device's partition (default: its slot)")
    p.add_argument("--seed", type=int, help="partition seed (default: the federation's)")
    p.add_argument("--dataset-dir", help="where the registered data set's files are")
    p.add_argument("--data-dir", help="the user's own labelled images instead: one folder per class")
    p.add_argument("--threads", type=int, help="torch threads (default: the profile's)")
    p.add_argument("--training-backend", choices=["torch", "executorch"],
                   help="default: the profile's (an executorch program is exported once into the state dir)")
    p.add_argument("--training-program", help="an exported ExecuTorch training program (.pte beside its manifest)")
    p.add_argument("--patience", type=float, default=300.0, help="seconds to keep retrying a missing server")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_client)

    p = sub.add_parser("check", help="does a model fit each device class at its density and batch size?")
    p.add_argument("--model", default="cnn")
    p.add_argument("--dataset", default="fashion-mnist", help="sets the input shape and classes")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--profiles", default="all", help="all, or comma-separated profile names")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("export", help="export a device's model (ONNX, ExecuTorch), verified against eager PyTorch")
    p.add_argument("--profile", required=True, help="device profile (pfl-edge list)")
    p.add_argument("--checkpoint", type=Path, help="a client checkpoint from simulate --save-dir (default: fresh)")
    p.add_argument("--model", default="cnn", help="for a fresh model")
    p.add_argument("--num-classes", type=int, default=10, help="for a fresh model")
    p.add_argument("--in-channels", type=int, default=1, help="for a fresh model")
    p.add_argument("--image-size", type=int, default=28, help="for a fresh model")
    p.add_argument("--format", choices=["onnx", "executorch", "executorch-int8", "executorch-training", "all"],
                   default="all", help="onnx (opset 17), executorch (.pte, XNNPACK), executorch-int8 (static int8, "
                   "XNNPACK; calibrated on real images), executorch-training (an on-device training program), all")
    p.add_argument("--mode", choices=["fedper", "personal", "dispfl"], default="fedper",
                   help="training program: fedper (whole model), personal (the profile's K_P blocks alone: "
                        "FedPer-FT's first epoch), dispfl (masked weights; exposes the dense gradient)")
    p.add_argument("--dataset", default="fashion-mnist", help="real inputs for the parity check, if shapes match")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("artefacts"))
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("profile", help="measure latency and memory of a model per device class")
    p.add_argument("--model", default="cnn", help="for a fresh model")
    p.add_argument("--checkpoint", type=Path, help="a client checkpoint (default: a fresh model)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--in-channels", type=int, default=1)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--profiles", default="all", help="all, or comma-separated profile names")
    p.add_argument("--repeats", type=int, default=30, help="timed runs per measurement (after 3 warm-up runs)")
    p.add_argument("--out", type=Path, default=Path("runs/profile"))
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("list", help="list models, data sets, partitions, algorithms, device profiles and fleets")
    p.set_defaults(func=_cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PflEdgeError as e:
        print(f"pfl-edge: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # an output path that cannot be written, a disk that filled up
        print(f"pfl-edge: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pfl-edge: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
