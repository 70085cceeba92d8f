"""What this device is (``pfl_edge.protocol.Platform``), said at enrolment: its architecture, OS, Python, training
runtime and thread count, so that an operator sees the machine beside the profile it declared."""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata

from pfl_edge.protocol import Platform

__all__ = ["describe"]

def _label(text: str, limit: int = 64) -> str:
    """``text`` as the protocol's printable label: control and non-ASCII characters replaced, cut to ``limit``."""
    return re.sub(r"[^\x20-\x7e]", "?", text).strip()[:limit] or "unknown"


def describe(backend: str, threads: int) -> Platform:
    """This machine, training with ``backend`` (a training backend's name, its runtime's package) on
    ``threads`` threads."""
    try:
        version = metadata.version(backend)
    except metadata.PackageNotFoundError:
        version = "?"
    machine = re.sub(r"[^A-Za-z0-9_.+-]", "", platform.machine())[:32] or "unknown"
    return Platform(machine=machine, os=_label(f"{platform.system()} {platform.release()}"),
                    language=_label(f"python {platform.python_version()}"),
                    runtime=_label(f"{backend} {version}"), threads=max(1, min(1024, threads)),
                    cpus=min(4096, os.cpu_count() or 1))
