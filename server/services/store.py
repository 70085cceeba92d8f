"""What every service shares: sessions on the database, how writes are serialised, and the lookups each of them
needs (a federation, its model, a round's update count)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from pfl_edge.errors import InternalError

from ..db import Federation, Round, Update
from ..errors import NotFound
from ..fedmodel import FedModel, fed_model
from .leadership import NAMESPACE

BLOBS_LOCK = (NAMESPACE + 1, 0)  # the blob table's advisory lock; a federation's is (NAMESPACE, advisory_key(id))

__all__ = ["Store"]


class Store:
    """On SQLite (one writer, one server process) writes are serialised by one lock of this process. On
    PostgreSQL, which replicas may share, by the rows they lock: the federation's ``FOR UPDATE``
    (:meth:`locked`) for whatever a round's state decides, and the blob table's advisory lock (``blobs``)
    between storing a blob and collecting blobs."""

    def __init__(self, sessions: sessionmaker[Session], max_blob_bytes: int = 64 << 20) -> None:
        self.sessions = sessions
        self.max_blob_bytes = max_blob_bytes
        self._lock = threading.RLock()
        bind = sessions.kw.get("bind")
        self.shared = bind is not None and bind.dialect.name == "postgresql"  # several processes may write

    def read(self) -> Session:
        return self.sessions()

    @contextmanager
    def write(self, *, blobs: Literal["store", "collect"] | None = None) -> Iterator[Session]:
        """A write transaction. ``blobs="store"``: it adds references to blob files it has checked exist, which
        no collection may delete until it commits; ``"collect"``: it deletes blob rows and files, and waits for
        (and holds off) every ``store``."""
        if not self.shared:
            with self._lock, self.sessions.begin() as s:
                yield s
            return
        with self.sessions.begin() as s:
            if blobs is not None:
                fn = "pg_advisory_xact_lock_shared" if blobs == "store" else "pg_advisory_xact_lock"
                s.execute(text(f"SELECT {fn}(:ns, :key)"), {"ns": BLOBS_LOCK[0], "key": BLOBS_LOCK[1]})
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
