"""Metrics: what devices report of each round (an upsert per device and round), the per-round summary the
admin reads (and the dashboard draws), the listing of a federation's devices with their traffic, and the
database's counters that ``/metrics`` exposes to Prometheus (they survive restarts)."""

from __future__ import annotations

import bisect
import math
import statistics
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select

from device_profiles import get_profile
from pfl_edge.errors import ConfigError
from pfl_edge.fleet import COST_FIELDS, ClassCosts, class_costs
from pfl_edge.privacy_spent import reported_epsilons
from pfl_edge.protocol import COSTS, COSTS_SINCE, MetricsReport, quorum_updates

from ..db import Blob, Device, Federation, Metric, Round, Update, now
from ..errors import Conflict, Unprocessable
from . import identity
from .store import Store

__all__ = ["FederationCounters", "Metrics"]


@dataclass(frozen=True)
class FederationCounters:
    """One federation's counters and gauges as the database holds them (``server.routers.prom``)."""

    federation: str
    round: int
    state: str
    rounds_closed: int  # rounds with a close time
    updates_accepted: int  # rows of the updates ledger (garbage collection keeps them)
    bytes_received: int  # distinct blob bytes its devices uploaded (Device.uploaded_bytes)
    bytes_down_reported: int  # bytes its devices say they downloaded, summed over their updates
    devices_enrolled: int  # not revoked
    devices_online: int  # not revoked, and online by their MQTT status
    updates_refused: int = 0  # uploads the server refused (Device.refused_updates, summed)
    neighbours_dropped: int = 0  # neighbours' models its devices report leaving out (Metric.dropped, summed)
    # per device, only those with any (an honest fleet adds no series): device id -> (refused, dropped)
    offenders: tuple[tuple[str, int, int], ...] = ()


