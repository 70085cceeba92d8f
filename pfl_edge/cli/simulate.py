"""``pfl-edge simulate``: a federation in-process, and the simulator flags ``demo --simulate`` shares."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .common import _check_writable

# flag -> (SimConfig field, type, help)
_SIM_FLAGS: list[tuple[str, type, str]] = [
    ("algorithm", str, "registered algorithm (pfl-edge list), e.g. fedper, dispfl, ditto"),
    ("model", str, "registered model (pfl-edge list)"),
    ("dataset", str, "registered data set (pfl-edge list)"),
    ("data-dir", str, "folder of the data set's files"),
    ("partition", str, "iid | pathological:K (cyclic) | pathological-random:K (K random classes each: the DisPFL "
                       "reference's n_cls) | dirichlet:ALPHA (class-wise) | dirichlet-client:ALPHA (client-wise, "
                       "equal sizes: the DisPFL reference's) | groups:G | preference[:P]"),
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
    ("test-draw", str, "disjoint (no test image in two clients) | shared (each client's test set on its own, the "
                       "DisPFL reference's; the default for pathological-random and dirichlet-client)"),
    ("ft-epochs", int, "-ft algorithms: fine-tuning epochs"),
    ("topology", str, "decentralized algorithms' option: random:K | ring | full"),
    ("density", float, "DisPFL: every client's density (1 - sparsity)"),
    ("densities", str, "DisPFL: comma-separated densities cycled over clients, e.g. 0.2,0.4,0.6,0.8,1.0"),
    ("alpha0", float, "DisPFL option: initial prune rate (cosine-annealed)"),
    ("regrow", str, "DisPFL option: gradient (the paper) | random (the released scripts)"),
    ("engine", str, "auto | vmap | loop (training engine)"),
    ("workers", int, "training processes (default: one per core)"),
    ("seed", int, "the one seed every random stream derives from"),
]


def _add_sim_flags(p: argparse.ArgumentParser) -> None:
    for flag, typ, help_ in _SIM_FLAGS:
        p.add_argument(f"--{flag}", type=typ, default=None, help=help_)
    p.add_argument("--local-norm-stats", action="store_true", default=None,
                   help="keep base normalisation statistics on the client (FedBN-style)")
    p.add_argument("--clip-unmasked", action=argparse.BooleanOptionalAction, default=None,
                   help="clip the whole gradient before masking it (default: yes for dispfl, the reference's order)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", dest="options",
                   help="one of the algorithm's own options (repeatable), e.g. ditto's --option lam=0.5")
    p.add_argument("--privacy", action="append", metavar="KEY=VALUE",
                   help="differential privacy of the shared part (repeatable; docs/privacy.md), e.g. --privacy "
                        "clip=0.5 --privacy target_epsilon=3")
    p.add_argument("--secure-aggregation", nargs="*", metavar="KEY=VALUE", default=None,
                   help="secure aggregation (SecAgg+) of the shared part, the simulator's (docs/secagg.md): the flag "
                        "alone, or its keys, e.g. --secure-aggregation bound=0.5 bits=20")
    p.add_argument("--fleet", help="DisPFL: take the clients' densities from a device fleet (pfl-edge list)")
    p.add_argument("--config", type=Path, help="re-run a config: TOML, or the JSON of an earlier run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _sim_config(args: argparse.Namespace, **defaults: Any) -> Any:
    from ..sim import SimConfig, load_config_file

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
    if getattr(args, "options", None):
        values["options"] = {**(values.get("options") or {}), **parse_options(args.options)}
    if getattr(args, "privacy", None):
        values["privacy"] = {**(values.get("privacy") or {}), **parse_options(args.privacy, "--privacy")}
    if getattr(args, "secure_aggregation", None) is not None:
        values["secure_aggregation"] = {**(values.get("secure_aggregation") or {}),
                                        **parse_options(args.secure_aggregation, "--secure-aggregation")}
    if getattr(args, "clip_unmasked", None) is not None:
        values["clip_unmasked"] = args.clip_unmasked
    if args.local_norm_stats:
        values["local_norm_stats"] = True
    if getattr(args, "fleet", None):
        from device_profiles import get_fleet

        # the fleet's densities in dealing order, cycled over clients; recorded as plain densities
        values["densities"] = get_fleet(args.fleet).densities()
    return SimConfig.from_dict(values)


def parse_options(items: list[str], flag: str = "--option") -> dict[str, Any]:
    """``KEY=VALUE`` pairs as an options table: a value is read as JSON where it is a number, true/false or
    null, else kept as text; the algorithm's Options dataclass checks the result."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} takes KEY=VALUE, got {item!r:.80}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        out[key] = value if value is None or isinstance(value, int | float | bool) else text
    return out


def sampling_key(path: Path) -> bytes:
    """A server's sampling key from the file at ``path`` (hex, as ``pfl_federations.sampling_key`` holds it): a
    file, not a flag's value or a config key, so that it sits in no process listing and no config a device gets."""
    from ..secret_file import read_secret_file

    text = read_secret_file(path)
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(f"{path}: a sampling key is hex (the server's pfl_federations.sampling_key)") from None
    if len(key) < 16:
        raise ConfigError(f"{path}: a sampling key has at least 128 bits (32 hex digits), got {len(key) * 8}")
    return key


def _cmd_simulate(args: argparse.Namespace) -> int:
    from ..sim import client_table, simulate, write_result

    cfg = _sim_config(args)
    out = args.out or Path("runs") / f"{cfg.algorithm}.json"
    _check_writable(out, args.save_dir)
    key = None if args.sampling_key_file is None else sampling_key(args.sampling_key_file)
    result = simulate(cfg, save_dir=args.save_dir, progress=False if args.no_progress else None,
                      backend=args.backend, ray_address=args.ray_address, sampling_key=key)
    write_result(result, out)
    print(client_table(result))
    print(f"results: {out}  plot: {Path(out).with_suffix('.png')}"
          + (f"  checkpoints: {args.save_dir}" if args.save_dir else ""))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="run a federation in-process and write its results")
    _add_sim_flags(p)
    p.add_argument("--out", type=Path, help="results JSON (a PNG is written beside it); default runs/ALG.json")
    p.add_argument("--save-dir", type=Path, help="write each client's final model and the base (safetensors)")
    # not argparse choices: simulate checks the name against pfl_edge.sim.BACKENDS (the parser imports no torch)
    p.add_argument("--backend", default="fork",
                   help="where clients train: fork (worker processes here; default) or ray (actors on a Ray "
                        "cluster, pip install 'pfl-edge[ray]'); the same numbers either way")
    p.add_argument("--ray-address", metavar="HOST:PORT",
                   help="--backend ray: the cluster to join (ray start --head's address); default: a cluster "
                        "started on this machine, else a local one")
    p.add_argument("--sampling-key-file", type=Path, metavar="PATH",
                   help="a private federation's secret draw: the file holding its server's sampling key (hex, "
                        "pfl_federations.sampling_key); the rounds then draw the server's slots (docs/privacy.md)")
    p.set_defaults(func=_cmd_simulate)
