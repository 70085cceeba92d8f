"""Exceptions: user errors (bad input, a name that doesn't exist) apart from internal ones (a broken invariant)."""

from __future__ import annotations

__all__ = ["CodecError", "ConfigError", "DataError", "DivergedError", "InternalError", "PflEdgeError",
           "UnknownNameError"]


class PflEdgeError(Exception):
    """Base of every error pfl-edge raises on purpose. ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(PflEdgeError, ValueError):
    """A configuration value is invalid: the message names the field and what is allowed."""

    exit_code = 2


class UnknownNameError(ConfigError, KeyError):
    """A registry lookup failed; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str]) -> None:
        self.kind, self.name, self.valid = kind, name, valid
        super().__init__(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid) or '(none)'}")

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0])


class DataError(PflEdgeError):
    """A data set is missing, unreadable or not in the expected format."""

    exit_code = 3


class CodecError(PflEdgeError, ValueError):
    """A payload could not be encoded or was refused on decoding (truncated, corrupt, wrong version, names or
    shapes that don't match, NaN/Inf, over the size limit). Nothing was changed."""

    exit_code = 4


class DivergedError(PflEdgeError, ValueError):
    """Training produced NaN or Inf (a learning rate too high, or a start a hostile peer pushed off): the round's
    result is unusable. A device keeps its last good model and sits the round out; the simulator stops."""

    exit_code = 5


class InternalError(PflEdgeError, RuntimeError):
    """An invariant of pfl-edge itself was broken: a bug, please report it."""

    exit_code = 70
