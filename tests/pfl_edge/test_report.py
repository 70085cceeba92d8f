"""``pfl-edge report``: the summary's numbers against a hand computation, a real simulator run reported end to end
(PNGs that decode, an HTML page with nothing external), a live federation over HTTP, and bad inputs refused with
a clear message and a non-zero exit."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from pfl_edge.cli import main
from pfl_edge.errors import ConfigError, DataError
from pfl_edge.report import from_server, load_runs, parse_json, read_json, summarise

PLOTS = ("accuracy", "traffic", "rounds", "profiles")


def _dev(acc: float | None, up: int, down: int, step: float | None) -> dict[str, Any]:
    # the server's /metrics shape of one device in one round
    return {"accuracy": acc, "loss": 1.0, "n_test": 100, "bytes_up": up, "bytes_down": down, "step_ms": step,
            "train_s": 0.5}


def _metrics() -> dict[str, Any]:
    """Three devices, three rounds: B misses round 2 (which its deadline closed, 2 of 3 updates); round 3 is
    still collecting and C has not reported it."""
    return {"federation": "demo", "rounds": [
        {"round": 1, "state": "published", "updates": 3, "active": 3, "mean_accuracy": 0.5, "wall_s": 10.0,
         "devices": {"dev-a": _dev(0.2, 100, 200, 10.0), "dev-b": _dev(0.4, 100, 200, 20.0),
                     "dev-c": _dev(0.9, 50, 80, 4.0)}},
        {"round": 2, "state": "published", "updates": 2, "active": 3, "mean_accuracy": 0.6, "wall_s": 600.0,
         "devices": {"dev-a": _dev(0.5, 100, 200, 12.0), "dev-c": _dev(0.7, 50, 80, 6.0)}},
        {"round": 3, "state": "collecting", "updates": 1, "active": 3, "mean_accuracy": 0.7, "wall_s": None,
         "devices": {"dev-a": _dev(0.6, 100, 200, 14.0), "dev-b": _dev(0.8, 100, 200, None)}},
    ]}


def _devices() -> list[dict[str, Any]]:
    def d(i: int, dev: str, profile: str, density: float, kp: int, up: int) -> dict[str, Any]:
        return {"device_id": dev, "name": f"device-{i:02d}", "profile": profile, "index": i, "density": density,
                "kp": kp, "online": False, "last_seen": 1.0, "joined_round": 0, "last_round": 3, "bytes_up": up,
                "bytes_down": 2 * up}
    return [d(0, "dev-a", "phone-low", 0.2, 2, 300), d(1, "dev-b", "phone-low", 0.2, 2, 200),
            d(2, "dev-c", "phone-high", 1.0, 1, 100)]


@pytest.fixture
def demo_dir(tmp_path: Path) -> Path:
    """A run folder as ``pfl-edge demo`` writes it (its metrics.json, devices.json and summary.json shapes)."""
    run = tmp_path / "demo"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(_metrics(), indent=1))
    (run / "devices.json").write_text(json.dumps(_devices(), indent=1))
    cfg = {"devices": 3, "rounds": 3, "algorithm": "fedper", "fleet": "mixed", "dataset": "fashion-mnist",
           "partition": "pathological:2", "kp": 2, "density": 0.5, "extra": {}}
    (run / "summary.json").write_text(json.dumps({"config": cfg, "finished": False, "wall_s": 620.0,
                                                  "final_mean_acc": 0.7, "rounds": [], "devices": _devices()}))
    return run


def test_summary_matches_a_hand_computation() -> None:
    s = summarise(from_server({"id": "f", "config": {"algorithm": "fedper", "rounds": 3}, "quorum": 1.0},
                              _metrics(), _devices(), source="live"))
    r1, r2, r3 = s["rounds"]
    # round 1: accuracies .2 .4 .9; round 2: .5 .7; round 3: .6 .8 (by hand)
    assert r1["accuracy"] == pytest.approx({"min": 0.2, "median": 0.4, "mean": 0.5, "max": 0.9})
    assert r2["accuracy"] == pytest.approx({"min": 0.5, "median": 0.6, "mean": 0.6, "max": 0.7})
    assert r3["accuracy"] == pytest.approx({"min": 0.6, "median": 0.7, "mean": 0.7, "max": 0.8})
    assert [(r["bytes_up"], r["bytes_down"]) for r in s["rounds"]] == [(250, 480), (150, 280), (200, 400)]
    assert [r["reporting"] for r in s["rounds"]] == [3, 2, 2]
    # quorum 1.0: round 2 closed with 2 of 3; round 3 has not closed, so it is neither short nor complete
    assert [r["short_of_quorum"] for r in s["rounds"]] == [False, True, None]
    fin = s["final"]
    assert fin["round"] == 3 and fin["devices_reporting"] == 2 and fin["accuracy"]["mean"] == pytest.approx(0.7)
    assert (fin["bytes_up"], fin["bytes_down"]) == (600, 1160)
    assert (fin["server_bytes_up"], fin["server_bytes_down"]) == (600, 1200)
    assert fin["rounds_short_of_quorum"] == [2] and fin["round_wall_s"] == pytest.approx(610.0)
    a, b, c = s["devices"]
    assert (a["final_round"], a["final_accuracy"], a["step_ms"]) == (3, 0.6, pytest.approx(12.0))
    assert (b["final_round"], b["final_accuracy"], b["step_ms"]) == (3, 0.8, pytest.approx(20.0))
    assert (c["final_round"], c["final_accuracy"], c["step_ms"]) == (2, 0.7, pytest.approx(5.0))
    assert a["accuracy"] == [[1, 0.2], [2, 0.5], [3, 0.6]] and (a["bytes_up"], b["bytes_up"]) == (300, 200)
    high, low = s["profiles"]
    assert (low["profile"], low["count"], low["densities"], low["kps"]) == ("phone-low", 2, [0.2], [2])
    assert low["final_accuracy_mean"] == pytest.approx(0.7) and low["step_ms"] == pytest.approx(16.0)
    assert (low["bytes_up"], low["bytes_down"]) == (500, 1000)
    assert (high["profile"], high["count"], high["final_accuracy_mean"]) == ("phone-high", 1, pytest.approx(0.7))
    # quorum 0.5: ceil(1.5) = 2 updates close a round of 3, so round 2 was not short
    half = summarise(from_server({"id": "f", "quorum": 0.5}, _metrics(), _devices(), source="live"))
    assert [r["short_of_quorum"] for r in half["rounds"]] == [False, False, None]


def test_demo_folder_reported_through_the_cli(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(demo_dir)]) == 0
    out = demo_dir / "report"
    assert str(out / "report.html") in capsys.readouterr().out
    for name in ("report.md", "report.html", "report.json", *(f"{p}.png" for p in PLOTS)):
        assert (out / name).stat().st_size > 0, name
    rep = json.loads((out / "report.json").read_text())
    assert rep["source"] == "demo" and rep["quorum"] == 1.0 and rep["final"]["rounds_short_of_quorum"] == [2]
    md = (out / "report.md").read_text()
    assert "rounds closed short of quorum: 2" in md and "| phone\\-low | 2 | 0.2 | 2 | 0.700 | 16.0 |" not in md
    assert "| phone-low | 2 | 0.2 | 2 | 0.700 | 16.0 | 0.00 | 0.00 |" in md  # 500 bytes: 0.00 MB
    assert "![" in md and "(accuracy.png)" in md


@pytest.fixture(scope="module")
def sim_result(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real (small, synthetic) simulator run, shared by the tests that report it."""
    out = tmp_path_factory.mktemp("sim") / "fedper.json"
    assert main(["simulate", "--algorithm", "fedper", "--dataset", "synthetic", "--clients", "3", "--rounds", "2",
                 "--samples-per-client", "20", "--test-per-client", "20", "--local-epochs", "1", "--workers", "1",
                 "--out", str(out), "--no-progress"]) == 0
    return out


