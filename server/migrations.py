"""The database schema's version, and the small steps that upgrade an older database to it.

Table ``pfl_schema`` holds the version. On start (:func:`migrate`): an empty database gets every table and the
current version; a database of an older version gets each later step, in order, in one transaction; a newer
or unknown version is refused with a ConfigError saying what was found and what to do (this server cannot know
what a newer one changed). A database from before versioning counts as version 1 (the first release's tables):
every step checks what is there before it adds anything, so it upgrades whichever release wrote it.

Adding a column later: add it to the model in ``server.db``, then a :class:`Step` here that adds it to an
existing table (``ALTER TABLE ... ADD COLUMN``, nullable or with a default), and bump :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, inspect, select, text, update
from sqlalchemy.orm import sessionmaker

from pfl_edge.errors import ConfigError

from .db import Base, SchemaVersion, now

__all__ = ["SCHEMA_VERSION", "STEPS", "Step", "make_sessionmaker", "migrate", "schema_version"]

log = logging.getLogger(__name__)

_PG_LOCK = 0x70666C5F736368  # pg_advisory_xact_lock key: servers starting together on one database take turns


@dataclass(frozen=True)
class Step:
    """Upgrades a database of version ``version - 1`` to ``version``; idempotent (it checks before it adds)."""

    version: int
    what: str
    apply: Callable[[Connection], None]


def _columns(conn: Connection, table: str) -> set[str] | None:
    """The columns of ``table``, None if there is no such table."""
    insp = inspect(conn)
    if not insp.has_table(table):
        return None
    return {c["name"] for c in insp.get_columns(table)}


def _add_column(table: str, column: str, ddl_type: str) -> Callable[[Connection], None]:
    def apply(conn: Connection) -> None:
        have = _columns(conn, table)
        if have is not None and column not in have:  # a missing table is created whole afterwards
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {ddl_type}"))

    return apply


def _enrol_nonce(conn: Connection) -> None:
    _add_column("pfl_devices", "enrol_nonce", "VARCHAR(32)")(conn)
    if _columns(conn, "pfl_devices") is not None:
        conn.execute(text("CREATE INDEX IF NOT EXISTS ix_pfl_devices_enrol_nonce ON pfl_devices (enrol_nonce)"))


def _trust(conn: Connection) -> None:
    for column, ddl in (("mqtt_hash", "VARCHAR(200)"), ("revoked_at", "FLOAT"), ("token_expires", "FLOAT"),
                        ("declared_samples", "INTEGER"), ("uploaded_bytes", "BIGINT NOT NULL DEFAULT 0")):
        _add_column("pfl_devices", column, ddl)(conn)
    _add_column("pfl_federations", "aggregation", "JSON")(conn)
    _add_column("pfl_rounds", "inputs", "INTEGER")(conn)
    _add_column("pfl_rounds", "inputs_digest", "VARCHAR(64)")(conn)
    _add_column("pfl_updates", "delta_norm", "FLOAT")(conn)


def _refusals(conn: Connection) -> None:
    _add_column("pfl_devices", "refused_updates", "INTEGER NOT NULL DEFAULT 0")(conn)
    _add_column("pfl_metrics", "dropped", "INTEGER")(conn)


def _secagg(conn: Connection) -> None:
    _add_column("pfl_rounds", "secagg_step", "VARCHAR(16)")(conn)
    _add_column("pfl_rounds", "step_deadline", "FLOAT")(conn)


def _device_keys(conn: Connection) -> None:
    _add_column("pfl_devices", "public_key", "VARCHAR(64)")(conn)
    _add_column("pfl_devices", "key_counter", "BIGINT")(conn)
    _add_column("pfl_devices", "mqtt_client", "VARCHAR(40)")(conn)
    _add_column("pfl_devices", "protocol", "INTEGER")(conn)


def _device_costs(conn: Connection) -> None:
    _add_column("pfl_metrics", "round_s", "FLOAT")(conn)
    _add_column("pfl_metrics", "transfer_s", "FLOAT")(conn)
    _add_column("pfl_metrics", "peak_rss_mb", "FLOAT")(conn)


#: every upgrade since version 1, in order; the types are frozen here (the models may change later)
STEPS: tuple[Step, ...] = (
    Step(2, "pfl_federations.min_devices (late joiners)", _add_column("pfl_federations", "min_devices", "INTEGER")),
    Step(3, "pfl_devices.enrol_nonce and its index (idempotent enrolment)", _enrol_nonce),
    Step(4, "per-device MQTT credentials, revocation, token expiry, declared samples, upload quota; "
            "federations' aggregation rule, updates' norms", _trust),
    Step(5, "pfl_rate_buckets: enrolment rate limits that server replicas share (a new table: created whole)",
         lambda conn: None),
    Step(6, "pfl_partial_sums: replicas' running sums of a round's updates (a new table: created whole)",
         lambda conn: None),
    Step(7, "pfl_federations.mqtt_key: a retried enrolment's MQTT password the same on every replica",
         _add_column("pfl_federations", "mqtt_key", "VARCHAR(64)")),
    Step(8, "pfl_devices.refused_updates and pfl_metrics.dropped: a device's refused uploads and the neighbours "
            "it left out", _refusals),
    Step(9, "pfl_devices.token_origin: a device's token chain has an absolute lifetime (rows without one start "
            "theirs at their next rotation)", _add_column("pfl_devices", "token_origin", "FLOAT")),
    Step(10, "pfl_federations.noise_key: the secret key of a private federation's aggregate noise",
         _add_column("pfl_federations", "noise_key", "VARCHAR(64)")),
    Step(11, "secure aggregation: pfl_rounds.secagg_step and step_deadline, and pfl_secagg (created whole) for "
             "the devices' messages of its steps", _secagg),
    Step(12, "pfl_devices.platform: what a device says it is (architecture, OS, runtime, threads) at enrolment",
         _add_column("pfl_devices", "platform", "JSON")),
    # a federation made before 13 keeps the public draw its devices compute (a draw cannot change under rounds
    # already drawn): it has no key, and its server reports no epsilon for its sampled rounds
    Step(13, "pfl_federations.sampling_key: the secret key of a private federation's draw",
         _add_column("pfl_federations", "sampling_key", "VARCHAR(64)")),
    Step(14, "pfl_rounds.released: the updates in what a round published (a distributed-mode round's achieved "
             "epsilon is figured from it)", _add_column("pfl_rounds", "released", "INTEGER")),
    Step(15, "pfl_devices.public_key, key_counter, mqtt_client and protocol: a device's own key, its unguessable "
             "MQTT client id and the protocol version it speaks", _device_keys),
    Step(16, "pfl_metrics.round_s, transfer_s and peak_rss_mb: what a round cost the device (protocol 3)",
         _device_costs),
)
SCHEMA_VERSION = STEPS[-1].version


def _found_version(conn: Connection) -> int | None:
    """The database's version: None if it holds no table of ours, 1 if it predates versioning."""
    tables = set(inspect(conn).get_table_names())
    if SchemaVersion.__tablename__ not in tables:
        return 1 if any(t.startswith("pfl_") for t in tables) else None
    found = conn.execute(select(SchemaVersion.version).where(SchemaVersion.id == 1)).scalar()
    if found is None:
        raise ConfigError(f"the database has a {SchemaVersion.__tablename__} table without a version: it was not "
                          f"written by pfl-edge (this server's schema is version {SCHEMA_VERSION}); point "
                          "PFL_DATABASE_URL at another database or schema")
    return int(found)


