"""What several subcommands share."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def _check_writable(out: Path, save_dir: Path | None) -> None:
    """Fail before a long run, not after it, when its results could not be written."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as {out / 'result.json'}")
    if save_dir is not None and save_dir.exists() and not save_dir.is_dir():
        raise ConfigError(f"--save-dir {save_dir} exists and is not a folder")
    for d in (out.parent, save_dir):
        if d is None:
            continue
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create {d}: {e.strerror}") from None
        if not os.access(d, os.W_OK):
            raise ConfigError(f"{d} is not writable")


