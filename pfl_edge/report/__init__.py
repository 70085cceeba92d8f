"""Reports of a federation run: ``pfl-edge report``. Inputs (a demo run folder, a simulator result, a live
server's answers) become one :class:`Run` each (``load``); ``summarise`` computes the numbers; ``write_report``
writes report.json, report.md, report.html (self-contained) and the PNG plots."""

from .load import (
    MAX_INPUT_BYTES,
    DeviceInfo,
    DeviceRound,
    RoundRecord,
    Run,
    from_server,
    from_simulation,
    load_runs,
    parse_json,
    read_json,
)
from .plots import write_plots
from .render import render_html, render_markdown, write_report
from .summary import short_of_quorum, spread, summarise

__all__ = [
    "MAX_INPUT_BYTES",
    "DeviceInfo",
    "DeviceRound",
    "RoundRecord",
    "Run",
    "from_server",
    "from_simulation",
    "load_runs",
    "parse_json",
    "read_json",
    "render_html",
    "render_markdown",
    "short_of_quorum",
    "spread",
    "summarise",
    "write_plots",
    "write_report",
]
