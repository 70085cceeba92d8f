"""A fresh PostgreSQL schema for one test: the tests' one way to use the machine's PostgreSQL (127.0.0.1:5432,
database ``test``), whatever they run (the app in process, a server process, the container's command)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PG_HOST", "PG_PORT", "fresh_schema", "pg_user", "schema_or_skip"]

PG_HOST, PG_PORT = "127.0.0.1", 5432


def _answers() -> bool:
    try:
        socket.create_connection((PG_HOST, PG_PORT), timeout=0.5).close()
        return True
    except OSError:
        return False


def pg_user() -> str | None:
    """A user that may connect to database ``test`` (postgres, root or $USER), or None."""
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


@contextmanager
def fresh_schema(prefix: str) -> Iterator[str | None]:
    """``postgresql://USER@127.0.0.1:5432/test?options=-csearch_path%3D<schema>`` for a schema made for the
    caller and dropped afterwards; None where no PostgreSQL answers or no user may connect (the caller skips)."""
    if not _answers():
        yield None
        return
    import psycopg

    user = pg_user()
    if user is None:
        yield None
        return
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname="test", user=user, autocommit=True) as c:
        c.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"postgresql://{user}@{PG_HOST}:{PG_PORT}/test?options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(host=PG_HOST, port=PG_PORT, dbname="test", user=user, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{schema}" CASCADE')


@contextmanager
def schema_or_skip(prefix: str) -> Iterator[str]:
    """:func:`fresh_schema`'s URL, or the calling test skipped (saying why) where there is no PostgreSQL."""
    import pytest

    with fresh_schema(prefix) as url:
        if url is None:
            pytest.skip(f"PostgreSQL does not answer on {PG_HOST}:{PG_PORT}, or no user may connect to 'test'")
        yield url
