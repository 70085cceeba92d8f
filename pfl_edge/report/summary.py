"""The numbers of a report, computed from a :class:`~pfl_edge.report.load.Run` by pure functions: per round the
accuracy spread (min / median / mean / max over the devices that reported), bytes, wall time, updates and
whether it closed short of quorum; per device its accuracy curve; per device class (profile) a summary row; the
final numbers. The result is plain JSON (``report.json``)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ..protocol import quorum_updates
from .load import DeviceInfo, RoundRecord, Run

__all__ = ["CLOSED_STATES", "short_of_quorum", "spread", "summarise"]

#: round states in which a round has closed (its updates counted)
CLOSED_STATES = ("published", "finished")


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """min, median, mean and max of ``values`` (all None when empty)."""
    if not values:
        return {"min": None, "median": None, "mean": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "mean": math.fsum(values) / len(values),
            "max": max(values)}


def short_of_quorum(rnd: RoundRecord, quorum: float | None) -> bool | None:
    """Did a closed round close with fewer updates than its quorum asks (its deadline closed it)? The server's
    rule: a round may close when every device given a task has sent, or ceil(quorum * active) of them have.
    None when unknown: the round is still open, or the quorum or counts are not known."""
    if rnd.state not in CLOSED_STATES or rnd.updates is None or not rnd.active or quorum is None:
        return None
    return rnd.updates < max(1, quorum_updates(quorum, rnd.active))


def _round_row(rnd: RoundRecord, quorum: float | None) -> dict[str, Any]:
    accs = [m.accuracy for m in rnd.devices.values() if m.accuracy is not None]
    return {"round": rnd.round, "state": rnd.state, "updates": rnd.updates, "active": rnd.active,
            "reporting": len(accs), "accuracy": spread(accs),
            "bytes_up": sum(m.bytes_up for m in rnd.devices.values()),
            "bytes_down": sum(m.bytes_down for m in rnd.devices.values()),
            "wall_s": rnd.wall_s, "short_of_quorum": short_of_quorum(rnd, quorum)}


def _device_row(dev: DeviceInfo, rounds: Sequence[RoundRecord]) -> dict[str, Any]:
    reports = [(r.round, r.devices[dev.device_id]) for r in rounds if dev.device_id in r.devices]
    curve = [[t, m.accuracy] for t, m in reports if m.accuracy is not None]
    steps = [m.step_ms for _, m in reports if m.step_ms is not None]
    return {"device_id": dev.device_id, "name": dev.name, "profile": dev.profile, "density": dev.density,
            "kp": dev.kp, "final_round": curve[-1][0] if curve else None,
            "final_accuracy": curve[-1][1] if curve else None, "accuracy": curve,
            "step_ms": math.fsum(steps) / len(steps) if steps else None,
            "bytes_up": sum(m.bytes_up for _, m in reports), "bytes_down": sum(m.bytes_down for _, m in reports),
            "server_bytes_up": dev.server_bytes_up, "server_bytes_down": dev.server_bytes_down}


def _profile_rows(devices: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per device class: the mean of its devices' final accuracies and mean step times, summed bytes."""
    by: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        by.setdefault(d["profile"], []).append(d)
    rows = []
    for prof, ds in sorted(by.items()):
        finals = [d["final_accuracy"] for d in ds if d["final_accuracy"] is not None]
        steps = [d["step_ms"] for d in ds if d["step_ms"] is not None]
        rows.append({"profile": prof, "count": len(ds),
                     "densities": sorted({d["density"] for d in ds if d["density"] is not None}),
                     "kps": sorted({d["kp"] for d in ds if d["kp"] is not None}),
                     "final_accuracy_mean": math.fsum(finals) / len(finals) if finals else None,
                     "step_ms": math.fsum(steps) / len(steps) if steps else None,
                     "bytes_up": sum(d["bytes_up"] for d in ds), "bytes_down": sum(d["bytes_down"] for d in ds)})
    return rows


def _server_total(devices: Sequence[dict[str, Any]], key: str) -> int | None:
    vals = [d[key] for d in devices if d[key] is not None]
    return sum(vals) if vals else None


def _privacy(run: Run, rounds: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Differential privacy's spend (docs/privacy.md) where the run's config has a ``privacy`` table: the
    accountant's epsilon after the rounds that released a base (a live round once closed; every simulated one),
    as they ran (``privacy_spent.achieved_epsilon``: the distributed mode's noise is its participants' shares)."""
    from ..errors import ConfigError
    from ..federation import FederationConfig
    from ..privacy import noise_multiplier
    from ..privacy_spent import achieved_epsilon

    if not run.config.get("privacy"):
        return None
    try:
        cfg = FederationConfig.from_dict(dict(run.config))
    except (ConfigError, TypeError):  # a config this version cannot read: say nothing rather than guess
        return None
    dp = cfg.dp
    released = [r for r in rounds if r["round"] >= 1 and (r["state"] is None or r["state"] in CLOSED_STATES)]
    t = max((r["round"] for r in released), default=0)
    eps = achieved_epsilon(cfg, [r["updates"] for r in sorted(released, key=lambda r: r["round"])])
    return {"rounds": t, "epsilon": eps if math.isfinite(eps) else None, "delta": dp.delta if dp else None,
            "noise_multiplier": noise_multiplier(cfg), "clip": dp.clip if dp else None,
            "mode": dp.mode if dp else None}


def summarise(run: Run) -> dict[str, Any]:
    """The whole report as JSON-ready data. ``final`` is the last round any device reported an accuracy of."""
    rounds = [_round_row(r, run.quorum) for r in run.rounds]
    devices = [_device_row(d, run.rounds) for d in run.devices]
    last = next((r for r in reversed(rounds) if r["reporting"]), None)
    walls = [r["wall_s"] for r in rounds if r["wall_s"] is not None]
    final = {"round": None if last is None else last["round"],
             "devices_reporting": 0 if last is None else last["reporting"],
             "accuracy": spread([]) if last is None else last["accuracy"],
             "rounds_recorded": len(rounds),
             "rounds_short_of_quorum": [r["round"] for r in rounds if r["short_of_quorum"]],
             "bytes_up": sum(r["bytes_up"] for r in rounds), "bytes_down": sum(r["bytes_down"] for r in rounds),
             "server_bytes_up": _server_total(devices, "server_bytes_up"),
             "server_bytes_down": _server_total(devices, "server_bytes_down"),
             "round_wall_s": math.fsum(walls) if walls else None}
    return {"source": run.source, "name": run.name, "algorithm": run.algorithm, "state": run.state,
            "rounds_planned": run.rounds_planned, "quorum": run.quorum, "devices_count": len(devices),
            "final": final, "rounds": rounds, "devices": devices, "profiles": _profile_rows(devices),
            "config": dict(run.config), "privacy": _privacy(run, rounds)}
