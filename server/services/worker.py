"""The round worker: one thread that makes every state transition of the federations this process leads
(``server.services.leadership``: all of them, but where replicas share a PostgreSQL database), woken by
enrolments and updates, by the MQTT link when the broker came back, and by a ticker for deadlines. HTTP handlers
only insert rows."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import select

from ..db import Federation
from ..states import RoundState
from .leadership import Leadership, SoleLeadership
from .recovery import Recovery
from .rounds import RoundMachine
from .store import Store

__all__ = ["RoundWorker"]

log = logging.getLogger(__name__)


class RoundWorker:
    def __init__(self, store: Store, machine: RoundMachine, recovery: Recovery, *, tick_s: float = 1.0,
                 coalesce_s: float = 0.05, leadership: Leadership | None = None) -> None:
        self.store = store
        self.leadership: Leadership = leadership if leadership is not None else SoleLeadership()
        self.led: set[str] = set()  # the unfinished federations this process led at its last tick
        self.machine = machine
        self.recovery = recovery
        self.tick_s = tick_s
        # a wake-up waits this long before it ticks, so a burst of enrolments or updates (hundreds a second in a
        # large fleet) makes one readiness check, not one each; a transition is at most this much later
        self.coalesce_s = coalesce_s
        self.kicks = 0  # wake-ups asked for, and ticks made: what coalescing saves (benchmarks, tests)
        self.ticks = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._republish = False
        self._thread: threading.Thread | None = None
        self.after_step: Callable[[str], object] = lambda fed_id: None  # the blob collector (server.services.gc)

    def start(self) -> None:
        """Claim the federations no other replica leads and resume them (and every finished one), then run the
        worker (transitions and deadlines)."""
        self._claim()
        self.recovery.recover(leads=self.led.__contains__)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pfl-rounds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        self.leadership.close()
        self.led = set()

    def kick(self) -> None:
        self.kicks += 1  # not atomic across threads: a statistic, not a ledger
        self._wake.set()

    def request_republish(self) -> None:
        """From the MQTT thread: the broker came back; the worker re-publishes what devices must see now."""
        self._republish = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(self.tick_s) and self.coalesce_s > 0:
                self._stop.wait(self.coalesce_s)  # the rest of the burst joins this tick
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if self._republish:
                    self._republish = False
                    self.recovery.recover(leads=self.led.__contains__)
                self.tick()
            except Exception:  # keep the worker alive; the next tick retries
                log.exception("round worker")

    def _claim(self) -> set[str]:
        """Claim leadership of the unfinished federations; those newly led (another replica's, until it died)."""
        with self.store.read() as s:
            ids = set(s.scalars(select(Federation.id).where(Federation.state != RoundState.FINISHED.value)))
        for gone in self.led - ids:  # finished (here or, before a takeover, by the leader that died)
            self.leadership.release(gone)
        self.led, gained = self.leadership.claim(ids)
        return gained

    def tick(self) -> None:
        """Every due transition of every unfinished federation this process leads."""
        self.ticks += 1
        gained = self._claim()
        for fed_id in sorted(self.led):
            try:
                if fed_id in gained:  # new, or taken over from a leader that died: resume it as a restart would
                    self.recovery.resume_one(fed_id)
                self.machine.step(fed_id)
                self.after_step(fed_id)
            except Exception:
                log.exception("federation %s: transition failed; will retry", fed_id)
