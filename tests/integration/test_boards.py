"""The emulated arm64 boards (``bench/boards.py``) that the device-bundle tests run on: each suite's board runs
aarch64 programs with its own Python, reaches the host's 127.0.0.1, takes a folder copied in, and leaves no mount
behind, also when a command is killed at its timeout. Building a board (once, cached outside the checkout) downloads
Debian arm64 packages: some minutes per suite."""

from __future__ import annotations

import http.server
import importlib
import json
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"


def _boards() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("boards")


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def board(request: pytest.FixtureRequest) -> tuple[str, Path]:
    """(suite, its rootfs): skipped where boards cannot run (not root, no mmdebstrap or qemu-user-static)."""
    boards = _boards()
    why = boards.prerequisites()
    if why is not None:
        pytest.skip(why)
    suite: str = request.param
    return suite, boards.rootfs(suite)


def _mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    return [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
            if ln.split()[4].startswith(prefix)]


@pytest.mark.slow  # builds each suite's rootfs on first use (minutes), every command under qemu
def test_a_board_is_aarch64_with_its_suites_python(board: tuple[str, Path]) -> None:
    boards = _boards()
    suite, root = board
    r = boards.run(root, ["sh", "-c", "uname -m; python3 -c 'import sys; print(sys.version_info[:2])'"], timeout=120)
    assert r.returncode == 0, r.stderr
    machine, version = r.stdout.split("\n", 1)
    assert machine == "aarch64"
    assert version.strip() == str(tuple(int(x) for x in boards.SUITES[suite].split(".")))
    assert "Raspberry Pi 4" in boards.run(root, ["cat", "/proc/cpuinfo"], timeout=60).stdout


