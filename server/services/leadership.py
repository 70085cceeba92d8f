"""Which server process runs each federation's rounds.

Any number of server replicas may share one PostgreSQL database and one blob store: each serves enrolment,
downloads, uploads, updates and metrics (a row's constraints and the federation's row lock make a write count
once, whichever replica takes it). A round's transitions (open, collect, close, finish), its garbage collection
and its re-publication after a broker restart run in one process per federation, its *leader*: the one holding
the PostgreSQL session-level advisory lock ``(NAMESPACE, key(federation))``. A leader that dies loses its
connection and with it the lock; the next tick of another replica takes it, resumes the federation from the
database (``Recovery``) and runs its rounds from there. Transitions are compare-and-set on the federation's
locked row (``RoundMachine._advance``), so even two processes that both believe they lead (a leader cut off
from the database, before PostgreSQL has noticed) close a round once.

SQLite has one writer: a SQLite database serves one server process (``sqlite_guard``), which leads every
federation.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Protocol

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

from pfl_edge.errors import ConfigError

__all__ = ["NAMESPACE", "AdvisoryLeadership", "Leadership", "SoleLeadership", "advisory_key", "leadership_for",
           "sqlite_guard"]

log = logging.getLogger(__name__)

NAMESPACE = 0x70666C  # "pfl": the first key of every advisory lock pfl-edge takes (the second is the object's)


def advisory_key(name: str) -> int:
    """A signed 32-bit key for ``name`` (PostgreSQL's two-key advisory locks take two int4s). Two names that
    collide share a leader, which is harmless."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big", signed=True)


class Leadership(Protocol):
    def claim(self, fed_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Of ``fed_ids``, those this process leads now, and those among them it has only just come to lead
        (to be resumed from the database before their next transition)."""
        ...

    def release(self, fed_id: str) -> None:
        """Stop leading ``fed_id`` (it finished)."""
        ...

    def close(self) -> None: ...


class SoleLeadership:
    """The one server process of a SQLite database leads every federation."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def claim(self, fed_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        ids = set(fed_ids)
        gained = ids - self._seen
        self._seen |= gained
        return ids, gained

    def release(self, fed_id: str) -> None:
        self._seen.discard(fed_id)

    def close(self) -> None:
        self._seen.clear()


class AdvisoryLeadership:
    """Leadership by PostgreSQL session-level advisory locks, held on one connection of this process's own
    (outside the pool: a lock belongs to the database session that took it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None
        self._held: set[str] = set()

    def claim(self, fed_ids: Iterable[str]) -> tuple[set[str], set[str]]:
        ids = set(fed_ids)
        gained: set[str] = set()
        try:
            conn = self._connection()
            conn.execute(text("SELECT 1"))  # a dead session holds nothing: find out before trusting _held
            for fed_id in sorted(ids - self._held):
                if conn.execute(text("SELECT pg_try_advisory_lock(:ns, :key)"),
                                {"ns": NAMESPACE, "key": advisory_key(fed_id)}).scalar():
                    self._held.add(fed_id)
                    gained.add(fed_id)
            conn.commit()  # session locks outlive the transaction; the connection must not idle in one
        except SQLAlchemyError as e:
            if self._held:
                log.warning("lost the database session that held the leadership of %d federation(s): %s",
                            len(self._held), e)
            self._drop()
            return set(), set()
        if gained:
            log.info("leading federation(s) %s", ", ".join(sorted(gained)))
        return ids & self._held, gained

    def release(self, fed_id: str) -> None:
        if fed_id not in self._held or self._conn is None:
            return
        self._held.discard(fed_id)
        try:
            self._conn.execute(text("SELECT pg_advisory_unlock(:ns, :key)"),
                               {"ns": NAMESPACE, "key": advisory_key(fed_id)})
            self._conn.commit()
        except SQLAlchemyError:
            self._drop()

    def close(self) -> None:
        self._drop()

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self.engine.connect()
        return self._conn

    def _drop(self) -> None:
        self._held.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.invalidate()  # never back into the pool: closing the session releases its locks
                conn.close()
            except SQLAlchemyError:
                pass


def leadership_for(engine: Engine) -> Leadership:
    return AdvisoryLeadership(engine) if engine.dialect.name == "postgresql" else SoleLeadership()


def sqlite_guard(database_url: str) -> IO[bytes] | None:
    """For a SQLite database, an exclusive lock on ``<database>.server-lock`` held for the process's life (the
    returned file: keep it open); ConfigError if another server process holds it. None for other databases."""
    prefix = "sqlite:///"
    if not database_url.startswith(prefix) or database_url == prefix + ":memory:":
        return None
    path = Path(database_url[len(prefix):].split("?", 1)[0])
    f = open(str(path) + ".server-lock", "a+b")  # noqa: SIM115  (held open for the server's life)
    os.chmod(f.name, 0o600)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read(32).decode(errors="replace").strip() or "?"
        f.close()
        raise ConfigError(f"another pfl-edge server (pid {other}) is running on the SQLite database {path}: SQLite "
                          "serves one server process. To run several replicas, give them one PostgreSQL database "
                          "(database_url = postgresql://...) and an external broker (docs/operations.md, "
                          "'Replicas').") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()).encode())
    f.flush()
    return f
