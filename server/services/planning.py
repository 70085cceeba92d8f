"""A round's plan: which devices take part, and each one's task (the base it starts from where a server
averages, its in-neighbours' latest models where devices exchange them)."""

from __future__ import annotations

from sqlalchemy import ColumnElement, exists, func, select
from sqlalchemy.orm import Session

from pfl_edge.errors import InternalError
from pfl_edge.protocol import Neighbour, Task

from ..db import Device, Federation, Round, Update
from ..fedmodel import FedModel
from ..states import ENROLMENT_ROUND, RoundState
from . import identity
from .blob_access import BlobAccess
from .store import Store

__all__ = ["Planner"]


class Planner:
    def __init__(self, store: Store, blobs: BlobAccess) -> None:
        self.store = store
        self.blobs = blobs

    @staticmethod
    def _who(fed: Federation, fm: FedModel, t: int, *, sampled: bool = True) -> list[ColumnElement[bool]]:
        """Who takes part in round ``t``, once, as SQL: enrolled before it opened and not revoked (the server's
        rule), and what the algorithm's ``participation(t)`` says (its draw, its initial model). ``active``,
        ``count_active`` and ``takes_part`` (so quorum, close, tasks and updates) all filter on this."""
        p = fm.algorithm().participation(t, fed.draw_key)  # a secret draw under the federation's key
        where = [Device.federation == fed.id, Device.joined_round < t, Device.revoked_at.is_(None)]
        if sampled and p.slots is not None:
            where.append(Device.slot.in_(sorted(p.slots)))
        if p.after_initial:
            where.append(exists().where(Update.federation == fed.id, Update.device == Device.id,
                                        Update.round == ENROLMENT_ROUND))
        return where

    @staticmethod
    def _closing(fed: Federation, fm: FedModel, t: int) -> list[ColumnElement[bool]]:
        """Who takes the closing step after the last round ``t``, as SQL: the devices of the federation (a late
        joiner of the last round too) that the algorithm's ``closing(t)`` admits (none where it has no such
        step)."""
        p = fm.algorithm().closing(t)
        where = [Device.federation == fed.id]
        if p.slots is not None:
            where.append(Device.slot.in_(sorted(p.slots)))
        return where

    @staticmethod
    def active(s: Session, fed: Federation, fm: FedModel, t: int) -> list[Device]:
        """Devices that take part in round ``t`` (``_who``), in slot order."""
        return list(s.scalars(select(Device).where(*Planner._who(fed, fm, t)).order_by(Device.slot)))

    @staticmethod
    def count_active(s: Session, fed: Federation, fm: FedModel, t: int, *, sampled: bool = True) -> int:
        """``len(active(...))`` as one count in SQL: the readiness checks run on every enrolment and update, and
        must not load every device of a large fleet. ``sampled=False``: every device that could take part (the
        fleet enrolment waits for), sampled or not."""
        return s.scalar(select(func.count()).select_from(Device).where(
            *Planner._who(fed, fm, t, sampled=sampled))) or 0

    @staticmethod
    def count_refused(s: Session, fed: Federation, fm: FedModel) -> int:
        """Devices (not revoked) whose initial model the server refused and none accepted since, where the
        algorithm asks for one; 0 elsewhere."""
        if not fm.algorithm().participation(1).after_initial:
            return 0
        return s.scalar(select(func.count()).select_from(Device).where(
            Device.federation == fed.id, Device.revoked_at.is_(None), Device.refused_updates > 0,
            ~exists().where(Update.federation == fed.id, Update.device == Device.id,
                            Update.round == ENROLMENT_ROUND))) or 0

    @staticmethod
    def takes_part(s: Session, fed: Federation, fm: FedModel, t: int, dev: Device) -> bool:
        """``active``'s rule for one device (without loading the others)."""
        return s.scalar(select(Device.id).where(Device.id == dev.id, *Planner._who(fed, fm, t))) is not None

    def current(self, dev: Device) -> Task | None:
        """The task ``dev`` has now, exactly as the server publishes it (what a device acts on, whatever its
        broker says): its round's while the round collects updates, the final one once a federation that ends
        with an evaluation has finished; None otherwise (between rounds, before round 1, not in this round)."""
        with self.store.read() as s:
            fed = self.store.existing(s, dev.federation)
            final = fed.state == RoundState.FINISHED  # the closing step's task, where the algorithm has one
            if fed.round == ENROLMENT_ROUND or not (final or fed.state == RoundState.COLLECTING):
                return None
            t = fed.round
        got = self.tasks(dev.federation, t, final=final, device=dev.id)
        return got[0][1] if got else None

    def tasks(self, fed_id: str, t: int, *, final: bool = False, device: str | None = None) -> list[tuple[str, Task]]:
        """(device id, task) of round ``t`` for every device in it (``device``: for that one only, if it is in
        it); ``final``: the federation's last step, for every device (a late joiner of the last round too: each
        evaluates and stops)."""
        with self.store.read() as s:
            fed = self.store.existing(s, fed_id)
            r = self.store.round(s, fed_id, t)
            fm = self.store.model(fed)
            who = self._closing(fed, fm, t) if final else self._who(fed, fm, t)
            if device is not None:
                one = s.get(Device, device)
                devs = [] if one is None or s.scalar(select(Device.id).where(Device.id == one.id, *who)) is None \
                    else [one]
            else:
                devs = list(s.scalars(select(Device).where(*who).order_by(Device.slot)))
            if not devs:
                return []
            graph = fm.algorithm().neighbours(t)
            if graph is not None:
                return self._neighbour_tasks(s, fm, r, devs, graph)
            whole = r.base_digest if final else r.start_digest
            if whole is None:
                raise InternalError(f"federation {fed_id!r} round {t} has no {'result' if final else 'start'} model")
            kps = [(d.id, d.kp, _sent_in(d)) for d in devs]
        return [(dev_id, Task(federation=fed_id, round=t, algorithm=fm.cfg.algorithm,
                              base=self.blobs.base_for(fed_id, fm, whole, kp), deadline=r.deadline, final=final,
                              protocol=version))
                for dev_id, kp, version in kps]

    def _neighbour_tasks(self, s: Session, fm: FedModel, r: Round, devs: list[Device],
                         graph: list[list[int]]) -> list[tuple[str, Task]]:
        """Each device's in-neighbours of the round that have a model, with the digest of their latest one."""
        latest = self.latest_models(s, r.federation, r.round)
        by_slot = {d.slot: d for d in s.scalars(select(Device).where(Device.federation == r.federation))}
        out = []
        for d in devs:
            ns = [Neighbour(index=j, device_id=by_slot[j].id, digest=latest[by_slot[j].id])
                  for j in graph[d.slot] if j in by_slot and by_slot[j].id in latest]
            out.append((d.id, Task(federation=r.federation, round=r.round, algorithm=fm.cfg.algorithm,
                                   neighbours=ns, deadline=r.deadline, protocol=_sent_in(d))))
        return out

    @staticmethod
    def latest_models(s: Session, fed_id: str, t: int) -> dict[str, str]:
        """Every device's latest model from before round ``t`` (its update of the latest round it sent)."""
        rows = s.execute(select(Update.device, Update.round, Update.digest)
                         .where(Update.federation == fed_id, Update.round < t))
        best: dict[str, tuple[int, str]] = {}
        for dev, rnd, digest in rows:
            if dev not in best or rnd > best[dev][0]:
                best[dev] = (rnd, digest)
        return {d: v[1] for d, v in best.items()}


def _sent_in(dev: Device) -> int | None:
    """The protocol version a task names for ``dev``: its own from version 2 on; none for a device of version 1,
    which refuses a field it does not know (docs/protocol.md, "Versions")."""
    got = identity.answered_in(dev)
    return got if got >= 2 else None
