"""The operator's dashboard in a real headless browser (Debian's chromium driven by selenium) against a real
server with three device processes running FedPer: the page loads with the token from its URL fragment, lists
the devices with their profiles, follows the rounds as they close, draws its charts, logs no JavaScript error,
and leaves a screenshot in test-artifacts/dashboard.png. The static files' serving (types, CSP, traversal) is
checked without a browser."""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from edge_runtime.fleet import Federation, start_server
from pfl_edge.protocol import API_PREFIX
from pfl_edge.sim import SimConfig
from server.app import create_app
from server.routers.dashboard import CSP
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PROFILES = ["phone-mid", "raspberry-pi-4", "jetson-nano"]
CONFIG: dict[str, Any] = dict(dataset="synthetic", partition="pathological:2", rounds=4, samples_per_client=48,
                              test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=5)
CHARTS = ("chart-acc", "chart-spread", "chart-bytes", "chart-density")
# a canvas with something drawn on it encodes differently from a blank one of the same size
_DRAWN_JS = ("const c = document.getElementById(arguments[0]); const b = document.createElement('canvas');"
             "b.width = c.width; b.height = c.height; return c.toDataURL() !== b.toDataURL();")


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1900", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def _until(cond: Callable[[], Any], timeout: float, what: str, fed: Federation) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        for i, p in enumerate(fed.devices):
            assert p.poll() in (None, 0), f"device {i} exited with {p.returncode}"
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; federation: {fed.info()}")


