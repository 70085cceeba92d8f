"""What every service shares: sessions on the database, the lock that serialises this process's writes, and
the lookups each of them needs (a federation, its model, a round's update count)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from pfl_edge.errors import InternalError

from ..db import Federation, Round, Update
from ..errors import NotFound
from ..fedmodel import FedModel, fed_model

__all__ = ["Store"]


class Store:
    """Writes in this process are serialised by one lock (SQLite has one writer anyway); on PostgreSQL the
    federation row is also locked ``FOR UPDATE`` by :meth:`locked`."""

    def __init__(self, sessions: sessionmaker[Session], max_blob_bytes: int = 64 << 20) -> None:
        self.sessions = sessions
        self.max_blob_bytes = max_blob_bytes
        self._lock = threading.RLock()

    def read(self) -> Session:
        return self.sessions()

    @contextmanager
    def write(self) -> Iterator[Session]:
        with self._lock, self.sessions.begin() as s:
            yield s

    @staticmethod
    def federation(s: Session, fed_id: str, *, lock: bool = False) -> Federation:
        """The federation (``lock``: locked for this write transaction); NotFound if there is none."""
        fed = s.get(Federation, fed_id, with_for_update=lock)
        if fed is None:
            raise NotFound(f"unknown federation {fed_id!r}")
        return fed

    @staticmethod
    def locked(s: Session, fed_id: str) -> Federation:
        """The federation, locked for this write transaction."""
        return Store.federation(s, fed_id, lock=True)

    @staticmethod
    def existing(s: Session, fed_id: str) -> Federation:
        """A federation that must exist (a device's, a round's): its absence is a bug, not a refusal."""
        fed = s.get(Federation, fed_id)
        if fed is None:
            raise InternalError(f"federation {fed_id!r} vanished")
        return fed

    @staticmethod
    def round(s: Session, fed_id: str, t: int) -> Round:
        r = s.get(Round, (fed_id, t))
        if r is None:
            raise InternalError(f"federation {fed_id!r} has no row for round {t}")
        return r

    @staticmethod
    def model(fed: Federation) -> FedModel:
        return fed_model(fed.config)

    @staticmethod
    def count_updates(s: Session, fed_id: str, t: int) -> int:
        return s.scalar(select(func.count()).select_from(Update).where(Update.federation == fed_id,
                                                                       Update.round == t)) or 0

    def decode_limit(self, fm: FedModel) -> int:
        """Largest payload a federation's model can need: its dense form twice over (values and masks), or the
        configured limit if higher."""
        dense = 4 * sum(math.prod(s) for s in fm.shapes.values())
        return max(self.max_blob_bytes, 2 * dense + (1 << 20))
