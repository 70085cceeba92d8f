"""Rate limits: token buckets by key (a client address, a federation), in memory (one server process) or in the
database (``SqlBuckets``: replicas sharing PostgreSQL share their buckets), and a logging filter that keeps a
burst of identical errors (``Too many open files`` while the descriptor table is full) from flooding the log.

A bucket holds up to ``burst`` tokens and refills at ``rate`` per second."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from sqlalchemy import delete, func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker

from .db import RateBucket, hash_secret, verify_secret
from .errors import Forbidden, TooManyRequests
from .settings import Settings

__all__ = ["Buckets", "EnrolGate", "FloodFilter", "RedactHookToken", "SqlBuckets", "enrol_gate",
           "install_flood_filter"]


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


class EnrolGate:
    """Who may try an enrolment secret, and how cheaply the right one is checked.

    Each attempt needs a token in its address's bucket and in its federation's; a refused attempt (wrong
    secret, unknown federation) spends one of each, so a guesser gets ``burst`` guesses and then ``rate`` per
    second, and a guesser at many addresses still meets the federation's bucket. An unknown federation is
    refused exactly as a wrong secret is (403, same words, a scrypt of a dummy hash: same time), so names cannot
    be enumerated. scrypt costs ~0.1 s on purpose; so that an honest fleet enrolling with the right secret pays
    it once, the gate keeps per federation a keyed HMAC (key: random per process) of the last secret that
    verified against the federation's current hash: the right secret again costs one HMAC. A hit still needs a
    token in both buckets (nothing spent): with an empty bucket every answer is 429, so a guess's answer never
    tells more than "wait"."""

    def __init__(self, per_address: Buckets | SqlBuckets, per_federation: Buckets | SqlBuckets, *,
                 kdf_slots: int = 4) -> None:
        self.per_address = per_address
        self.per_federation = per_federation
        self._key = secrets.token_bytes(32)
        self._verified: dict[str, tuple[str, bytes]] = {}  # federation -> (its secret hash, HMAC of the secret)
        self._dummy: str | None = None
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, bytes], threading.Event] = {}  # (federation, HMAC) being verified now
        self._kdf_slots = threading.BoundedSemaphore(kdf_slots)
        # made now, off the request path: the first unknown federation must not take twice a wrong secret's time
        threading.Thread(target=self._dummy_hash, name="pfl-dummy-hash", daemon=True).start()

    def _mac(self, fed_id: str, secret: str) -> bytes:
        return hmac.new(self._key, f"{fed_id}\0{secret}".encode(), hashlib.sha256).digest()

    def _dummy_hash(self) -> str:
        with self._lock:
            if self._dummy is None:
                self._dummy = hash_secret(secrets.token_urlsafe(16))
            return self._dummy

    def check(self, fed_id: str, secret: str, stored: str | None, address: str) -> None:
        """Pass if ``secret`` is the federation's (``stored``: its hash, None if there is no such federation);
        else Forbidden, or TooManyRequests (with Retry-After) while either bucket is empty."""
        fkey = f"fed:{fed_id}"
        wait = max(self.per_address.wait_s(address), self.per_federation.wait_s(fkey))
        if wait > 0:
            raise TooManyRequests(f"too many enrolment attempts for federation {fed_id!r} or from this address; "
                                  f"retry in {wait:.0f} s", retry_after=wait)
        mac = self._mac(fed_id, secret)
        if self._hit(fed_id, stored, mac):
            return
        with self._lock:  # the same secret already being verified (a fleet's first wave): wait for that one
            flight = self._flights.get((fed_id, mac))
            leader = flight is None
            if flight is None:
                flight = self._flights[fed_id, mac] = threading.Event()
        if not leader:
            flight.wait(30)
            if self._hit(fed_id, stored, mac):
                return
        try:
            self._verify(fed_id, secret, stored, mac, address)
        finally:
            if leader:
                with self._lock:
                    self._flights.pop((fed_id, mac), None)
                flight.set()

    def _hit(self, fed_id: str, stored: str | None, mac: bytes) -> bool:
        hit = self._verified.get(fed_id)
        return stored is not None and hit is not None and hit[0] == stored and hmac.compare_digest(hit[1], mac)

    def _verify(self, fed_id: str, secret: str, stored: str | None, mac: bytes, address: str) -> None:
        fkey = f"fed:{fed_id}"
        self.per_address.spend(address)
        self.per_federation.spend(fkey)
        with self._kdf_slots:  # scrypt holds 32 MiB while it runs: a few at a time
            # an unknown federation costs what a wrong secret does
            ok = verify_secret(secret, self._dummy_hash() if stored is None else stored)
        if stored is None or not ok:
            raise Forbidden(f"wrong enrol secret for federation {fed_id!r} (or no such federation)")
        self.per_address.refund(address)
        self.per_federation.refund(fkey)
        self._verified[fed_id] = (stored, mac)

    def forget(self, fed_id: str) -> None:
        """The federation's secret changed: the next enrolment verifies afresh."""
        self._verified.pop(fed_id, None)


def enrol_gate(settings: Settings, sessions: sessionmaker[Session] | None = None) -> EnrolGate:
    """The enrolment gate with the settings' limits: buckets in the database where ``sessions`` are on
    PostgreSQL (replicas share them), else in this process's memory."""
    bind = None if sessions is None else sessions.kw.get("bind")
    if sessions is not None and bind is not None and bind.dialect.name == "postgresql":
        return EnrolGate(SqlBuckets(sessions, "address", settings.enrol_rate_per_address,
                                    settings.enrol_burst_per_address),
                         SqlBuckets(sessions, "federation", settings.enrol_rate_per_federation,
                                    settings.enrol_burst_per_federation))
    return EnrolGate(Buckets(settings.enrol_rate_per_address, settings.enrol_burst_per_address),
                     Buckets(settings.enrol_rate_per_federation, settings.enrol_burst_per_federation))
