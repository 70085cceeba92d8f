"""Rate limits: token buckets by key (a client address, a federation), in memory (one server process) or in the
database (``SqlBuckets``: replicas sharing PostgreSQL share their buckets), and a logging filter that keeps a
burst of identical errors (``Too many open files`` while the descriptor table is full) from flooding the log.

A bucket holds up to ``burst`` tokens and refills at ``rate`` per second."""

from __future__ import annotations

import asyncio
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
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import delete, func
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from .db import RateBucket, hash_secret, verify_secret
from .errors import Forbidden, TooManyRequests
from .settings import Settings

__all__ = ["Buckets", "EnrolGate", "FloodFilter", "RedactHookToken", "SqlBuckets", "enrol_gate",
           "install_flood_filter"]

_T = TypeVar("_T")


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


@dataclass(frozen=True)
class _Guess:
    """An attempt whose secret goes through the KDF: what it spent, and the KDF's answer to come."""

    fed_id: str
    fkey: str
    address: str
    kdf: Future[bool]


class EnrolGate:
    """Who may try an enrolment secret, how cheaply the right one is checked, and where its KDF runs. In order:

    1. The address's bucket is empty: 429 (the secret is not looked at).
    2. The secret last verified against the federation's current hash in this process (a keyed HMAC of it is
       kept; the key is random per process): pass, nothing spent, the federation's bucket not consulted, so
       guesses (from many addresses) that emptied it do not lock out a fleet whose secret has verified once.
    3. The same secret is being verified now (a fleet's first wave): wait for that verification, then 1 again.
    4. Anything else is a guess and spends its address's token at once, whatever the answer (else 429-versus-
       pass would test guesses against the HMAC for free). Then 429 if the federation's bucket is empty, or if
       the address has ``kdf_per_address`` KDFs queued or running (Retry-After ``busy_retry_s``; no KDF). Else
       it spends a federation token, before the KDF runs; the KDF (scrypt: ~0.1 s and 32 MiB, on purpose) runs
       on the gate's own ``kdf_slots`` threads, never on a request thread. Right: both tokens come back, the
       secret is kept for 2. Wrong, or an unknown federation: 403, same words, same scrypt time (a dummy hash).

    Unknown federations share one bucket (``fed:?``): random ids buy no fresh bucket. So a federation's bucket
    bounds the KDF time its name draws, the address buckets each address's guesses. Until the right secret has
    verified once in this process (after a start or a secret rotation) it competes with guesses for the
    federation's tokens; the fleet needs one success. Trade-offs: while the federation's bucket is empty a guess
    gets 429 and the right secret passes, so addresses together guess at the sum of their address rates (not
    the federation's rate): harmless for a long random secret only (the API accepts 8 characters chosen by a
    person). While ``fed:?`` is empty an unknown name is 429 where a known one is 403, one address token a try."""

    def __init__(self, per_address: Buckets | SqlBuckets, per_federation: Buckets | SqlBuckets, *,
                 kdf_slots: int = 2, kdf_per_address: int = 1, busy_retry_s: float = 1.0,
                 flight_wait_s: float = 30.0, kdf: Callable[[str, str], bool] | None = None) -> None:
        self.per_address = per_address
        self.per_federation = per_federation
        self.kdf_per_address, self.busy_retry_s, self.flight_wait_s = kdf_per_address, busy_retry_s, flight_wait_s
        self._kdf = kdf  # None: server.db.verify_secret (scrypt)
        self._key = secrets.token_bytes(32)
        self._verified: dict[str, tuple[str, bytes]] = {}  # federation -> (its secret hash, HMAC of the secret)
        self._dummy: str | None = None
        self._dummy_lock = threading.Lock()
        self._lock = threading.Lock()
        self._flights: dict[tuple[str, bytes], Future[bool]] = {}  # (federation, HMAC) being verified now
        self._running: dict[str, int] = {}  # address -> its KDFs queued or running
        # scrypt holds 32 MiB and a core while it runs: a few at a time, on threads no request waits for
        self._pool = ThreadPoolExecutor(kdf_slots, thread_name_prefix="pfl-kdf")
        # SqlBuckets talk to the database: from the event loop, only through the threadpool
        self._blocking = isinstance(per_address, SqlBuckets) or isinstance(per_federation, SqlBuckets)
        # made now, off the request path: the first unknown federation must not take twice a wrong secret's time
        self._pool.submit(self._dummy_hash)

    def _mac(self, fed_id: str, secret: str) -> bytes:
        return hmac.new(self._key, f"{fed_id}\0{secret}".encode(), hashlib.sha256).digest()

    def _dummy_hash(self) -> str:
        with self._dummy_lock:
            if self._dummy is None:
                self._dummy = hash_secret(secrets.token_urlsafe(16))
            return self._dummy

    def check(self, fed_id: str, secret: str, stored: str | None, address: str) -> None:
        """Pass if ``secret`` is the federation's (``stored``: its hash, None if there is no such federation);
        else Forbidden, or TooManyRequests (with Retry-After). For a caller on a thread of its own; the KDF still
        runs on the gate's pool."""
        step = self._enter(fed_id, secret, stored, address, follow=True)
        if isinstance(step, Future):
            futures_wait([step], timeout=self.flight_wait_s)
            step = self._enter(fed_id, secret, stored, address, follow=False)
        if isinstance(step, _Guess):
            self._settle(step, step.kdf.result())

    async def acheck(self, fed_id: str, secret: str, stored: str | None, address: str) -> None:
        """:meth:`check` on the event loop: the KDF is awaited, so no request thread waits for it."""
        step = await self._io(self._enter, fed_id, secret, stored, address, True)
        if isinstance(step, Future):
            await asyncio.wait([asyncio.wrap_future(step)], timeout=self.flight_wait_s)
            step = await self._io(self._enter, fed_id, secret, stored, address, False)
        if isinstance(step, _Guess):
            ok = await asyncio.wrap_future(step.kdf)
            await self._io(self._settle, step, ok)

    async def _io(self, fn: Callable[..., _T], *args: object) -> _T:
        return await run_in_threadpool(fn, *args) if self._blocking else fn(*args)

    def _busy(self, fed_id: str, wait: float) -> TooManyRequests:
        return TooManyRequests(f"too many enrolment attempts for federation {fed_id!r} or from this address; "
                               f"retry in {wait:.0f} s", retry_after=wait)

    def _enter(self, fed_id: str, secret: str, stored: str | None, address: str,
               follow: bool) -> _Guess | Future[bool] | None:
        """Steps 1 to 4 of the rule up to the KDF: None (pass), the flight to wait for, or the guess under way."""
        wait = self.per_address.wait_s(address)
        if wait > 0:
            raise self._busy(fed_id, wait)
        mac = self._mac(fed_id, secret)
        if self._hit(fed_id, stored, mac):
            return None
        key = (fed_id, mac)
        with self._lock:
            flight = self._flights.get(key)
            if flight is not None and follow:
                return flight
            lead: Future[bool] | None = None
            if flight is None:
                lead = self._flights[key] = Future()
        try:
            guess = self._guess(fed_id, secret, stored, mac, address)
        except BaseException:
            if lead is not None:  # its followers wake and try for themselves
                self._land(key, lead, None)
            raise
        if lead is not None:
            guess.kdf.add_done_callback(lambda done: self._land(key, lead, done))
        return guess

    def _guess(self, fed_id: str, secret: str, stored: str | None, mac: bytes, address: str) -> _Guess:
        fkey = "fed:?" if stored is None else f"fed:{fed_id}"
        self.per_address.spend(address)
        wait = self.per_federation.wait_s(fkey)
        if wait > 0:
            raise self._busy(fed_id, wait)
        with self._lock:
            if self._running.get(address, 0) >= self.kdf_per_address:
                raise TooManyRequests("an enrolment attempt from this address is being verified; retry in "
                                      f"{self.busy_retry_s:.0f} s", retry_after=self.busy_retry_s)
            self._running[address] = self._running.get(address, 0) + 1
        try:
            self.per_federation.spend(fkey)  # before the KDF: a guess pays whether or not it is answered
            kdf = self._pool.submit(self._kdf_job, fed_id, secret, stored, mac, address)
        except BaseException:
            self._release(address)
            raise
        # a job cancelled before it ran (its request was cancelled while it queued) never reaches its finally
        kdf.add_done_callback(lambda done: self._release(address) if done.cancelled() else None)
        return _Guess(fed_id, fkey, address, kdf)

    def _kdf_job(self, fed_id: str, secret: str, stored: str | None, mac: bytes, address: str) -> bool:
        """On the gate's pool: the KDF, and the right secret kept before any follower wakes (and the address
        released before its caller sees the answer: its next attempt is not refused as concurrent)."""
        try:
            kdf = self._kdf or verify_secret  # looked up now: tests count the calls
            if stored is None:  # an unknown federation costs what a wrong secret does
                kdf(secret, self._dummy_hash())
                return False
            ok = kdf(secret, stored)
            if ok:
                self._verified[fed_id] = (stored, mac)
            return ok
        finally:
            self._release(address)

    def _release(self, address: str) -> None:
        with self._lock:
            n = self._running.get(address, 0) - 1
            if n > 0:
                self._running[address] = n
            else:
                self._running.pop(address, None)

    def _land(self, key: tuple[str, bytes], flight: Future[bool], done: Future[bool] | None) -> None:
        with self._lock:
            if self._flights.get(key) is flight:
                del self._flights[key]
        ok = done is not None and not done.cancelled() and done.exception() is None and done.result()
        flight.set_result(bool(ok))

    def _settle(self, guess: _Guess, ok: bool) -> None:
        if not ok:
            raise Forbidden(f"wrong enrol secret for federation {guess.fed_id!r} (or no such federation)")
        self.per_address.refund(guess.address)
        self.per_federation.refund(guess.fkey)

    def _hit(self, fed_id: str, stored: str | None, mac: bytes) -> bool:
        hit = self._verified.get(fed_id)
        return stored is not None and hit is not None and hit[0] == stored and hmac.compare_digest(hit[1], mac)

    def forget(self, fed_id: str) -> None:
        """The federation's secret changed: the next enrolment verifies afresh."""
        self._verified.pop(fed_id, None)


def enrol_gate(settings: Settings, sessions: sessionmaker[Session] | None = None) -> EnrolGate:
    """The enrolment gate with the settings' limits: buckets in the database where ``sessions`` are on
    PostgreSQL (replicas share them), else in this process's memory."""
    bind = None if sessions is None else sessions.kw.get("bind")
    shared = sessions if bind is not None and bind.dialect.name == "postgresql" else None
    made = [Buckets(rate, burst) if shared is None else SqlBuckets(shared, kind, rate, burst) for kind, rate, burst in (
        ("address", settings.enrol_rate_per_address, settings.enrol_burst_per_address),
        ("federation", settings.enrol_rate_per_federation, settings.enrol_burst_per_federation))]
    return EnrolGate(made[0], made[1], kdf_slots=settings.enrol_kdf_slots)
