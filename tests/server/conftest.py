"""Fixtures of the server tests: real brokers (a private Mosquitto, else the embedded one) and real databases
(SQLite in a temp dir; PostgreSQL in a fresh schema of database ``test`` when 127.0.0.1:5432 answers)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `server` may be newer than the editable install's package list
    sys.path.insert(0, str(ROOT))

from pgkit import schema_or_skip  # noqa: E402  (tests/, on the path as the root conftest's folder)

from server.broker import EmbeddedBroker  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)


@pytest.fixture(scope="session")
def broker_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private Mosquitto on a free port (the embedded broker when the binary is missing)."""
    if MOSQUITTO is None:
        with EmbeddedBroker() as b:
            yield b.url
        return
    from mosquitto_kit import mosquitto  # tests/, on the path as the root conftest's folder

    with mosquitto(tmp_path_factory.mktemp("mosquitto")) as url:
        yield url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    with schema_or_skip("pfl_test") as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state.db'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def mixing() -> Iterator[str]:
    """The toy mixing algorithm's name, registered for the test (``server_testkit.mixing_algorithm``)."""
    from server_testkit import mixing_algorithm

    with mixing_algorithm() as name:
        yield name
