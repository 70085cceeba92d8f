"""What the benchmarks record of the machine they ran on (one definition for every bench script)."""

from __future__ import annotations

import platform

__all__ = ["cpu_model"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the architecture where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.machine())
    except OSError:
        return platform.machine()
