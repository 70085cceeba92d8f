"""Secrets kept in files: a token or an enrolment secret that should not sit on a command line (where every local
user can read it) nor in an environment a child process inherits. Used by the CLI and the server's settings."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError

__all__ = ["read_secret_file"]


def read_secret_file(path: str | Path) -> str:
    """The secret in ``path`` (its first line, stripped). ConfigError if it is missing or empty."""
    p = Path(path)
    try:
        text = p.read_text().strip().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read the secret file {p}: {e}") from None
    if not text or not text[0].strip():
        raise ConfigError(f"the secret file {p} is empty")
    return text[0].strip()
