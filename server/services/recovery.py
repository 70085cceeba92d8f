"""Recovery after a (re)start, or after the broker came back without its retained messages: finish half-done
transitions and re-publish what devices must see now (every transition was committed before it was published,
so the database alone says what that is)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import select

from ..db import Federation
from ..states import ENROLMENT_ROUND, RoundState
from .planning import Planner
from .publishing import Publisher
from .rounds import RoundMachine
from .store import Store

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    def __init__(self, store: Store, planner: Planner, publisher: Publisher, machine: RoundMachine) -> None:
        self.store = store
        self.planner = planner
        self.publisher = publisher
        self.machine = machine

    def recover(self, leads: Callable[[str], bool] = lambda fed_id: True) -> None:
        """Every finished federation, and every unfinished one this process ``leads`` (the others are their
        leader's: ``server.services.leadership``)."""
        with self.store.read() as s:
            feds = [(f.id, f.round, f.state) for f in s.scalars(select(Federation))]
        for fed_id, t, state in feds:
            if state != RoundState.FINISHED.value and not leads(fed_id):
                continue
            self.resume(fed_id, t, RoundState(state))

    def resume_one(self, fed_id: str) -> None:
        """One federation, as the database has it now (a replica that has just come to lead it)."""
        with self.store.read() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                return
            t, state = fed.round, RoundState(fed.state)
        self.resume(fed_id, t, state)

    def resume(self, fed_id: str, t: int, state: RoundState) -> None:
        try:
            self._recover(fed_id, t, state)
        except Exception:  # one broken federation must not keep the others down
            log.exception("federation %s: recovery failed; the worker will retry", fed_id)

    def _recover(self, fed_id: str, t: int, state: RoundState) -> None:
        if state is RoundState.COLLECTING:
            self.publisher.tasks(fed_id, self.planner.tasks(fed_id, t))
        elif state is RoundState.FINISHED and t > ENROLMENT_ROUND:
            self.machine.publish_final(fed_id, t)
        self.publisher.announce(fed_id)
        if state not in (RoundState.COLLECTING, RoundState.FINISHED):
            self.machine.step(fed_id)  # a transition cut short: make it now