def test_a_real_simulator_run_end_to_end(tmp_path: Path, sim_result: Path) -> None:
    result_file = tmp_path / sim_result.name
    result_file.write_bytes(sim_result.read_bytes())
    result = json.loads(result_file.read_text())
    assert main(["report", str(result_file)]) == 0
    out = tmp_path / "fedper-report"
    rep = json.loads((out / "report.json").read_text())
    # the simulator's own per-round numbers, computed there independently of the report
    for mine, theirs in zip(rep["rounds"], result["rounds"], strict=True):
        assert mine["accuracy"]["mean"] == pytest.approx(theirs["mean_acc"])
        assert mine["accuracy"]["min"] == min(theirs["client_acc"])
        assert (mine["bytes_up"], mine["bytes_down"]) == (theirs["bytes_up"], theirs["bytes_down"])
    assert rep["final"]["accuracy"]["mean"] == pytest.approx(result["final"]["mean_acc"])
    assert [d["final_accuracy"] for d in rep["devices"]] == result["final"]["client_acc"]
    assert rep["profiles"][0]["count"] == 3 and rep["profiles"][0]["kps"] == [result["config"]["kp"]]
    page = (out / "report.html").read_text()
    assert not re.search(r"https?:", page, re.I), "the page refers to something outside itself"
    assert not re.search(r"""(src|href)\s*=\s*['"](?!data:image/png;base64,)""", page)
    inline = re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    assert len(inline) == len(PLOTS)
    for name in PLOTS:
        png = (out / f"{name}.png").read_bytes()
        assert base64.b64encode(png).decode() in inline  # the page holds the very files
        with Image.open(io.BytesIO(png)) as im:
            im.load()
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200


