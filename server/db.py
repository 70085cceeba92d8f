"""Durable state in SQL through SQLAlchemy 2 (SQLite by default, PostgreSQL by URL).

Tables: federations, devices, rounds, updates, metrics, blobs and blob_refs (which federation, and which device,
may read a blob), and pfl_schema (the schema's version; ``server.migrations`` creates and upgrades it). The latest
sparse model of a DisPFL device is derived from its updates. ``UNIQUE(federation, round, device)`` on updates is
what makes an accepted update count exactly once, even under a race. Round states are stored as the values of
``server.states.RoundState``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Engine,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from .states import RoundState

__all__ = [
    "SERVER",
    "Base",
    "Blob",
    "BlobRef",
    "Device",
    "Federation",
    "Metric",
    "PartialSum",
    "RateBucket",
    "Round",
    "SchemaVersion",
    "SecAggMessage",
    "Update",
    "hash_secret",
    "hash_token",
    "inputs_digest",
    "make_engine",
    "now",
    "verify_secret",
]

SERVER = ""  # uploader of the blobs the server makes itself (initial models, averaged bases)


def now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class Federation(Base):
    __tablename__ = "pfl_federations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    enrol_secret_hash: Mapped[str] = mapped_column(String(200))
    quorum: Mapped[float] = mapped_column(Float)
    deadline_s: Mapped[float] = mapped_column(Float)
    min_updates: Mapped[int] = mapped_column(Integer)
    min_devices: Mapped[int | None] = mapped_column(Integer, nullable=True)  # None: every slot before round 1
    profile_capacity: Mapped[bool] = mapped_column(Boolean)
    round: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[str] = mapped_column(String(16), default=RoundState.OPEN.value)
    init_digest: Mapped[str] = mapped_column(String(64))  # the dense initial model
    base_digest: Mapped[str] = mapped_column(String(64))  # FedPer: the server's whole model after the last close
    round_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, default=now)
    # how updates are combined and bounded (robust aggregation); None: the plain weighted mean, default bounds
    aggregation: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # the key a device's MQTT password is derived from when it enrols with a nonce (with the nonce and the enrol
    # secret: server.services.broker_access.device_password); made at the first such enrolment
    mqtt_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # the key of the aggregate's differential-privacy noise (pfl_edge.privacy.noise_rng), hex; made at creation
    # where the config's privacy asks for secret noise, never sent to anyone
    noise_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # the key of its rounds' secret draw (pfl_edge.algorithms.participants.secret_slots), hex; made at creation
    # with the noise key (pfl_edge.privacy.secret_draw), never sent to a device (None: the seed's public draw)
    sampling_key: Mapped[str | None] = mapped_column(String(64), nullable=True)

    @property
    def draw_key(self) -> bytes | None:
        """The sampling key that ``Algorithm.participation`` draws this federation's rounds under (None: none)."""
        return bytes.fromhex(self.sampling_key) if self.sampling_key else None


