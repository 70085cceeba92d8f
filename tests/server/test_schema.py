"""The versioned schema, on SQLite and on PostgreSQL: a fresh database gets the current version; a database
written before a column existed (and before versioning) is upgraded in place and keeps its rows, and the
server runs on it; a database of a newer or unknown version is refused with what was found and expected."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, SECRET, bearer, create
from sqlalchemy import Engine, inspect, text

from pfl_edge.errors import ConfigError
from server.app import create_app
from server.db import make_engine
from server.migrations import SCHEMA_VERSION, STEPS, make_sessionmaker, migrate, schema_version
from server.settings import Settings

ADMIN = "admin-token-for-schema-tests"
NONCE = "ab" * 16


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    e = make_engine(Settings(database_url=database_url).resolved_database_url)
    yield e
    e.dispose()


def columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


def set_version(engine: Engine, version: int) -> None:
    with engine.begin() as c:
        c.execute(text("UPDATE pfl_schema SET version = :v"), {"v": version})


def to_first_release(engine: Engine) -> None:
    """What the first release's server left: no version table, no min_devices, no enrol_nonce."""
    with engine.begin() as c:
        c.execute(text("DROP TABLE pfl_schema"))
        c.execute(text("DROP INDEX IF EXISTS ix_pfl_devices_enrol_nonce"))
        c.execute(text("ALTER TABLE pfl_devices DROP COLUMN enrol_nonce"))
        c.execute(text("ALTER TABLE pfl_federations DROP COLUMN min_devices"))


def test_steps_are_numbered_in_order() -> None:
    assert [s.version for s in STEPS] == list(range(2, SCHEMA_VERSION + 1))


def test_a_fresh_database_gets_the_current_version(engine: Engine) -> None:
    assert schema_version(engine) is None
    assert migrate(engine) is None
    assert schema_version(engine) == SCHEMA_VERSION
    assert {"min_devices"} <= columns(engine, "pfl_federations") and "enrol_nonce" in columns(engine, "pfl_devices")
    assert migrate(engine) == SCHEMA_VERSION  # starting again changes nothing
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM pfl_schema")).scalar() == 1


def test_an_old_database_is_upgraded_and_keeps_its_rows(tmp_path: Path, database_url: str, broker_url: str,
                                                        engine: Engine) -> None:
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url, broker_url=broker_url,
                        admin_token=ADMIN, tick_s=0.05)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        create(c, ADMIN, "old", FEDPER)
        assert c.post("/v1/devices", json={"federation": "old", "enrol_secret": SECRET,
                                           "profile": "phone-mid"}).status_code == 201
    to_first_release(engine)
    assert "enrol_nonce" not in columns(engine, "pfl_devices")
    assert schema_version(engine) == 1

    with TestClient(create_app(settings)) as c:  # the server upgrades it as it starts
        assert schema_version(engine) == SCHEMA_VERSION
        assert "enrol_nonce" in columns(engine, "pfl_devices")
        assert "min_devices" in columns(engine, "pfl_federations")
        info = c.get("/v1/federations/old", headers=bearer(ADMIN)).json()
        assert (info["id"], info["devices"], info["round"]) == ("old", 1, 0)
        # the added column works: enrolment with a nonce is idempotent on the upgraded database
        body = {"federation": "old", "enrol_secret": SECRET, "profile": "phone-mid", "nonce": NONCE}
        first, again = c.post("/v1/devices", json=body), c.post("/v1/devices", json=body)
        assert first.status_code == again.status_code == 201
        assert first.json()["device_id"] == again.json()["device_id"]
        assert len(c.get("/v1/federations/old/devices", headers=bearer(ADMIN)).json()) == 2


def test_a_partly_upgraded_database_gets_only_what_it_lacks(engine: Engine) -> None:
    migrate(engine)
    with engine.begin() as c:  # version 2: min_devices is there, enrol_nonce is not yet
        c.execute(text("DROP INDEX IF EXISTS ix_pfl_devices_enrol_nonce"))
        c.execute(text("ALTER TABLE pfl_devices DROP COLUMN enrol_nonce"))
    set_version(engine, 2)
    assert migrate(engine) == 2
    assert schema_version(engine) == SCHEMA_VERSION and "enrol_nonce" in columns(engine, "pfl_devices")
    assert "ix_pfl_devices_enrol_nonce" in {i["name"] for i in inspect(engine).get_indexes("pfl_devices")}


def test_a_newer_database_is_refused(engine: Engine) -> None:
    migrate(engine)
    set_version(engine, SCHEMA_VERSION + 1)
    with pytest.raises(ConfigError, match=f"schema version {SCHEMA_VERSION + 1}, newer than this server's version "
                                          f"{SCHEMA_VERSION}") as e:
        make_sessionmaker(engine)
    assert "PFL_DATABASE_URL" in str(e.value)
    assert schema_version(engine) == SCHEMA_VERSION + 1  # refused: nothing changed


def test_the_server_does_not_start_on_a_newer_database(tmp_path: Path, database_url: str, broker_url: str,
                                                       engine: Engine) -> None:
    migrate(engine)
    set_version(engine, SCHEMA_VERSION + 7)
    settings = Settings(data_dir=tmp_path / "data", database_url=database_url, broker_url=broker_url,
                        admin_token=ADMIN)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"version {SCHEMA_VERSION + 7}"), TestClient(create_app(settings)):
        pass


def test_an_unknown_version_is_refused(engine: Engine) -> None:
    migrate(engine)
    set_version(engine, 0)
    with pytest.raises(ConfigError, match=f"unknown schema version 0; this server reads versions 1 to "
                                          f"{SCHEMA_VERSION}"):
        migrate(engine)
    with engine.begin() as c:
        c.execute(text("DELETE FROM pfl_schema"))
    with pytest.raises(ConfigError, match="without a version"):
        migrate(engine)
