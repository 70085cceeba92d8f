"""Fixtures of the server tests: real brokers (a private Mosquitto, else the embedded one) and real databases
(SQLite in a temp dir; PostgreSQL in a fresh schema of database ``test`` when 127.0.0.1:5432 answers)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `server` may be newer than the editable install's package list
    sys.path.insert(0, str(ROOT))

from server.broker import EmbeddedBroker, free_port  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
PG_HOST, PG_PORT = "127.0.0.1", 5432


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Mosquitto on a free port (the embedded broker when the binary is missing)."""
    if MOSQUITTO is None:
        with EmbeddedBroker() as b:
            yield b.url
        return
    port = free_port()
    conf = tmp_path_factory.mktemp("mosquitto") / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _answers("127.0.0.1", port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mosquitto did not start on port {port}")
            time.sleep(0.05)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


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
    if not _answers(PG_HOST, PG_PORT):
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