def _refuse(found: int) -> ConfigError:
    if found > SCHEMA_VERSION:
        return ConfigError(f"the database holds schema version {found}, newer than this server's version "
                           f"{SCHEMA_VERSION}: it was written by a newer pfl-edge. Run that version or a later one "
                           "on it, or point PFL_DATABASE_URL at another database (there is no downgrade)")
    return ConfigError(f"the database holds unknown schema version {found}; this server reads versions 1 to "
                       f"{SCHEMA_VERSION}. Point PFL_DATABASE_URL at another database")


def migrate(engine: Engine) -> int | None:
    """Bring the database to :data:`SCHEMA_VERSION` (see the module's docstring); returns the version it held
    before (None: it was empty). ConfigError for a newer or unknown version; nothing is changed then."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK})
        found = _found_version(conn)
        if found is not None and not 1 <= found <= SCHEMA_VERSION:
            raise _refuse(found)
        for step in STEPS:
            if found is not None and step.version > found:
                log.info("database schema: version %d -> %d: %s", step.version - 1, step.version, step.what)
                step.apply(conn)
        Base.metadata.create_all(conn)  # an empty database, or tables added by a later version; never alters one
        if conn.execute(select(SchemaVersion.id).where(SchemaVersion.id == 1)).first() is None:
            conn.execute(insert(SchemaVersion).values(id=1, version=SCHEMA_VERSION, updated_at=now()))
        elif found != SCHEMA_VERSION:
            conn.execute(update(SchemaVersion).where(SchemaVersion.id == 1)
                         .values(version=SCHEMA_VERSION, updated_at=now()))
    return found


def schema_version(engine: Engine) -> int | None:
    """The version the database holds (None: no table of ours; 1: from before versioning)."""
    with engine.connect() as conn:
        return _found_version(conn)


def make_sessionmaker(engine: Engine) -> sessionmaker[Any]:
    """Sessions on ``engine``, once its schema is this server's (created, upgraded, or refused: ConfigError)."""
    migrate(engine)
    return sessionmaker(engine, expire_on_commit=False)