class Metrics:
    def __init__(self, store: Store) -> None:
        self.store = store
        # per federation: (its reports' count and newest time, its classes); a scrape recomputes only on change
        self._class_cache: dict[str, tuple[tuple[int, float, int, int], list[ClassCosts]]] = {}
        self._class_lock = threading.Lock()

    def report(self, dev: Device, t: int, req: MetricsReport) -> None:
        """Metrics of a round that exists and this device was part of: from the round it joined in (a late
        joiner evaluates what it starts from) to the federation's current one; never a future round, nor a
        sampled round t before the last unless round t or t + 1 drew it (DisPFL reports the round it trained in;
        FedPer, FedAvg and Ditto the base of round t, which round t + 1's task brings; at the end every device
        reports the last round). docs/protocol.md, "Sampled rounds". A round's costs (``round_s``,
        ``transfer_s``, ``peak_rss_mb``) are version 3's: a device answered in an earlier version sends none (422),
        as a server of that version would refuse them."""
        sent = [k for k in COSTS if getattr(req, k) is not None]
        if sent and identity.answered_in(dev) < COSTS_SINCE:
            raise Unprocessable(f"{', '.join(sent)}: protocol version {COSTS_SINCE}'s; this device is answered in "
                                f"version {identity.answered_in(dev)}, which does not have them")
        with self.store.write() as s:
            fed = self.store.locked(s, dev.federation)
            if t > fed.round:
                raise Conflict(f"metrics for round {t}: the federation is in round {fed.round}; report rounds "
                               f"{dev.joined_round}..{fed.round}")
            if t < dev.joined_round:
                raise Conflict(f"metrics for round {t}: this device joined in round {dev.joined_round} and took no "
                               f"part in earlier rounds; report rounds {dev.joined_round}..{fed.round}")
            fm = self.store.model(fed)
            # a round's figures are its participants' alone; the last round's are every device's evaluation of
            # what it deploys at the end (the final step), drawn or not
            algo = fm.algorithm()
            drawn = algo.participation(t, fed.draw_key).slots if 1 <= t < fm.cfg.rounds else None
            if drawn is not None and t < fed.round:  # round t + 1 is open: its draw evaluated round t's base
                drawn = drawn | (algo.participation(t + 1, fed.draw_key).slots or set())
            if drawn is not None and dev.slot not in drawn:
                raise Conflict(f"metrics for round {t}: neither round {t} nor {t + 1} drew this device's slot "
                               f"({dev.slot}), so it was not one of them")
            row = s.get(Metric, (fed.id, t, dev.id))
            values = req.model_dump()
            if row is None:
                s.add(Metric(federation=fed.id, round=t, device=dev.id, **values))
            else:
                for k, v in values.items():
                    setattr(row, k, v)
                row.reported_at = now()

    def summary(self, fed_id: str) -> dict[str, Any]:
        """Every round: its state, updates, devices given a task, mean accuracy, wall time and per-device metrics;
        and what the dashboard draws of it: its opening, deadline and close (unix seconds), the updates its quorum
        needs, the spread of the devices' accuracies, and the bytes devices report for it."""
        with self.store.read() as s:
            fed = self.store.federation(s, fed_id)
            quorum = fed.quorum
            rounds = {r.round: r for r in s.scalars(select(Round).where(Round.federation == fed_id))}
            counts = dict(s.execute(select(Update.round, func.count()).where(Update.federation == fed_id)
                                    .group_by(Update.round)).all())
            per: dict[int, dict[str, dict[str, Any]]] = {}
            for m in s.scalars(select(Metric).where(Metric.federation == fed_id)):
                per.setdefault(m.round, {})[m.device] = {
                    "accuracy": m.accuracy, "loss": m.loss, "n_test": m.n_test, "bytes_up": m.bytes_up,
                    "bytes_down": m.bytes_down, "step_ms": m.step_ms, "train_s": m.train_s, "dropped": m.dropped,
                    "round_s": m.round_s, "transfer_s": m.transfer_s, "peak_rss_mb": m.peak_rss_mb}
            cfg = self.store.model(fed).cfg
            hidden = fed.sampling_key is not None  # its draw is the server's secret (else every device's)
        out = [_round_row(t, rounds.get(t), counts.get(t, 0), per.get(t, {}), quorum)
               for t in sorted(set(rounds) | set(per) | set(counts))]
        if cfg.privacy is not None:  # every published round released a noised base: it spent its share
            published = [(row, rounds[row["round"]]) for row in out
                         if row["round"] >= 1 and row["closed_at"] is not None]
            # each round's count of updates in what it published (before schema 14: the updates it took)
            took = [r.released if r.released is not None else r.inputs for _, r in published]
            for (row, _), eps in zip(published, reported_epsilons(cfg, took, draw_hidden=hidden), strict=True):
                row["epsilon"] = eps if math.isfinite(eps) else None  # unbounded (JSON has no inf)
        return {"federation": fed_id, "rounds": out}

    def devices(self, fed_id: str) -> list[dict[str, Any]]:
        """Enrolled devices in slot order: profile, slot, density, K_P, liveness, last round, bytes up and down,
        updates refused and neighbours dropped. Bytes up are the distinct blob bytes the device uploaded
        (``Device.uploaded_bytes``: garbage collection of old blobs does not shrink it), bytes down what it reported
        downloading with its updates; refused: its uploads the server refused (``Updates.submit``); dropped: the
        neighbours' models it reported leaving out of its averages (DisPFL's screen), summed over rounds."""
        with self.store.read() as s:
            self.store.federation(s, fed_id)
            stats = {row[0]: row[1:] for row in s.execute(
                select(Update.device, func.max(Update.round), func.coalesce(func.sum(Update.bytes_down), 0))
                .where(Update.federation == fed_id).group_by(Update.device))}
            dropped = dict(s.execute(select(Metric.device, func.sum(Metric.dropped)).where(
                Metric.federation == fed_id).group_by(Metric.device)).all())
            steps = {dev: float(ms) for dev, ms in s.execute(select(Metric.device, func.avg(Metric.step_ms)).where(
                Metric.federation == fed_id, Metric.step_ms.is_not(None)).group_by(Metric.device)) if ms is not None}
            out = []
            for d in s.scalars(select(Device).where(Device.federation == fed_id).order_by(Device.slot)):
                last, down = stats.get(d.id, (None, 0))
                out.append({"device_id": d.id, "name": d.name, "profile": d.profile, "index": d.slot,
                            "density": d.density, "kp": d.kp, "online": d.online, "last_seen": d.last_seen,
                            "joined_round": d.joined_round, "last_round": last, "bytes_up": int(d.uploaded_bytes or 0),
                            "bytes_down": int(down), "revoked": d.revoked_at is not None,
                            "refused": int(d.refused_updates or 0), "dropped": int(dropped.get(d.id) or 0),
                            "platform": d.platform, "step_ms": steps.get(d.id)})
        classes: dict[str, list[float]] = {}
        for row in out:
            if row["step_ms"]:
                classes.setdefault(str(row["profile"]), []).append(float(row["step_ms"]))  # type: ignore[arg-type]
        for v in classes.values():
            v.sort()
        for row in out:
            row["flags"] = platform_flags(row, classes.get(str(row["profile"]), []))
        return out

    def classes(self, fed_id: str) -> list[ClassCosts]:
        """Per device class (profile), the spread of what its devices report their rounds cost (``class_costs``:
        step time, round wall time, transfer time, peak memory, bytes), over every round each reported; revoked
        devices' reports included (what they cost is still what their class costs)."""
        with self.store.read() as s:
            self.store.federation(s, fed_id)
        return self.all_classes([fed_id]).get(fed_id, [])

    def all_classes(self, only: list[str] | None = None) -> dict[str, list[ClassCosts]]:
        """``classes`` of every federation (or of ``only``), for a scrape: two grouped queries say which
        federations' reports or devices changed since the last call (reports' count and newest time, devices and
        revoked devices), and only those are read again, in two queries; the others come from the cache."""
        with self.store.read() as s:
            feds = select(Federation.id) if only is None else select(Federation.id).where(Federation.id.in_(only))
            ids = set(s.scalars(feds))
            reported = {f: (int(n), float(t or 0)) for f, n, t in s.execute(
                select(Metric.federation, func.count(), func.max(Metric.reported_at))
                .where(Metric.federation.in_(ids)).group_by(Metric.federation))}
            enrolled = {f: (int(n), int(r or 0)) for f, n, r in s.execute(
                select(Device.federation, func.count(), func.sum(case((Device.revoked_at.is_not(None), 1), else_=0)))
                .where(Device.federation.in_(ids)).group_by(Device.federation))}
            marks = {f: (*reported.get(f, (0, 0.0)), *enrolled.get(f, (0, 0))) for f in ids}
            with self._class_lock:
                stale = sorted(f for f, m in marks.items() if self._class_cache.get(f, (None, []))[0] != m)
            devs = s.execute(select(Device.federation, Device.id, Device.profile, Device.revoked_at)
                             .where(Device.federation.in_(stale))).all() if stale else []
            cols = [getattr(Metric, f) for f in COST_FIELDS]
            rows = s.execute(select(Metric.federation, Metric.device, *cols)
                             .where(Metric.federation.in_(stale))).all() if stale else []
        fresh = {}
        for f in stale:
            profiles = {d: p for g, d, p, _ in devs if g == f}
            live = {d for g, d, _, revoked in devs if g == f and revoked is None}
            fresh[f] = class_costs(profiles, ((r[1], dict(zip(COST_FIELDS, r[2:], strict=True)))
                                              for r in rows if r[0] == f), live=live)
        with self._class_lock:
            for f in stale:
                self._class_cache[f] = (marks[f], fresh[f])
            if only is None:  # a federation gone from the database leaves the cache too
                for f in set(self._class_cache) - set(marks):
                    del self._class_cache[f]
            return {f: self._class_cache[f][1] for f in sorted(marks)}

    def federation_ids(self) -> list[str]:
        """Every federation's id, oldest first."""
        with self.store.read() as s:
            return list(s.scalars(select(Federation.id).order_by(Federation.created_at, Federation.id)))

    def counters(self) -> list[FederationCounters]:
        """Every federation's counters from the database, in a fixed number of grouped queries."""
        with self.store.read() as s:
            feds = list(s.execute(select(Federation.id, Federation.round, Federation.state).order_by(Federation.id)))
            closed = dict(s.execute(select(Round.federation, func.count()).where(Round.closed_at.is_not(None))
                                    .group_by(Round.federation)).all())
            upd = {f: (int(n), int(b)) for f, n, b in s.execute(
                select(Update.federation, func.count(), func.coalesce(func.sum(Update.bytes_down), 0))
                .group_by(Update.federation))}
            live = Device.revoked_at.is_(None)
            devs = {f: (int(n), int(on or 0)) for f, n, on in s.execute(
                select(Device.federation, func.count(), func.sum(case((Device.online, 1), else_=0)))
                .where(live).group_by(Device.federation))}
            sent = dict(s.execute(select(Device.federation, func.coalesce(func.sum(Device.uploaded_bytes), 0))
                                  .group_by(Device.federation)).all())  # a revoked device's uploads still count
            refused = {(f, d): int(n) for f, d, n in s.execute(select(Device.federation, Device.id,
                       Device.refused_updates).where(Device.refused_updates > 0))}
            dropped = {(f, d): int(n or 0) for f, d, n in s.execute(
                select(Metric.federation, Metric.device, func.sum(Metric.dropped)).where(Metric.dropped > 0)
                .group_by(Metric.federation, Metric.device))}
        out = []
        for f, t, state in feds:
            n, down = upd.get(f, (0, 0))
            enrolled, online = devs.get(f, (0, 0))
            off = tuple((d, refused.get((f, d), 0), dropped.get((f, d), 0))
                        for d in sorted({d for g, d in (*refused, *dropped) if g == f}))
            out.append(FederationCounters(f, int(t), str(state), int(closed.get(f, 0)), n, int(sent.get(f, 0)),
                                          down, enrolled, online, sum(r for _, r, _ in off),
                                          sum(x for _, _, x in off), off))
        return out

    def blob_store(self) -> tuple[int, int]:
        """The blob store's blobs and bytes, as the database records them (the store holds exactly those)."""
        with self.store.read() as s:
            n, size = s.execute(select(func.count(), func.coalesce(func.sum(Blob.size), 0)).select_from(Blob)).one()
        return int(n), int(size)


