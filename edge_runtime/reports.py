"""What a device reports of a round it evaluated: its metrics, checked finite, and posted to the server."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pfl_edge.algorithms import Metrics
from pfl_edge.protocol import API_PREFIX, MetricsReport

from .http import Http, ServerError
from .state import Progress, RoundStats
from .tasks import finite_metric

__all__ = ["peak_rss_mb", "post_metrics", "usable_metrics"]

log = logging.getLogger("pfl_edge.client")

Event = Callable[[str, dict[str, Any]], None]


def usable_metrics(ms: list[Metrics], n_test: int, on_event: Event) -> list[dict[str, Any]]:
    """Metrics to report: a NaN or Inf (e.g. a loss on a model gone wrong) is logged, never sent."""
    out = [{"round": m.round, "accuracy": m.accuracy, "loss": m.loss, "n_test": n_test} for m in ms]
    for m in (m for m in out if not finite_metric(m)):
        log.error("round %s: not reporting non-finite metrics %s", m["round"], m)
        on_event("bad_metrics", m)
    return [m for m in out if finite_metric(m)]


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: VmHWM where /proc has it (it belongs to the process image, where
    ru_maxrss survives execve and can report the parent's), else ru_maxrss (KiB on Linux and most systems)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def post_metrics(http: Http, m: dict[str, Any], prog: Progress, on_event: Event, *, costs: bool = False) -> None:
    """One round's metrics with what the device measured of it (``costs``: its round's wall and transfer time and
    its peak memory too, for a server answering it in protocol 3 or later, which takes them); a 409 (a round the
    server takes no metrics of from this device) is logged, never fatal."""
    t = int(m["round"])
    st = prog.stats.get(str(t), RoundStats())
    more = dict(round_s=st.round_s, transfer_s=st.transfer_s, peak_rss_mb=peak_rss_mb()) if costs else {}
    report = MetricsReport(accuracy=m["accuracy"], loss=m["loss"], n_test=m["n_test"], bytes_up=st.bytes_up,
                           bytes_down=st.bytes_down, step_ms=st.step_ms, train_s=st.train_s, dropped=m.get("dropped"),
                           **more)
    try:
        http.call("POST", f"{API_PREFIX}/rounds/{t}/metrics", json_body=report.model_dump(exclude_none=True))
        on_event("metrics", {"round": t, **report.model_dump()})
    except ServerError as e:
        if e.status != 409:
            raise
        log.warning("metrics of round %d not taken: %s", t, e)
