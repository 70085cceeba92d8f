"""Plain-text tables for the terminal: one formatter for the simulator, the demo, ``check`` and ``profile``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Sequence[str]], *, right: bool = False, rule: bool = False) -> str:
    """Columns aligned to their widest cell; ``rule`` draws a line under the first row (the header)."""
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if right else c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