def _round_row(t: int, r: Round | None, updates: int, devs: dict[str, dict[str, Any]], quorum: float) -> dict[str, Any]:
    """One round of ``Metrics.summary``."""
    accs = sorted(d["accuracy"] for d in devs.values())
    active = r.active if r else None
    return {
        "round": t,
        "state": r.state if r else None,
        "updates": updates,
        "active": active,
        # updates that close it before its deadline (server.states.quorum_reached): every device given a task,
        # or the fraction ``quorum`` of them rounded up, whichever is fewer
        "quorum_updates": quorum_updates(quorum, active) if active is not None else None,
        "mean_accuracy": sum(accs) / len(accs) if accs else None,
        "min_accuracy": accs[0] if accs else None,
        "median_accuracy": statistics.median(accs) if accs else None,
        "max_accuracy": accs[-1] if accs else None,
        "opened_at": r.opened_at if r else None,
        "deadline": r.deadline if r else None,
        "closed_at": r.closed_at if r else None,
        "wall_s": (r.closed_at - r.opened_at) if r and r.closed_at is not None else None,
        "bytes_up": sum(int(d["bytes_up"]) for d in devs.values()),  # as its devices report them
        "bytes_down": sum(int(d["bytes_down"]) for d in devs.values()),
        "devices": devs,
    }


