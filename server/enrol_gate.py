"""The enrolment gate (``EnrolGate``): who may try a federation's enrolment secret, what every try costs, and
where its KDF runs (issue 33; issue 49: every guess costs the same, whatever the federation's bucket holds)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from pfl_edge.protocol import MIN_ENROL_SECRET

from .db import hash_secret, verify_secret
from .errors import Forbidden, TooManyRequests
from .ratelimit import Buckets, SqlBuckets
from .settings import Settings

__all__ = ["EnrolGate", "enrol_gate"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Guess:
    """An attempt whose secret goes through the KDF: what it spent, and the KDF's answer to come."""

    fed_id: str
    fkey: str
    address: str
    kdf: Future[bool]


class EnrolGate:
    """Who may try an enrolment secret, what every try costs, and where its KDF runs. In order:

    1. The address's bucket is empty: 429 (the secret is not looked at).
    2. The address has ``kdf_per_address`` KDFs queued or running: 429 (Retry-After ``busy_retry_s``; the secret
       is not looked at). Nothing here or in 1 depends on the secret, so no answer tells a right one from a wrong
       one but the answer to the secret itself.
    3. The secret last verified against the federation's current hash in this process (a keyed HMAC of it is
       kept; the key is random per process): pass after ``hit_delay_s`` (by default what the KDF takes, measured
       at start), nothing spent: a fleet whose secret has verified once is not held to the KDF's pool.
    4. The same secret is being verified now (a fleet's first wave): wait for that verification, then 1 again.
    5. Anything else is a guess: it spends its address's token, and the KDF (scrypt: ~0.1 s and 32 MiB, on
       purpose) runs on the gate's own ``kdf_slots`` threads, never on a request thread. Right: the address's
       token comes back, the secret is kept for 3. Wrong, or an unknown federation (same words, same scrypt time,
       a dummy hash): the answer spends a token of the federation's bucket, and is 403, or 429 with Retry-After
       once that bucket is empty.

    So every guess pays the KDF whatever the federation's bucket holds (before issue 49 a guess met an empty
    federation bucket with a 429 and no KDF while the verified secret passed: 100 addresses tested guesses at
    their summed rate, 2,609 429s and one 201 in 160 s): the guesses all addresses together get answered are
    bounded by the KDF's pool, ``kdf_slots`` / 0.1 s, and the federation's bucket counts the wrong answers.
    Unknown federations share one bucket (``fed:?``): random ids buy no fresh bucket."""

    def __init__(self, per_address: Buckets | SqlBuckets, per_federation: Buckets | SqlBuckets, *,
                 kdf_slots: int = 2, kdf_per_address: int = 1, busy_retry_s: float = 1.0,
                 flight_wait_s: float = 30.0, kdf: Callable[[str, str], bool] | None = None,
                 hit_delay_s: float | None = None) -> None:
        self.per_address = per_address
        self.per_federation = per_federation
        self.kdf_per_address, self.busy_retry_s, self.flight_wait_s = kdf_per_address, busy_retry_s, flight_wait_s
        self._kdf = kdf  # None: server.db.verify_secret (scrypt)
        self._hit_s = hit_delay_s  # None: the KDF's time, measured with the dummy hash
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
                t0 = time.perf_counter()
                self._dummy = hash_secret(secrets.token_urlsafe(16))
                if self._hit_s is None:  # the same scrypt a wrong secret pays: what the right one waits
                    self._hit_s = time.perf_counter() - t0
            return self._dummy

    def hit_delay_s(self) -> float:
        """What a verified secret waits before it passes: a guess's KDF time."""
        if self._hit_s is None:
            self._dummy_hash()
        return float(self._hit_s or 0.0)

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
        else:  # the verified secret: as long as a guess
            time.sleep(self.hit_delay_s())

    async def acheck(self, fed_id: str, secret: str, stored: str | None, address: str) -> None:
        """:meth:`check` on the event loop: the KDF is awaited, so no request thread waits for it."""
        step = await self._io(self._enter, fed_id, secret, stored, address, True)
        if isinstance(step, Future):
            await asyncio.wait([asyncio.wrap_future(step)], timeout=self.flight_wait_s)
            step = await self._io(self._enter, fed_id, secret, stored, address, False)
        if isinstance(step, _Guess):
            ok = await asyncio.wrap_future(step.kdf)
            await self._io(self._settle, step, ok)
        else:  # the verified secret: as long as a guess
            await asyncio.sleep(self.hit_delay_s())

    async def _io(self, fn: Callable[..., _T], *args: object) -> _T:
        return await run_in_threadpool(fn, *args) if self._blocking else fn(*args)

    def _busy(self, fed_id: str, wait: float) -> TooManyRequests:
        return TooManyRequests(f"too many enrolment attempts for federation {fed_id!r} or from this address; "
                               f"retry in {wait:.0f} s", retry_after=wait)

    def _enter(self, fed_id: str, secret: str, stored: str | None, address: str,
               follow: bool) -> _Guess | Future[bool] | None:
        """Steps 1 to 5 of the rule up to the KDF: None (pass), the flight to wait for, or the guess under way."""
        wait = self.per_address.wait_s(address)
        if wait > 0:
            raise self._busy(fed_id, wait)
        with self._lock:
            if self._running.get(address, 0) >= self.kdf_per_address:
                raise TooManyRequests("an enrolment attempt from this address is being verified; retry in "
                                      f"{self.busy_retry_s:.0f} s", retry_after=self.busy_retry_s)
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
        with self._lock:
            self._running[address] = self._running.get(address, 0) + 1
        try:
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
                if len(secret) < MIN_ENROL_SECRET:
                    log.warning("federation %s: its enrolment secret is shorter than %d characters; rotate it "
                                "(POST /v1/federations/%s/enrol-secret)", fed_id, MIN_ENROL_SECRET, fed_id)
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
        """After the KDF: a right secret has its address token back; a wrong one spends a federation token (403,
        or 429 where that bucket is empty: the same cost either way)."""
        if ok:
            self.per_address.refund(guess.address)
            return
        wait = self.per_federation.wait_s(guess.fkey)
        self.per_federation.spend(guess.fkey)
        if wait > 0:
            raise self._busy(guess.fed_id, wait)
        raise Forbidden(f"wrong enrol secret for federation {guess.fed_id!r} (or no such federation)")

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
