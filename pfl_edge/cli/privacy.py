"""``pfl-edge privacy``: the accountant's answers before a run (pfl_edge.privacy, docs/privacy.md): the noise
multiplier a target epsilon needs, or the epsilon a noise multiplier spends round by round."""

from __future__ import annotations

import argparse
import json
import math

from ..errors import ConfigError


def _cmd_privacy(args: argparse.Namespace) -> int:
    from ..federation import FederationConfig
    from ..privacy import epsilon, noise_multiplier

    if (args.noise_multiplier is None) == (args.target_epsilon is None):
        raise ConfigError("give exactly one of --noise-multiplier and --target-epsilon")
    table = {"clip": 1.0, "delta": args.delta}  # the clip does not enter the accounting
    table.update({"noise_multiplier": args.noise_multiplier} if args.noise_multiplier is not None
                 else {"target_epsilon": args.target_epsilon})
    cfg = FederationConfig(dataset="synthetic", clients=args.clients, rounds=args.rounds,
                           participation=args.participation, privacy=table)
    z = noise_multiplier(cfg)
    marks = sorted({t for t in (1, 10, 100, 1000, args.rounds) if t <= args.rounds})
    spent = {t: epsilon(cfg, t) for t in marks}
    if args.json:
        print(json.dumps({"noise_multiplier": z, "delta": args.delta, "sample_rate": args.participation,
                          "epsilon": {str(t): (e if math.isfinite(e) else None) for t, e in spent.items()}}))
        return 0
    print(f"noise multiplier z = {z:.4f} (sample rate q = {args.participation:g}, delta = {args.delta:g}; "
          "Opacus's RDP accountant)")
    for t, e in spent.items():
        print(f"  after round {t:>6}: epsilon {e:.3f}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("privacy", help="differential privacy's accountant: the noise for a target epsilon, or the "
                                       "epsilon a noise spends")
    p.add_argument("--target-epsilon", type=float, help="the whole run's epsilon: find the noise multiplier")
    p.add_argument("--noise-multiplier", type=float, help="z: show the epsilon it spends")
    p.add_argument("--rounds", type=int, required=True, help="the federation's rounds")
    p.add_argument("--participation", type=float, default=1.0, help="q: each client's chance of a round")
    p.add_argument("--clients", type=int, default=1000, help="the federation's clients (delta must be below 1/N)")
    p.add_argument("--delta", type=float, default=1e-5, help="the delta epsilon is stated at")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=_cmd_privacy)
