"""The round machine: reads the facts of a federation, asks ``server.states.next_state`` which transition is due,
and makes it. Every transition is committed before anything is published, so a server killed anywhere resumes
from the database (``server.services.recovery``). The server's aggregation runs at close, streaming the accepted
updates from the blob store one at a time, so nothing is held in memory between requests. The federation's
aggregation rule (``pfl_edge.aggregate``) applies: every update is clipped to the round's norm bound (a bound
relative to the round's median norm uses the norms computed as each update was accepted), and the robust rules
(median, trimmed or clipped mean) hold the round's updates in memory at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from sqlalchemy import delete, select
from sqlalchemy.orm import Session
from torch import Tensor

from pfl_edge.aggregate import DEFAULT_RULE, MIN_UPDATES, AggregationRule, update_norm
from pfl_edge.codec import encode
from pfl_edge.errors import InternalError
from pfl_edge.federation import FederationConfig
from pfl_edge.privacy import round_noise
from pfl_edge.secagg.aggregate import SumOutOfRange

from ..db import Device, Federation, PartialSum, Round, Update, inputs_digest, now
from ..fedmodel import FedModel
from ..states import ENROLMENT_ROUND, RoundState, Transition, next_state
from .blob_access import BlobAccess
from .partials import Partials, Sum, merge_sums
from .planning import Planner
from .publishing import Publisher
from .secure import SecureRounds, is_secure
from .store import Store
from .updates import aggregation_rule

__all__ = ["RoundMachine", "norm_history"]

log = logging.getLogger(__name__)

Handler = Callable[[str, Transition], None]
_Upload = tuple[str, int, int] | tuple[str, int, int, float | None]  # digest, n_samples, kp[, its norm]


def _released_inputs(cfg: FederationConfig, summed: Sequence[tuple[np.ndarray, int]]) -> int:
    """How many inputs a secure round's release holds: the survivors of each group whose sum the algorithm's
    ``apply_sum`` keeps (``passing``; the others' noise shares leave with them): the count a distributed-mode
    round's achieved epsilon is figured from (``pfl_edge.privacy_spent``)."""
    from pfl_edge.secagg.aggregate import passing

    return sum(n for _, n in passing(cfg, summed)[0])


class RoundMachine:
    def __init__(self, store: Store, blobs: BlobAccess, planner: Planner, publisher: Publisher, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.blobs = blobs
        self.planner = planner
        self.publisher = publisher
        self.clock = clock
        self.secure = SecureRounds(store, blobs, planner)  # secure aggregation's steps within collecting
        self._step_lock = threading.Lock()  # transitions: one at a time
        self.partial_sums = False  # merge the replicas' partial sums at close (server.services.partials)
        self.last_merge = (0, 0)  # the last average's (updates taken from partial sums, sums merged)
        self.merged: dict[tuple[str, int], tuple[int, int]] = {}  # (federation, round) -> its close's last_merge
        S = RoundState  # short: the table reads as the state diagram
        self._handlers: dict[tuple[RoundState, RoundState], Handler] = {
            (S.OPEN, S.OPEN): self._open,  # enrolment is over: round 1 opens
            (S.OPEN, S.COLLECTING): self._collect,
            (S.COLLECTING, S.CLOSING): self._begin_close,
            (S.CLOSING, S.PUBLISHED): self._close,
            (S.PUBLISHED, S.OPEN): self._open,
            (S.PUBLISHED, S.FINISHED): self._finish,
        }

    @property
    def transitions(self) -> frozenset[tuple[RoundState, RoundState]]:
        """The (source, target) pairs this machine makes: every move of ``server.states.TRANSITIONS``."""
        return frozenset(self._handlers)

    def step(self, fed_id: str) -> None:
        """Make every transition that is due for this federation (idempotent; safe to call any time)."""
        with self._step_lock:
            for _ in range(len(self._handlers)):  # e.g. closing -> published -> open -> collecting in one call
                if self.secure.advance(fed_id, self.clock):  # a secure round's step within collecting
                    self.publisher.announce(fed_id)
                tr = self.due(fed_id)
                if tr is None:
                    return
                self._handlers[tr.source, tr.target](fed_id, tr)

    def due(self, fed_id: str) -> Transition | None:
        """The transition due now for ``fed_id``, if any."""
        with self.store.read() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                return None
            return next_state(fed.state, fed.round, **self._facts(s, fed))

    def _facts(self, s: Session, fed: Federation) -> dict[str, Any]:
        """What ``next_state`` decides from; each value is read only where the state can use it."""
        fm = self.store.model(fed)
        facts: dict[str, Any] = dict(updates=0, active=0, quorum=fed.quorum, deadline=None, now=self.clock(),
                                     min_updates=fed.min_updates, more_rounds=fed.round < fm.cfg.rounds,
                                     enrolment_ready=False)
        if fed.round == ENROLMENT_ROUND:
            clients = fm.cfg.clients
            # a device whose initial model the server refused holds no slot's readiness back (else one hostile
            # device stalls round 1 for ever); it takes part once a model of it is accepted
            need = min(fed.min_devices or clients, clients - self.planner.count_refused(s, fed, fm))
            facts["enrolment_ready"] = self.planner.count_active(s, fed, fm, ENROLMENT_ROUND + 1,
                                                                 sampled=False) >= max(1, need)
        elif fed.state == RoundState.COLLECTING:
            r = self.store.round(s, fed.id, fed.round)
            facts.update(updates=self.store.count_updates(s, fed.id, fed.round), active=r.active,
                         deadline=r.deadline)
            if is_secure(fm):  # it closes when its unmasking is done, not at a quorum of updates
                facts["secure"] = r.secagg_step == "done"
        return facts

    def _advance(self, s: Session, fed_id: str, tr: Transition) -> Federation | None:
        """The federation moved to ``tr``'s target in this write, or None if it moved on meanwhile."""
        fed = self.store.locked(s, fed_id)
        if fed.round != tr.source_round or fed.state != tr.source:
            return None
        fed.round, fed.state = tr.round, tr.target.value
        if tr.target in (RoundState.COLLECTING, RoundState.CLOSING):
            self.store.round(s, fed_id, tr.round).state = tr.target.value
        return fed

    # ------------------------------------------------------------------------------------------- transitions

    def _open(self, fed_id: str, tr: Transition) -> None:
        t = tr.round
        with self.store.write() as s:
            fed = self._advance(s, fed_id, tr)
            if fed is None:
                return
            fm = self.store.model(fed)
            n = self.planner.count_active(s, fed, fm, t)
            opened = now()
            deadline = opened + fed.deadline_s
            if s.get(Round, (fed_id, t)) is None:
                s.add(Round(federation=fed_id, round=t, state=RoundState.OPEN.value, opened_at=opened,
                            deadline=deadline, active=n, start_digest=fm.algorithm().shared_digest(fed.base_digest)))
            fed.round_deadline = deadline
        log.info("federation %s: round %d open (%d devices)", fed_id, t, n)

    def _collect(self, fed_id: str, tr: Transition) -> None:
        tasks = self.planner.tasks(fed_id, tr.round)  # prepares every blob a task names before anyone is told
        with self.store.write() as s:
            fed = self._advance(s, fed_id, tr)
            if fed is None:
                return
            if is_secure(self.store.model(fed)):
                self.secure.begin(self.store.round(s, fed_id, tr.round))
        self.publisher.tasks(fed_id, tasks)
        self.publisher.announce(fed_id)

    def _begin_close(self, fed_id: str, tr: Transition) -> None:
        with self.store.write() as s:
            if self._advance(s, fed_id, tr) is None:
                return
        self.publisher.announce(fed_id)

    def _close(self, fed_id: str, tr: Transition) -> None:
        t = tr.round
        with self.store.read() as s:
            known = self.store.existing(s, fed_id)
            fm, rule = self.store.model(known), aggregation_rule(known)
            start = self.store.round(s, fed_id, t).start_digest
            taken = list(s.execute(select(Update, Device.kp).join(Device, Device.id == Update.device)
                                   .where(Update.federation == fed_id, Update.round == t).order_by(Device.slot)))
            ups = [(u.digest, u.n_samples, kp, u.delta_norm) for u, kp in taken]
            history = norm_history(s, fed_id, t, len(ups))
            ids = [u.id for u, _ in taken]
            took = inputs_digest((u.device, u.digest) for u, _ in taken)
            sums = Partials.stored(s, fed_id, t) if self.partial_sums else []
        result: str | None = None
        released = 0  # the updates in what the round publishes (the achieved epsilon's count, privacy_spent)
        if start is not None:  # a server model to aggregate into (none where devices exchange models)
            self.last_merge = (0, 0)
            key = bytes.fromhex(known.noise_key) if known.noise_key else None
            new, released = self._secure(fed_id, t, fm, start) if is_secure(fm) else (
                self.average(fm, start, ups, rule, sums=sums, ids=ids, history=history,
                             noise=round_noise(fm.cfg, t, key)), len(ups))
            self.merged[fed_id, t] = self.last_merge
            if new is None:  # a secure round that released nothing (said there): the base stays the round's start
                result, released = None, 0
            elif all(bool(v.isfinite().all()) for v in new.values() if v.is_floating_point()):
                result = self.blobs.store_server_blob(fed_id, encode(new, model_id=fm.model_id, round=t))
            else:  # never announced: the base stays the round's start (the codec refuses NaN/Inf anyway)
                released = 0
                log.error("federation %s: round %d's aggregate holds NaN/Inf; the base stays the round's start",
                          fed_id, t)
        with self.store.write() as s:
            fed = self._advance(s, fed_id, tr)
            if fed is None:
                return
            s.execute(delete(PartialSum).where(PartialSum.federation == fed_id, PartialSum.round <= t))
            r = self.store.round(s, fed_id, t)
            r.state, r.closed_at, r.base_digest = RoundState.PUBLISHED.value, now(), result
            r.inputs, r.inputs_digest, r.released = len(ups), took, released
            if result is not None:
                fed.base_digest = result
            elif start is not None:
                r.base_digest = start
        log.info("federation %s: round %d closed with %d updates (%d of them in %d partial sums)", fed_id, t,
                 len(ups), *self.merged.get((fed_id, t), (0, 0)))

    def _secure(self, fed_id: str, t: int, fm: FedModel, start: str) -> tuple[dict[str, Tensor] | None, int]:
        """A secure round's release: the sum it unmasked, made into the new base by the algorithm's aggregate,
        which checks it first, and the inputs that sum holds; None (the base stays the round's start) where
        nothing was unmasked or the sum is one no honest inputs make (``SumOutOfRange``: an input out of range, a
        forged share)."""
        summed = self.secure.unmasked(fed_id, t, fm)
        if summed is None:
            return None, 0
        try:
            return (fm.algorithm().aggregate(self.blobs.load(start, fm).tensors, (), summed=summed, t=t),
                    _released_inputs(fm.cfg, summed))
        except SumOutOfRange as e:
            log.error("federation %s: round %d's unmasked sum is refused (%s); nothing is published, the base "
                      "stays the round's start", fed_id, t, e)
            return None, 0

    def average(self, fm: FedModel, start: str, ups: Sequence[_Upload], rule: AggregationRule | None = None, *,
                sums: Sequence[Sum] = (), ids: Sequence[int] = (), history: Sequence[float] = (),
                noise: np.random.Generator | None = None) -> dict[str, Tensor]:
        """The aggregation of the uploads ``(digest, n_samples, kp[, norm])`` into the model ``start`` under ``rule``
        (default ``DEFAULT_RULE``: the weighted mean, each update clipped to the low median of the round's other
        updates' norms times ``DEFAULT_NORM_MULTIPLE``), in slot order
        (so the result does not depend on which device finished first). ``mean`` is the algorithm's own
        aggregation (the simulator's), streamed from the blob store one update at a time; an update within the
        bound is passed on untouched, so where none is clipped the result equals the simulator's to the bit."""
        rule = rule or DEFAULT_RULE
        prev = self.blobs.load(start, fm).tensors
        rows = [(u[0], u[1], u[2], u[3] if len(u) == 4 else None) for u in ups]

        def load(digest: str, kp: int) -> dict[str, Tensor]:
            return self.blobs.load(digest, fm, fm.expected(kp)).tensors

        algo = fm.algorithm()
        if fm.cfg.privacy is not None:  # the private mean bounds every update itself, and adds the round's noise
            new = algo.aggregate(prev, ((load(d, kp), float(n)) for d, n, kp, _ in rows), noise=noise)
        elif rule.rule != "mean":  # a robust rule bounds the updates itself; the algorithm composes it
            new = algo.aggregate(prev, [(load(d, kp), float(n)) for d, n, kp, _ in rows], rule=rule, history=history)
        else:
            # each update's norm as the server computed it on accepting it; a pass over the blobs for any without
            norms = [norm if norm is not None else update_norm(prev, load(d, kp)) for d, _, kp, norm in rows]
            bounds = rule.bounds(norms, history)  # each update's, from the others' norms
            # a sum is used whole only where none of its updates is clipped: the least of the bounds decides that
            least = min((b for b in bounds if b is not None), default=None)
            merged, covered, k = merge_sums(sums, ids, least, fm.shapes, algo.partial_sum())
            if merged is not None:  # the replicas' sums (server.services.partials), then each update none holds
                self.last_merge = (len(covered), k)
            uids = list(ids) if ids else [None] * len(rows)
            rest = [i for i, uid in enumerate(uids) if uid not in covered]  # the updates no merged sum holds
            # the algorithm holds each to its bound and makes the mean (the update-bound stage): the server clips
            # nothing itself, and its bounds are the simulator's (the same rule over the same norms)
            new = algo.aggregate(prev, ((load(rows[i][0], rows[i][2]), float(rows[i][1])) for i in rest),
                                 rule=rule, bounds=[bounds[i] for i in rest], norms=[norms[i] for i in rest],
                                 start=merged)
        if new is None:
            raise InternalError(f"algorithm {fm.cfg.algorithm!r} has a server model but aggregates nothing")
        return new

    def _finish(self, fed_id: str, tr: Transition) -> None:
        with self.store.write() as s:
            fed = self._advance(s, fed_id, tr)
            if fed is None:
                return
        log.info("federation %s: finished after round %d", fed_id, tr.round)
        self.publish_final(fed_id, tr.round)
        self.publisher.announce(fed_id)

    def publish_final(self, fed_id: str, t: int) -> None:
        """The closing step's tasks, to the devices the algorithm's ``closing(t)`` names (FedPer: every device
        evaluates its personal blocks on the last base and reports round t; none where there is no such step)."""
        self.publisher.tasks(fed_id, self.planner.tasks(fed_id, t, final=True))


def norm_history(s: Session, fed_id: str, t: int, n: int) -> list[float]:
    """The norms beside its own that round ``t``'s bound takes, for ``n`` updates: none from ``MIN_UPDATES`` on;
    below, the previous round's (a small round's low median is not judged on its own updates alone). The close
    and anyone recomputing a round's aggregate (bench/soak_ledger.py) take them from here."""
    if n >= MIN_UPDATES:
        return []
    return [x for x in s.scalars(select(Update.delta_norm).where(Update.federation == fed_id, Update.round == t - 1))
            if x is not None]
