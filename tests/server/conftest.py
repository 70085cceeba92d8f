"""Fixtures of the server tests: real brokers (a private Mosquitto, else the embedded one) and real databases
(SQLite in a temp dir; PostgreSQL in a fresh schema of database ``test`` when 127.0.0.1:5432 answers)."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `server` may be newer than the editable install's package list
    sys.path.insert(0, str(ROOT))

from server.broker import EmbeddedBroker, listening  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
PG_HOST, PG_PORT = "127.0.0.1", 5432


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Mosquitto on a free port (the embedded broker when the binary is missing)."""
    if MOSQUITTO is None:
        with EmbeddedBroker() as b:
            yield b.url
        return
    from mosquitto_kit import mosquitto  # beside this file

    with mosquitto(tmp_path_factory.mktemp("mosquitto")) as url:
        yield url


def _pg_user() -> str | None:
    import psycopg

    for user in ("postgres", "root", os.environ.get("USER", "")):
        if not user:
            continue
        try:
            with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname="test", user=user, connect_timeout=3):
                return user
        except psycopg.Error:
            continue
    return None


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    if not listening(PG_PORT, PG_HOST):
        pytest.skip(f"PostgreSQL does not answer on {PG_HOST}:{PG_PORT}")
    import psycopg

    user = _pg_user()
    if user is None:
        pytest.skip("PostgreSQL answers but neither user postgres nor root may connect to database 'test'")
    schema = f"pfl_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname="test", user=user, autocommit=True) as c:
        c.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"postgresql://{user}@{PG_HOST}:{PG_PORT}/test?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname="test", user=user, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("pg_url"))