def _rows(driver: Any, table: str) -> list[dict[str, str]]:
    """The rows of a table as data attributes and cell texts (one call into the page)."""
    rows: list[dict[str, str]] = driver.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)].map((tr) => ({...tr.dataset, "
        "cells: [...tr.cells].map((td) => td.textContent)}));", table)
    return rows


def test_the_dashboard_follows_a_live_federation(tmp_path: Path, browser: Any) -> None:
    cfg = SimConfig(algorithm="fedper", clients=3, kp=2, **CONFIG)
    fed = start_server(tmp_path / "run")
    try:
        fed.create("dash", cfg.to_dict(), deadline_s=120.0)
        for i, p in enumerate(PROFILES):
            fed.start_device(i, p, extra=["--training-backend", "torch"])
        browser.get(f"{fed.url}/dashboard#token={fed.admin_token}")
        assert "#token" not in browser.current_url  # moved to sessionStorage, out of the address and history

        def body(key: str) -> str:
            return str(browser.execute_script("return document.body.dataset[arguments[0]] || ''", key))

        devices = _until(lambda: len(r := _rows(browser, "devices")) == 3 and r, 40, "three devices listed", fed)
        api = fed.get(f"{API_PREFIX}/federations/dash/devices")
        assert {d["deviceId"]: d["profile"] for d in devices} == {d["device_id"]: d["profile"] for d in api}
        assert sorted(d["profile"] for d in devices) == sorted(PROFILES)
        # what each device says it is, beside its profile; a device on this x86_64 machine that declared an arm64
        # board's profile is flagged (its row marked, the flag in the cell's title)
        by_id = {d["device_id"]: d for d in api}
        for row in devices:
            said = by_id[row["deviceId"]]["platform"]
            assert said["machine"] in row["cells"][2] and said["runtime"] in row["cells"][2], row
            assert ("flagged" in row) == bool(by_id[row["deviceId"]]["flags"]), row
        if platform.machine() == "x86_64":  # every profile here is an arm64 board's
            assert all(d["flags"] for d in api)
        first = int(_until(lambda: body("round"), 10, "a round shown", fed))
        _until(lambda: int(body("round") or 0) > max(first, 1), 60, "the round shown to advance", fed)
        _until(lambda: body("state") == "finished", 60, "the federation to finish", fed)
        _until(lambda: all(int(browser.execute_script(
            "return document.getElementById(arguments[0]).dataset.points || 0", c)) > 0 for c in CHARTS), 10,
            "every chart to draw data", fed)
        for c in CHARTS:
            assert browser.execute_script(_DRAWN_JS, c), f"{c} is blank"

        # A device sends its last evaluation after the federation finished, so the API's metrics are final only
        # once every device process has exited; then the page, which keeps polling, must catch up with them.
        _until(lambda: all(p.poll() is not None for p in fed.devices), 60, "every device to exit", fed)
        metrics = fed.get(f"{API_PREFIX}/federations/dash/metrics")["rounds"]
        evaluations = sum(len(r["devices"]) for r in metrics)
        _until(lambda: int(browser.execute_script(
            "return document.getElementById('chart-acc').dataset.points || 0")) == evaluations, 20,
            f"the accuracy chart to show all {evaluations} evaluations", fed)

        # what the page shows is what the API says
        shown = {int(r["round"]): r["cells"] for r in _rows(browser, "rounds")}
        assert set(shown) == {r["round"] for r in metrics if r["round"] > 0} == set(range(1, cfg.rounds + 1))
        for r in metrics:
            if r["round"] > 0:
                assert shown[r["round"]][2] == f"{r['updates']} / {r['active']}"
        assert evaluations == len(PROFILES) * cfg.rounds
        # per device class, the step time and peak memory its devices reported (protocol 3), as the API says
        classes = {c["profile"]: c for c in fed.get(f"{API_PREFIX}/federations/dash/classes")}
        _until(lambda: len(_rows(browser, "classes")) == len(classes), 20, "every class listed", fed)
        for row in _rows(browser, "classes"):
            c = classes[row["profile"]]
            assert c["step_ms"]["n"] > 0 and c["peak_rss_mb"]["n"] > 0, c  # from the devices themselves
            for cell, figure, digits in ((3, "step_ms", 1), (6, "peak_rss_mb", 0)):  # rounded as the page shows
                shown_pair = [float(v) for v in row["cells"][cell].split(" / ")]
                want = [c[figure]["p50"], c[figure]["p95"]]
                assert all(abs(a - b) <= 0.51 * 10**-digits for a, b in zip(shown_pair, want, strict=True)), row

        out = ROOT / "test-artifacts"
        out.mkdir(exist_ok=True)
        assert browser.save_screenshot(str(tmp_path / "dashboard.png"))
        shutil.copyfile(tmp_path / "dashboard.png", out / "dashboard.png")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        # the token went from the fragment to this tab's storage; the server (and its access log) never saw it
        assert browser.execute_script("return sessionStorage.getItem('pfl-dashboard-token')") == fed.admin_token
    finally:
        fed.close()
    assert fed.admin_token not in (tmp_path / "run" / "server.log").read_text()


def test_static_files_are_served_safely(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", admin_token="adm-token-0123456789",  # type: ignore[arg-type]
                        decode_processes=0)
    with TestClient(create_app(settings)) as c:
        page = c.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["content-security-policy"] == CSP and "default-src 'self'" in CSP
        assert "script-src 'self';" in CSP and "unsafe" not in CSP
        assert page.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in page.text and "style=" not in page.text  # nothing inline: the CSP would block it
        assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
        for name, ctype in (("app.js", "text/javascript"), ("charts.js", "text/javascript"),
                            ("style.css", "text/css"), ("favicon.svg", "image/svg+xml")):
            r = c.get(f"/dashboard/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(ctype), name
            assert r.headers["content-security-policy"] == CSP
        for bad in ("../settings.py", "..%2Fsettings.py", "%2e%2e%2fapp.py", "..%5Capp.py", "app.py", ".%2Fapp.js",
                    "APP.JS", "app.js%00.css", "/etc/passwd", "%2Fetc%2Fpasswd"):
            r = c.get(f"/dashboard/{bad}")
            assert r.status_code == 404, (bad, r.status_code)
            assert "import" not in r.text and "root:" not in r.text
        # the page is public; the data behind it is not
        assert c.get(f"{API_PREFIX}/federations").status_code == 401
