"""Rate limits: token buckets by key (a client address, a federation), in memory (one server process) or in the
database (``SqlBuckets``: replicas sharing PostgreSQL share their buckets), and a logging filter that keeps a
burst of identical errors (``Too many open files`` while the descriptor table is full) from flooding the log.

A bucket holds up to ``burst`` tokens and refills at ``rate`` per second."""

from __future__ import annotations

import errno
import hashlib
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from sqlalchemy import delete, func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from .db import RateBucket

__all__ = ["Buckets", "FloodFilter", "RedactHookToken", "SqlBuckets", "install_flood_filter"]

class Buckets:
    """Token buckets by key, at most ``max_keys`` of them (the least recently used is forgotten first: a full
    bucket, which is what a new one would be)."""

    def __init__(self, rate: float, burst: int, *, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._lock = threading.Lock()
        self._b: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def _level(self, key: str, now: float) -> float:
        tokens, at = self._b.get(key, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)

    def wait_s(self, key: str) -> float:
        """0 if ``key`` has a token now, else the seconds until it has one (nothing is spent)."""
        with self._lock:
            level = self._level(key, self.clock())
        return 0.0 if level >= 1 else (1 - level) / self.rate

    def spend(self, key: str) -> None:
        """Take one token (a bucket may go below zero: the caller checked :meth:`wait_s` first, racing callers
        pay for the race with a longer wait)."""
        self._add(key, -1.0)

    def refund(self, key: str) -> None:
        self._add(key, 1.0)

    def _add(self, key: str, n: float) -> None:
        with self._lock:
            now = self.clock()
            self._b[key] = (min(self.burst, self._level(key, now) + n), now)
            self._b.move_to_end(key)
            while len(self._b) > self.max_keys:
                self._b.popitem(last=False)


class SqlBuckets:
    """:class:`Buckets` in the database (``pfl_rate_buckets``), for server replicas: every replica spends from
    and reads the same buckets. Each change is one atomic upsert (the level is computed in SQL from the row as
    it is), so racing replicas never lose a spend; a bucket that has refilled to full is deleted (its absence
    means full), so the table holds only the keys in use. Keys are stored as sha256 of (``kind``, key): no
    client addresses in the database. The clock is wall time (replicas on several hosts share it)."""

    def __init__(self, sessions: sessionmaker[Session], kind: str, rate: float, burst: int, *,
                 clock: Callable[[], float] = time.time, sweep_every: int = 256) -> None:
        self.sessions, self.kind = sessions, kind
        self.rate, self.burst, self.clock = rate, float(burst), clock
        self.sweep_every = sweep_every
        self._changes = 0

    def _key(self, key: str) -> str:
        return hashlib.sha256(f"{self.kind}\0{key}".encode()).hexdigest()

    def wait_s(self, key: str) -> float:
        with self.sessions() as s:
            row = s.get(RateBucket, self._key(key))
            level = self.burst if row is None else min(self.burst, row.tokens + (self.clock() - row.at) * self.rate)
        return 0.0 if level >= 1 else (1 - level) / self.rate

    def spend(self, key: str) -> None:
        self._add(key, -1.0)

    def refund(self, key: str) -> None:
        self._add(key, 1.0)

    def _add(self, key: str, n: float) -> None:
        now, b = self.clock(), self.burst
        row = RateBucket
        with self.sessions.begin() as s:
            dialect = s.get_bind().dialect.name
            ins = (pg_insert if dialect == "postgresql" else sqlite_insert)(row).values(
                key=self._key(key), tokens=min(b, b + n), at=now)
            least = func.least if dialect == "postgresql" else func.min  # SQLite's two-argument min is scalar
            new = least(b, least(b, row.tokens + (now - row.at) * self.rate) + n)
            s.execute(ins.on_conflict_do_update(index_elements=[row.key], set_={"tokens": new, "at": now}))
            self._changes += 1
            if self._changes % self.sweep_every == 0:  # full again: forget them
                s.execute(delete(RateBucket).where(RateBucket.tokens + (now - RateBucket.at) * self.rate >= b))


class FloodFilter(logging.Filter):
    """Lets through one record per ``every_s`` seconds of those about an exhausted descriptor table (EMFILE,
    ENFILE), with a count of what it dropped in between; every other record passes."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._last = -float("inf")
        self.dropped = 0
        self._lock = threading.Lock()

    @staticmethod
    def _is_flood(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            return True
        try:
            msg = record.getMessage()
        except Exception:  # a record whose arguments do not format: not ours to judge
            return False
        return "Too many open files" in msg or "out of system resource" in msg

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._is_flood(record):
            return True
        with self._lock:
            now = self.clock()
            if now - self._last < self.every_s:
                self.dropped += 1
                return False
            self._last = now
            dropped, self.dropped = self.dropped, 0
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.every_s:.0f} s not logged)"
        return True


_FILTER = FloodFilter()
_HOOK_PATH = re.compile(r"(/broker/hook/)[^/?\s]+")


class RedactHookToken(logging.Filter):
    """The broker hook's token is a path segment (``/v1/broker/hook/<token>/user``, as brokers ask it) and was in
    every access-log line: written as ``***`` before any handler sees the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(isinstance(a, str) and "/broker/hook/" in a for a in record.args):
            record.args = tuple(_HOOK_PATH.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str) and "/broker/hook/" in record.msg:
            record.msg = _HOOK_PATH.sub(r"\1***", record.msg)
        return True


_REDACT = RedactHookToken()


def install_flood_filter(*logger_names: str) -> FloodFilter:
    """Attach the one process-wide :class:`FloodFilter` to every handler of the root logger and of the named
    loggers (records propagate to handlers, whose filters see records of every child logger)."""
    names = ("", "asyncio", "uvicorn", "uvicorn.error", "uvicorn.access", *logger_names)
    handlers = [h for name in names for h in logging.getLogger(name).handlers]
    if logging.lastResort is not None:  # where records go when no handler is configured
        handlers.append(logging.lastResort)
    for f in [*handlers, logging.getLogger("asyncio")]:  # asyncio's accept loop logs EMFILE to its own logger
        if _FILTER not in f.filters:
            f.addFilter(_FILTER)
    for name in ("uvicorn.access", "uvicorn.error"):  # on the loggers: their records, whatever handler they reach
        if _REDACT not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_REDACT)
    return _FILTER