@pytest.fixture
def host_server() -> Iterator[int]:
    """A server on the host's 127.0.0.1 (the board shares the host's network namespace)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.slow
def test_a_board_reaches_the_host_and_sees_a_folder_copied_in(board: tuple[str, Path], host_server: int,
                                                             tmp_path: Path) -> None:
    boards = _boards()
    _, root = board
    (tmp_path / "hello.txt").write_text("hello from the host\n")
    boards.copy_in(root, tmp_path, "/opt/pfl-boards-test")
    script = ("import urllib.request, sys; "
              f"print(urllib.request.urlopen('http://127.0.0.1:{host_server}/', timeout=30).status); "
              "print(open('/opt/pfl-boards-test/hello.txt').read().strip())")
    r = boards.run(root, ["python3", "-c", script], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["200", "hello from the host"]


@pytest.mark.slow
def test_a_command_past_its_timeout_is_killed_and_leaves_no_mount(board: tuple[str, Path]) -> None:
    boards = _boards()
    _, root = board
    with pytest.raises(subprocess.TimeoutExpired):
        boards.run(root, ["sh", "-c", "sleep 300 & sleep 300"], timeout=3)
    assert _mounts_under(root) == []
    proc = boards.popen(root, ["sleep", "300"])
    assert boards.stop(proc, grace=5) != 0
    assert _mounts_under(root) == []


@pytest.mark.slow
def test_a_saved_venv_comes_back_at_its_own_path(board: tuple[str, Path]) -> None:
    boards = _boards()
    suite, root = board
    venv = "/opt/pfl-boards-test-venv"
    key = boards.venv_key(suite, "# nothing\n", None, extra=f"test_boards {venv}")
    assert boards.run(root, ["python3", "-m", "venv", "--without-pip", venv], timeout=300).returncode == 0
    archive = boards.save_venv(root, key, venv)
    try:
        subprocess.run(["rm", "-rf", str(root / venv.lstrip("/"))], check=True)
        assert boards.cached_venv(root, key, venv)
        r = boards.run(root, [f"{venv}/bin/python", "-c", "import sys; print(sys.prefix)"], timeout=120)
        assert r.stdout.strip() == venv
    finally:
        archive.unlink(missing_ok=True)


# ------------------------------------------------------------------------------- a bundle on a board, to the end
FMNIST = Path("/usr/share/datasets/fashion-mnist")
BOARD_PROFILE = {"bookworm": "raspberry-pi-4", "trixie": "raspberry-pi-5"}


def _federation(board: tuple[str, Path], tmp_path: Path, algorithm: str, extra: dict[str, Any], wheel: Path,
                ) -> dict[str, Any]:
    """A server on the host and a FedPer or DisPFL federation of 2: the board's torch-free bundle (made by
    ``pfl-edge bundle --torch-free``, installed on the board by its own install.sh, run by its start.sh) in slot 1
    and an eager torch device on the host in slot 0, to the end; the board device's final model against the
    simulator's for its slot. Returns what was measured."""
    from safetensors.numpy import load_file

    from edge_runtime.fleet import start_server
    from pfl_edge.checkpoint import load_checkpoint
    from pfl_edge.federation import FederationConfig
    from pfl_edge.modelcard import ModelCard
    from pfl_edge.protocol import API_PREFIX
    from pfl_edge.sim import simulate

    boards = _boards()
    suite, root = board
    profile = BOARD_PROFILE[suite]
    config = {**BOARD_CONFIG, **extra}
    run = tmp_path / algorithm
    fed = start_server(run / "run")
    measured: dict[str, Any] = {}
    device = None
    log = run / "board-device.log"
    try:
        fed.create(f"a{int(time.time() * 1000) % 10**9}", config, deadline_s=900.0)
        (run / "admin-token").write_text(fed.admin_token + "\n")
        (run / "enrol-secret").write_text(fed.secret + "\n")
        out = run / "bundle"
        proc = subprocess.run([sys.executable, "-m", "pfl_edge", "bundle", "--profile", profile, "--server", fed.url,
                               "--federation", fed.fed, "--out", str(out), "--name", "board",
                               "--admin-token-file", str(run / "admin-token"), "--enrol-secret-file",
                               str(run / "enrol-secret"), "--client-arg=--partition-id=1", "--wait", "400",
                               "--torch-free", "--wheel", str(wheel), "--install-dir", boards.BUNDLE_DIR],
                              capture_output=True, text=True, timeout=500, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        card = ModelCard.model_validate_json((out / "model" / "card.json").read_bytes())
        assert [p.runtime for p in card.programs if p.kind == "training"] == ["onnxruntime"]
        t0 = time.monotonic()
        measured["venv_cached"] = boards.install_bundle(root, suite, out, timeout=3000)
        measured["install_s"] = round(time.monotonic() - t0, 1)
        venv = root / boards.BUNDLE_DIR.lstrip("/") / "venv"
        measured["venv_mib"] = round(boards.du_mib(venv), 1)
        assert measured["venv_mib"] < 150, measured  # issue 47: the torch-free venv under 150 MB on every board
        for module in ("torch", "executorch"):
            probe = boards.run(root, [f"{boards.BUNDLE_DIR}/venv/bin/python", "-c", f"import {module}"], timeout=300)
            assert probe.returncode != 0 and f"No module named '{module}'" in probe.stderr
        with log.open("w") as f:
            device = boards.popen(root, ["/bin/sh", f"{boards.BUNDLE_DIR}/start.sh", "-v"], stdout=f,
                                  stderr=subprocess.STDOUT, cwd=boards.BUNDLE_DIR)
        fed.start_device(0, profile, extra=["--training-backend", "torch"])
        t0 = time.monotonic()
        deadline = t0 + 1500
        while time.monotonic() < deadline:  # the event: the federation finished and both devices exited
            if fed.info()["state"] == "finished" and device.poll() is not None and fed.devices[0].poll() is not None:
                break
            assert device.poll() in (None, 0), log.read_text()[-3000:]
            time.sleep(2.0)
        assert fed.info()["state"] == "finished" and device.returncode == 0, log.read_text()[-3000:]
        measured["federation_s"] = round(time.monotonic() - t0, 1)
        devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
        mine = next(d for d in devices if d["name"] == "board")
        assert mine["index"] == 1 and mine["last_round"] == config["rounds"]
        # it said what it is: an aarch64 machine, its suite's Python, ONNX Runtime; its architecture is its
        # profile's, while the host's device (x86_64, declared the same profile) is flagged for it; the step-time
        # flag may fire on either (emulation is 10-60x slower than the host): recorded, not asserted
        said = mine["platform"]
        assert said["machine"] == "aarch64" and said["language"].startswith(f"python {boards.SUITES[suite]}"), said
        assert said["runtime"].startswith("onnxruntime ") and not any("machine" in f for f in mine["flags"]), mine
        host = next(d for d in devices if d["name"] != "board")
        assert any(f.startswith("reports a x86_64 machine") for f in host["flags"]) == (
            platform.machine() == "x86_64"), host
        measured["platform"], measured["flags"] = said, {"board": mine["flags"], "host": host["flags"]}
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        for rnd in metrics["rounds"]:
            if rnd["round"] >= 1:
                assert rnd["updates"] == 2 and mine["device_id"] in rnd["devices"], rnd
        assert "training with the onnxruntime backend" in log.read_text()
    finally:
        if device is not None and device.poll() is None:
            boards.stop(device)
        fed.close()
    cfg = FederationConfig.from_dict(config)
    simulate(cfg, save_dir=run / "sim", progress=False)
    got = load_file(str(root / boards.BUNDLE_DIR.lstrip("/") / "state" / "final.safetensors"))
    want = load_checkpoint(run / "sim" / "client_001.safetensors")[0]
    assert got.keys() == want.keys()
    worst = 0.0
    for k in got:
        np.testing.assert_allclose(got[k], want[k].numpy(), atol=5e-5, rtol=1e-4, err_msg=f"{suite} {algorithm} {k}")
        worst = max(worst, float(np.abs(got[k] - want[k].numpy()).max()))
    measured["max_abs_diff_from_simulator"] = worst
    return measured


BOARD_CONFIG: dict[str, Any] = dict(model="cnn", dataset="fashion-mnist", partition="pathological:2", clients=2,
                                    rounds=2, samples_per_client=48, test_per_client=32, local_epochs=1,
                                    batch_size=16, lr=0.05, workers=1, seed=3)
BOARD_RUNS: dict[str, dict[str, Any]] = {
    "fedper": dict(algorithm="fedper", kp=1),
    # DisPFL at its default graph (random:K): drawn on the board by numpy's MT, the draw that once needed torch
    "dispfl": dict(algorithm="dispfl", densities=(0.5, 0.7)),
}


@pytest.mark.slow  # an emulated install (a minute or two) and two emulated federations per suite
@pytest.mark.needs_fmnist
def test_a_torch_free_bundle_on_an_arm64_board_takes_part_in_fedper_and_dispfl(board: tuple[str, Path],
                                                                               tmp_path: Path) -> None:
    """The boards people own: Debian bookworm (Raspberry Pi OS's base, Python 3.11) and trixie (3.13) on arm64, under
    qemu. On each, the torch-free bundle installs by its own install.sh (aarch64 wheels of numpy and onnxruntime,
    its check: imports, an ONNX training step, the programs run), and its start.sh takes part in a 2-round FedPer
    and a DisPFL federation against a server on the host, to the end, its model within docs/model.md's tolerance
    of the simulator's. Figures go to test-artifacts/boards-<suite>.json (BENCHMARKS.md quotes them)."""
    boards = _boards()
    suite, root = board
    data = root / FMNIST.relative_to("/")
    if not data.is_dir():  # the board reads the registered data set where a Debian device has it
        boards.copy_in(root, FMNIST, str(FMNIST))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(REPO)], check=True, capture_output=True)
    wheel = next(wheels.glob("pfl_edge-*.whl"))
    figures = {name: _federation(board, tmp_path, name, extra, wheel) for name, extra in BOARD_RUNS.items()}
    out = REPO / "test-artifacts"
    out.mkdir(exist_ok=True)
    (out / f"boards-{suite}.json").write_text(json.dumps({"suite": suite, "python": boards.SUITES[suite],
                                                          "date": time.strftime("%Y-%m-%d"), **figures}, indent=1))
    print(suite, figures)
