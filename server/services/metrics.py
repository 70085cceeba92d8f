"""Metrics: what devices report of each round (an upsert per device and round), the per-round summary the
admin reads, and the listing of a federation's devices with their traffic."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from pfl_edge.protocol import MetricsReport

from ..db import Blob, Device, Metric, Round, Update, now
from ..errors import Conflict
from .store import Store

__all__ = ["Metrics"]


class Metrics:
    def __init__(self, store: Store) -> None:
        self.store = store

    def report(self, dev: Device, t: int, req: MetricsReport) -> None:
        """Metrics of a round that exists and this device was part of: from the round it joined in (a late
        joiner evaluates what it starts from) to the federation's current one; never a future round."""
        with self.store.write() as s:
            fed = self.store.locked(s, dev.federation)
            if t > fed.round:
                raise Conflict(f"metrics for round {t}: the federation is in round {fed.round}; report rounds "
                               f"{dev.joined_round}..{fed.round}")
            if t < dev.joined_round:
                raise Conflict(f"metrics for round {t}: this device joined in round {dev.joined_round} and took no "
                               f"part in earlier rounds; report rounds {dev.joined_round}..{fed.round}")
            row = s.get(Metric, (fed.id, t, dev.id))
            values = req.model_dump()
            if row is None:
                s.add(Metric(federation=fed.id, round=t, device=dev.id, **values))
            else:
                for k, v in values.items():
                    setattr(row, k, v)
                row.reported_at = now()

    def summary(self, fed_id: str) -> dict[str, Any]:
        """Every round: its state, updates, devices given a task, mean accuracy, wall time and per-device metrics."""
        with self.store.read() as s:
            self.store.federation(s, fed_id)
            rounds = {r.round: r for r in s.scalars(select(Round).where(Round.federation == fed_id))}
            counts = dict(s.execute(select(Update.round, func.count()).where(Update.federation == fed_id)
                                    .group_by(Update.round)).all())
            per: dict[int, dict[str, dict[str, Any]]] = {}
            for m in s.scalars(select(Metric).where(Metric.federation == fed_id)):
                per.setdefault(m.round, {})[m.device] = {
                    "accuracy": m.accuracy, "loss": m.loss, "n_test": m.n_test, "bytes_up": m.bytes_up,
                    "bytes_down": m.bytes_down, "step_ms": m.step_ms, "train_s": m.train_s}
        out = []
        for t in sorted(set(rounds) | set(per) | set(counts)):
            r = rounds.get(t)
            devs = per.get(t, {})
            accs = [d["accuracy"] for d in devs.values()]
            out.append({
                "round": t,
                "state": r.state if r else None,
                "updates": counts.get(t, 0),
                "active": r.active if r else None,
                "mean_accuracy": sum(accs) / len(accs) if accs else None,
                "wall_s": (r.closed_at - r.opened_at) if r and r.closed_at is not None else None,
                "devices": devs,
            })
        return {"federation": fed_id, "rounds": out}

    def devices(self, fed_id: str) -> list[dict[str, Any]]:
        """Enrolled devices in slot order: profile, slot, density, K_P, liveness, last round, bytes up and down."""
        with self.store.read() as s:
            self.store.federation(s, fed_id)
            stats = {row[0]: row[1:] for row in s.execute(
                select(Update.device, func.max(Update.round), func.coalesce(func.sum(Blob.size), 0),
                       func.coalesce(func.sum(Update.bytes_down), 0))
                .join(Blob, Blob.digest == Update.digest).where(Update.federation == fed_id)
                .group_by(Update.device))}
            out = []
            for d in s.scalars(select(Device).where(Device.federation == fed_id).order_by(Device.slot)):
                last, up, down = stats.get(d.id, (None, 0, 0))
                out.append({"device_id": d.id, "name": d.name, "profile": d.profile, "index": d.slot,
                            "density": d.density, "kp": d.kp, "online": d.online, "last_seen": d.last_seen,
                            "joined_round": d.joined_round, "last_round": last, "bytes_up": int(up),
                            "bytes_down": int(down)})
        return out