def test_a_folder_of_results_gives_one_report_each(tmp_path: Path, sim_result: Path) -> None:
    sim = tmp_path / "sim" / sim_result.name
    sim.parent.mkdir()
    sim.write_bytes(sim_result.read_bytes())
    (sim.parent / "notes.json").write_text('{"not": "a result"}')  # other JSON in the folder is passed over
    assert [r.name for r in load_runs(sim.parent)] == ["fedper"]
    (sim.parent / "other.json").write_text(sim.read_text())
    assert main(["report", str(sim.parent), "--out", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "fedper" / "report.html").exists() and (tmp_path / "r" / "other" / "report.md").exists()


def test_hostile_names_are_shown_as_text(demo_dir: Path) -> None:
    devs = _devices()
    devs[0]["name"] = "<script>alert(1)</script>|x"
    devs[1]["profile"] = "$broken | `profile`"
    (demo_dir / "devices.json").write_text(json.dumps(devs))
    assert main(["report", str(demo_dir)]) == 0
    page = (demo_dir / "report" / "report.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;|x" in page
    md = (demo_dir / "report" / "report.md").read_text()
    assert "\\<script\\>alert(1)\\</script\\>\\|x" in md
    # every table row keeps its column count (an unescaped | would add one)
    for line in (ln for ln in md.splitlines() if ln.startswith("| device-0") or ln.startswith("| \\<")):
        assert len(re.findall(r"(?<!\\)\|", line)) == 10, line


@pytest.mark.parametrize(("content", "error"), [
    ("{not json", "not valid JSON"),
    ('{"rounds": [{"round": 1, "devices": {"d": {"accuracy": "high"}}}]}', "accuracy: expected a finite number"),
    ('{"rounds": {"round": 1}}', "metrics.rounds: expected a JSON list"),
    ('{"rounds": [{"round": -1}]}', "round: expected a non-negative integer"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),  # nested past the parser's recursion limit
])
def test_bad_metrics_are_refused_with_exit_3(demo_dir: Path, content: str, error: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (demo_dir / "metrics.json").write_text(content)
    assert main(["report", str(demo_dir)]) == DataError.exit_code
    assert error in capsys.readouterr().err
    assert not (demo_dir / "report").exists()


def test_an_oversized_input_is_refused_before_it_is_read(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with (demo_dir / "metrics.json").open("r+b") as f:
        f.truncate(256 * 2**20 + 1)  # sparse: costs no disk and, refused by size, no reading
    assert main(["report", str(demo_dir)]) == 3
    assert "over the 268435456 byte (256 MB) limit" in capsys.readouterr().err
    with pytest.raises(DataError, match="over 10 bytes"):
        parse_json(b'{"a": 12345678}', "x", limit=10)
    with pytest.raises(DataError, match="no such file"):
        read_json(demo_dir / "missing.json")


def test_usage_errors_exit_2(tmp_path: Path, demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == ConfigError.exit_code
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no run" in capsys.readouterr().err
    assert main(["report", str(demo_dir), "--server", "http://127.0.0.1:1"]) == 2
    assert main(["report"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["report", "--server", "http://127.0.0.1:1", "--federation", "f"]) == 2
    assert "needs --server, --federation, --admin-token-file and --out" in capsys.readouterr().err
    assert main(["report", "--server", "ftp://x", "--federation", "f", "--admin-token-file", str(demo_dir /
                 "summary.json"), "--out", str(tmp_path / "o")]) == 2
    assert "http(s)://host" in capsys.readouterr().err


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A server in this process (embedded broker, SQLite) with federation "live": two devices enrolled, each
    having reported round 0's metrics. Yields (url, admin token)."""
    from server.launch import start_background
    from server.settings import Settings

    token = "admin-token-for-the-report-test"
    srv = start_background(Settings(data_dir=tmp_path / "srv", admin_token=token, tick_s=0.05))  # type: ignore[arg-type]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            cfg = {"algorithm": "fedper", "model": "cnn", "dataset": "synthetic", "clients": 2, "rounds": 2}
            r = c.post("/v1/federations", json={"id": "live", "enrol_secret": "secret-123456789", "config": cfg},
                       headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 201, r.text
            for i, (profile, acc) in enumerate([("phone-low", 0.25), ("phone-high", 0.75)]):
                e = c.post("/v1/devices", json={"federation": "live", "enrol_secret": "secret-123456789",
                                                "profile": profile, "name": f"dev{i}"})
                assert e.status_code == 201, e.text
                m = c.post("/v1/rounds/0/metrics", json={"accuracy": acc, "loss": 1.5, "n_test": 10,
                                                         "bytes_down": 1000 * (i + 1)},
                           headers={"Authorization": f"Bearer {e.json()['token']}"})
                assert m.status_code < 300, m.text
        yield srv.url, token
    finally:
        srv.stop()


def test_a_live_federation_over_http(live: tuple[str, str], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    url, token = live
    (tmp_path / "token").write_text(token + "\n")
    out = tmp_path / "live-report"
    args = ["report", "--server", url, "--federation", "live", "--admin-token-file", str(tmp_path / "token"),
            "--out", str(out)]
    assert main(args) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["source"] == "live" and rep["algorithm"] == "fedper" and rep["quorum"] == 1.0
    assert rep["final"]["round"] == 0 and rep["final"]["accuracy"]["mean"] == pytest.approx(0.5)
    assert rep["final"]["bytes_down"] == 3000
    assert sorted((p["profile"], p["count"], p["final_accuracy_mean"]) for p in rep["profiles"]) == [
        ("phone-high", 1, 0.75), ("phone-low", 1, 0.25)]
    assert {d["name"] for d in rep["devices"]} == {"dev0", "dev1"}
    # what it fetched is saved beside the report, and reports again offline to the same numbers
    assert main(["report", str(out)]) == 0
    assert json.loads((out / "report" / "report.json").read_text())["final"] == rep["final"]
    capsys.readouterr()
    (tmp_path / "token").write_text("wrong-token\n")
    assert main(args) == 2
    assert "the server answered 401" in capsys.readouterr().err
    assert main([*args[:4], "no-such-fed", *args[5:]]) == 2
    assert "answered 40" in capsys.readouterr().err


def test_a_private_run_reports_the_epsilon_it_spent(tmp_path: Path) -> None:
    """A simulated run with a privacy table: report.json and the page give the simulator's own final epsilon;
    a run without one says nothing of privacy."""
    out = tmp_path / "dp.json"
    assert main(["simulate", "--algorithm", "fedper", "--dataset", "synthetic", "--clients", "4", "--rounds", "2",
                 "--samples-per-client", "20", "--test-per-client", "20", "--local-epochs", "1", "--workers", "1",
                 "--privacy", "clip=0.5", "--privacy", "noise_multiplier=0.8", "--privacy", "delta=0.001",
                 "--out", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert main(["report", str(out)]) == 0
    rep = json.loads((tmp_path / "dp-report" / "report.json").read_text())
    assert rep["privacy"]["rounds"] == 2 and rep["privacy"]["epsilon"] == pytest.approx(result["privacy"]["epsilon"])
    assert rep["privacy"]["noise_multiplier"] == 0.8 and rep["privacy"]["delta"] == 0.001
    assert "differential privacy (central): epsilon" in (tmp_path / "dp-report" / "report.md").read_text()