class Device(Base):
    __tablename__ = "pfl_devices"
    __table_args__ = (UniqueConstraint("federation", "slot", name="uq_pfl_device_slot"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the token; never the token
    profile: Mapped[str] = mapped_column(String(64))
    name: Mapped[str] = mapped_column(String(64), default="")
    slot: Mapped[int] = mapped_column(Integer)  # the protocol's ``index``
    density: Mapped[float] = mapped_column(Float)
    kp: Mapped[int] = mapped_column(Integer)
    online: Mapped[bool] = mapped_column(Boolean, default=False)
    last_seen: Mapped[float | None] = mapped_column(Float, nullable=True)
    joined_round: Mapped[int] = mapped_column(Integer)  # takes part from joined_round + 1
    enrol_nonce: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    enrolled_at: Mapped[float] = mapped_column(Float, default=now)
    # its own MQTT password (sha256 of 256 random bits; the broker checks it, Mosquitto gets it at provisioning)
    mqtt_hash: Mapped[str | None] = mapped_column(String(200), nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # set: no HTTP, no MQTT, no rounds
    token_expires: Mapped[float | None] = mapped_column(Float, nullable=True)  # unix time; None: never
    # the start of its token chain: when it last enrolled with the secret or the admin issued it a token; its own
    # rotations keep it, and none reaches past it + device_token_max_lifetime_s (None: before schema 9)
    token_origin: Mapped[float | None] = mapped_column(Float, nullable=True)
    declared_samples: Mapped[int | None] = mapped_column(Integer, nullable=True)  # training samples at enrolment
    uploaded_bytes: Mapped[int] = mapped_column(BigInteger, default=0)  # distinct blob bytes it sent (its quota)
    refused_updates: Mapped[int] = mapped_column(Integer, default=0)  # uploads the server refused (Updates.submit)
    # what it said it is at enrolment (protocol.Platform as JSON; reported, never verified; None: it said nothing)
    platform: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # its Ed25519 public key (hex) and the last counter it signed with (pfl_edge.device_key): enrolling again under
    # its nonce and rotating its token must be signed, with a larger counter (None: it enrolled without a key)
    public_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    key_counter: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # its MQTT client id (None: enrolled before schema 15, ``pfl-<id>``), derived from its MQTT password
    mqtt_client: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # the protocol version the server answers it in (negotiated at its last enrolment; None: before schema 15, 1)
    protocol: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Round(Base):
    __tablename__ = "pfl_rounds"

    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    opened_at: Mapped[float] = mapped_column(Float)
    deadline: Mapped[float] = mapped_column(Float)
    closed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    active: Mapped[int] = mapped_column(Integer, default=0)  # devices given a task
    start_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)  # FedPer: the model it starts from
    base_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)  # FedPer: the average it produced
    # what the close took, written in its transaction: the number of update rows and ``inputs_digest`` of their
    # (device, digest) pairs; a check holds the rows of the round to it (exactly once, nothing lost)
    inputs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    inputs_digest: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # secure aggregation (server.services.secure): the collecting round's step and the time it may end at
    secagg_step: Mapped[str | None] = mapped_column(String(16), nullable=True)
    step_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the updates in what its close published (0: it published its start; a secure round, the inputs its unmasked
    # sum holds): the count a distributed-mode round's achieved epsilon is figured from (None: closed before
    # schema 14, or not closed)
    released: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Update(Base):
    __tablename__ = "pfl_updates"
    __table_args__ = (
        UniqueConstraint("federation", "round", "device", name="uq_pfl_update"),
        Index("ix_pfl_updates_device", "federation", "device", "round"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # the order of acceptance
    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"))
    round: Mapped[int] = mapped_column(Integer)
    device: Mapped[str] = mapped_column(ForeignKey("pfl_devices.id"))
    digest: Mapped[str] = mapped_column(String(64))
    n_samples: Mapped[int] = mapped_column(Integer)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted_at: Mapped[float] = mapped_column(Float, default=now)
    # ||update - the round's start model||, computed by the server when it checked the upload (robust aggregation)
    delta_norm: Mapped[float | None] = mapped_column(Float, nullable=True)


class Metric(Base):
    __tablename__ = "pfl_metrics"

    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    device: Mapped[str] = mapped_column(ForeignKey("pfl_devices.id"), primary_key=True)
    accuracy: Mapped[float] = mapped_column(Float)
    loss: Mapped[float] = mapped_column(Float)
    n_test: Mapped[int] = mapped_column(Integer)
    bytes_up: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_down: Mapped[int] = mapped_column(BigInteger, default=0)
    step_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    train_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    dropped: Mapped[int | None] = mapped_column(Integer, nullable=True)  # DisPFL: neighbours it left out (screen)
    # what the round cost the device, in its own word (protocol 3; None before it, or not reported)
    round_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    transfer_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    peak_rss_mb: Mapped[float | None] = mapped_column(Float, nullable=True)
    reported_at: Mapped[float] = mapped_column(Float, default=now)


class SchemaVersion(Base):
    """One row: the version of the schema this database holds (``server.migrations.SCHEMA_VERSION``)."""

    __tablename__ = "pfl_schema"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)  # always 1
    version: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[float] = mapped_column(Float, default=now)


class PartialSum(Base):
    """A replica's running sum of the updates it accepted in a round (``server.services.partials``): rewritten
    in place as it folds more in; the leader merges the round's rows at close, then deletes them."""

    __tablename__ = "pfl_partial_sums"
    __table_args__ = (Index("ix_pfl_partial_sums_round", "federation", "round"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # one per replica process and round
    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"))
    round: Mapped[int] = mapped_column(Integer)
    updates: Mapped[list[int]] = mapped_column(JSON)  # the ids of the Update rows it sums
    max_norm: Mapped[float | None] = mapped_column(Float, nullable=True)  # the largest of their norms
    data: Mapped[bytes] = mapped_column(LargeBinary)  # safetensors: the float64 sums, their weights and dtypes
    written_at: Mapped[float] = mapped_column(Float, default=now)


class SecAggMessage(Base):
    """A device's message of a secure round's step (``server.services.secure``): its keys (``keys``), its sealed
    shares (``shares``: the receivers' slots and boxes), its revealed shares (``unmask``), as the wire's JSON."""

    __tablename__ = "pfl_secagg"

    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), primary_key=True)
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    at: Mapped[float] = mapped_column(Float, default=now)


class RateBucket(Base):
    """A token bucket that server replicas share (``server.ratelimit.SqlBuckets``); a full one has no row."""

    __tablename__ = "pfl_rate_buckets"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 of (bucket kind, key): no addresses
    tokens: Mapped[float] = mapped_column(Float)
    at: Mapped[float] = mapped_column(Float)  # wall-clock seconds (time.time()) the level was computed at


class Blob(Base):
    __tablename__ = "pfl_blobs"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[float] = mapped_column(Float, default=now)


class BlobRef(Base):
    """Who may read a blob: its federation; ``uploader`` is the device that sent it ('' for the server)."""

    __tablename__ = "pfl_blob_refs"

    digest: Mapped[str] = mapped_column(ForeignKey("pfl_blobs.digest"), primary_key=True)
    federation: Mapped[str] = mapped_column(ForeignKey("pfl_federations.id"), primary_key=True)
    uploader: Mapped[str] = mapped_column(String(64), primary_key=True)


def inputs_digest(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 of the sorted ``device:digest`` lines of a round's updates: what a round's close records of the
    updates it took (``Round.inputs_digest``), recomputable from the update rows."""
    return hashlib.sha256("\n".join(sorted(f"{dev}:{digest}" for dev, digest in pairs)).encode()).hexdigest()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")  # readers don't block the writer
            cur.execute("PRAGMA synchronous=FULL")  # an accepted update survives a power cut
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


def hash_token(token: str) -> str:
    """Tokens are 256-bit random: a plain sha256 is enough (no dictionary to attack)."""
    return hashlib.sha256(token.encode()).hexdigest()


# scrypt (RFC 7914) at n=2^15, r=8, p=1: ~32 MiB and ~0.1 s per guess (OWASP's minimum is n=2^17 with r=8 at
# p=1 for interactive logins; a device enrols once, a guesser also meets the enrolment rate limit)
_SCRYPT = (2**15, 8, 1)
_PBKDF2_MIN_ITERS = 1  # legacy hashes of schema <= 3 (20k iterations) still verify; new ones are scrypt


def hash_secret(secret: str) -> str:
    """Enrol secrets are chosen by people: salted scrypt."""
    n, r, p = _SCRYPT
    salt = os.urandom(16)
    dk = hashlib.scrypt(secret.encode(), salt=salt, n=n, r=r, p=p, maxmem=64 * 1024 * 1024, dklen=32)
    return f"scrypt${n}${r}${p}${salt.hex()}${dk.hex()}"


def verify_secret(secret: str, stored: str) -> bool:
    parts = stored.split("$")
    try:
        if parts[0] == "scrypt" and len(parts) == 6:
            n, r, p = (int(x) for x in parts[1:4])
            if not (2 <= n <= 2**20 and 1 <= r <= 32 and 1 <= p <= 16):
                return False
            dk = hashlib.scrypt(secret.encode(), salt=bytes.fromhex(parts[4]), n=n, r=r, p=p,
                                maxmem=256 * 1024 * 1024, dklen=32)
            return hmac.compare_digest(dk.hex(), parts[5])
        if parts[0] == "pbkdf2-sha256" and len(parts) == 4:
            iters = int(parts[1])
            if not _PBKDF2_MIN_ITERS <= iters <= 10_000_000:
                return False
            dk = hashlib.pbkdf2_hmac("sha256", secret.encode(), bytes.fromhex(parts[2]), iters)
            return hmac.compare_digest(dk.hex(), parts[3])
    except ValueError:
        return False
    return False
