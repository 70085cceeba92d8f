"""``pfl-edge demo`` (the README's first command) end to end, small: it says where its dashboard is while it runs,
finishes, and leaves its run folder with the report a person opens first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_runtime.fleet import DemoConfig, run_demo


def test_the_demo_shows_its_dashboard_and_ends_with_a_report(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DemoConfig(devices=2, rounds=2, dataset="synthetic", samples_per_client=48, batch_size=16, live=False,
                     out=str(tmp_path / "demo"), timeout_s=240)
    summary = run_demo(cfg)
    out = capsys.readouterr().out
    assert summary["finished"], out
    line = next(x for x in out.splitlines() if x.startswith("dashboard: "))
    url = line.split()[1]
    assert "/dashboard#token=" in url and url.split("#token=")[1], line
    report = tmp_path / "demo" / "report"
    numbers = json.loads((report / "report.json").read_text())
    # the report is of this run: its rounds and its final accuracy are the demo's own
    assert numbers["final"]["rounds_recorded"] == 2
    assert numbers["final"]["accuracy"]["mean"] == pytest.approx(summary["final_mean_acc"])
    html = (report / "report.html").read_text()
    assert "<img" in html and "http://" not in html and "https://" not in html
    assert "report/report.html" in out