# architecture names of one machine: the OS's (uname -m), Node's (process.arch) and the profiles' words
_ARCH = {"arm64": "aarch64", "aarch64": "aarch64", "armv8l": "aarch64", "arm64-v8a": "aarch64", "x64": "x86_64",
         "amd64": "x86_64", "x86_64": "x86_64", "arm": "armv7l", "armv7l": "armv7l", "armhf": "armv7l",
         "armeabi-v7a": "armv7l"}
def _arch(name: str) -> str:
    return _ARCH.get(name.lower(), name.lower())


#: a device whose mean step time is this many times its class's (the other devices of its profile), or under
#: 1 / this, is flagged: a class is meant to train at one speed, and one 3x off is not what its profile says
STEP_RATIO = 3.0


def median_without(values: list[float], x: float) -> float | None:
    """The median of sorted ``values`` with one occurrence of ``x`` (one of them) left out; None if none is left.
    O(log n): a fleet's listing computes it for every device of a class."""
    p = bisect.bisect_left(values, x)
    n = len(values) - 1
    if n <= 0:
        return None

    def at(i: int) -> float:  # the i-th of the values without the one at p
        return values[i] if i < p else values[i + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def platform_flags(device: dict[str, Any], class_steps: list[float]) -> list[str]:
    """What an operator should look at about ``device`` (a row of ``devices()``) beside its declared profile: the
    architecture it reports against its profile's, and its mean step time against the median of the other
    devices of its profile (``class_steps``: their mean step times, its own among them, sorted). Both come from
    the devices (reported, not verified): a flag says that the claims disagree, nothing more; the server decides
    nothing from them."""
    flags = []
    plat = device.get("platform") or {}
    try:
        want = get_profile(device["profile"]).architecture
    except ConfigError:  # a profile removed since it enrolled
        want = None
    got = plat.get("machine")
    if want and got and _arch(got) != _arch(want):
        flags.append(f"reports a {got} machine; profile {device['profile']} is {want}")
    mine = device.get("step_ms")
    median = median_without(class_steps, mine) if mine else None
    if mine and median:
        ratio = mine / median
        if ratio > STEP_RATIO or ratio < 1 / STEP_RATIO:
            flags.append(f"steps take {mine:.1f} ms, {ratio:.2g}x the {median:.1f} ms of the other "
                         f"{len(class_steps) - 1} {device['profile']} device(s)")
    return flags
