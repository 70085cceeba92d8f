"""A device bundle end to end: ``pfl-edge bundle`` against a running server, the bundle installed by its own
install.sh into a fresh virtual environment that sees neither this checkout nor its .venv, and its start.sh run
as a device (training with the bundled ExecuTorch program) beside an ordinary agent device: the federation
finishes with the bundle device's updates accepted in every round."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from edge_runtime.fleet import Federation, start_server
from pfl_edge.modelcard import ModelCard
from pfl_edge.protocol import API_PREFIX

ROOT = Path(__file__).resolve().parents[2]
CONFIG: dict[str, Any] = dict(algorithm="fedper", model="cnn", dataset="synthetic", partition="pathological:2",
                              clients=2, rounds=2, samples_per_client=48, test_per_client=32, local_epochs=1,
                              batch_size=16, lr=0.05, workers=1, seed=3)
PROFILE = "raspberry-pi-4"
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"


def _clean_env(home: Path) -> dict[str, str]:
    """The environment of a machine that has never seen this checkout: no PYTHONPATH, no virtual environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PFL_")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))]
    env.update(PATH=os.pathsep.join(path), HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPLCONFIGDIR=str(home / ".mpl"))
    return env


def _bundle(fed: Federation, tmp: Path) -> Path:
    token, secret = tmp / "admin-token", tmp / "enrol-secret"
    token.write_text(fed.admin_token + "\n")
    secret.write_text(fed.secret + "\n")
    out = tmp / "device-bundle"
    cmd = [sys.executable, "-m", "pfl_edge", "bundle", "--profile", PROFILE, "--server", fed.url, "--federation",
           fed.fed, "--out", str(out), "--name", "bundled", "--admin-token-file", str(token), "--enrol-secret-file",
           str(secret), "--training-backend", "executorch", "--client-arg=--partition-id=1", "--wait", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _check_contents(out: Path, fed: Federation) -> str:
    """The bundle's files against the server: the card as served, every program's bytes by the card's sha256.
    Returns the training program's file name."""
    card = ModelCard.model_validate_json((out / "model" / "card.json").read_bytes())
    assert card.federation == fed.fed and card.profile == PROFILE
    kinds = sorted((p.kind, p.runtime) for p in card.programs)
    assert kinds == [("inference", "onnxruntime"), ("training", "executorch")]
    for p in card.programs:
        data = (out / "model" / "programs" / p.file).read_bytes()
        assert len(data) == p.bytes and hashlib.sha256(data).hexdigest() == p.sha256
        served = fed.http.get(p.url, headers={"Authorization": f"Bearer {fed.admin_token}"})
        assert served.status_code == 200 and served.content == data
    device = json.loads((out / "device.json").read_text())
    assert (device["server"], device["federation"], device["profile"], device["name"]) == (
        fed.url, fed.fed, PROFILE, "bundled")
    train = next(p.file for p in card.programs if p.kind == "training")
    assert device["training_program"] == f"model/programs/{train}"
    assert (out / "enrol-secret").read_text().strip() == fed.secret
    assert (out / "enrol-secret").stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700
    start = (out / "start.sh").read_text()
    assert f"--training-program \"$here/model/programs/{train}\"" in start and "--training-backend" in start
    unit = (out / "pfl-edge-device.service").read_text()
    assert "User=pfl" in unit and "Restart=on-failure" in unit and "WorkingDirectory=/opt/pfl-edge-device" in unit
    reqs = (out / "requirements.txt").read_text().splitlines()
    from importlib import metadata

    for name in ("torch", "executorch", "httpx", "paho-mqtt", "psycopg-binary"):
        pin = next(ln for ln in reqs if ln.startswith(f"{name}=="))
        assert pin == f"{name}=={metadata.version(name).split('+')[0]}"
    return train


def _install(out: Path, home: Path) -> float:
    """install.sh into the bundle, run from outside the checkout; its seconds."""
    if not BASE_PYTHON.exists():
        pytest.skip(f"no base interpreter at {BASE_PYTHON}")
    env = {**_clean_env(home), "PYTHON": str(BASE_PYTHON), "TORCH_INDEX_URL": ""}  # pip's own index config here
    t0 = time.monotonic()
    proc = subprocess.run(["sh", str(out / "install.sh")], cwd=home, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    took = time.monotonic() - t0
    where = subprocess.run([str(out / "venv" / "bin" / "python"), "-c",
                            "import sys, pfl_edge, edge_runtime; print(pfl_edge.__file__); print(sys.path)"],
                           cwd=home, env=_clean_env(home), capture_output=True, text=True, check=True).stdout
    imported, path = where.splitlines()
    assert Path(imported).resolve().is_relative_to((out / "venv").resolve()), imported
    assert str(ROOT) not in path, path
    return took


def _run_federation(fed: Federation, out: Path, home: Path, log: Path) -> None:
    """The bundle's start.sh (run from ``home``, outside the checkout) and one ordinary agent device, to the end:
    the bundle device's updates are accepted in every round."""
    with log.open("wb") as f:
        device = subprocess.Popen(["sh", str(out / "start.sh"), "-v"], cwd=home, env=_clean_env(home), stdout=f,
                                  stderr=subprocess.STDOUT)
    try:
        fed.start_device(0, PROFILE)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if fed.info()["state"] == "finished" and device.poll() is not None and fed.devices[0].poll() is not None:
                break
            assert device.poll() in (None, 0), log.read_text()[-3000:]
            time.sleep(1.0)
        assert fed.info()["state"] == "finished" and device.returncode == 0, log.read_text()[-3000:]
    finally:
        if device.poll() is None:
            device.terminate()
            device.wait(15)
    devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
    bundled = next(d for d in devices if d["name"] == "bundled")
    assert bundled["profile"] == PROFILE and bundled["index"] == 1 and bundled["last_round"] == CONFIG["rounds"]
    metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
    assert [r["round"] for r in metrics["rounds"] if r["round"] >= 1] == list(range(1, CONFIG["rounds"] + 1))
    for rnd in metrics["rounds"]:
        if rnd["round"] >= 1:
            assert rnd["updates"] == 2 and bundled["device_id"] in rnd["devices"], rnd
    # it trained with the bundled ExecuTorch program, not one it fetched (or made) into its state
    fetched = out / "state" / "programs"
    assert not fetched.exists() or not any(fetched.iterdir())


def test_a_bundle_device_takes_part(tmp_path: Path) -> None:
    """The bundle's files and its start.sh as a device (its venv: this checkout's, linked; the fresh install is
    the slow test below)."""
    fed = start_server(tmp_path / "run")
    try:
        fed.create(f"b{int(time.time() * 1000) % 10**9}", CONFIG, deadline_s=300.0)
        out = _bundle(fed, tmp_path)
        _check_contents(out, fed)
        (out / "venv").symlink_to(Path(sys.executable).parents[1])
        home = tmp_path / "elsewhere"
        home.mkdir()
        _run_federation(fed, out, home, tmp_path / "bundle-device.log")
    finally:
        fed.close()


# about 5 minutes here: the install alone 191 s (89 pinned packages, torch and executorch among them)
@pytest.mark.slow
def test_a_bundle_installs_into_a_fresh_environment_and_takes_part(tmp_path: Path) -> None:
    fed = start_server(tmp_path / "run")
    try:
        fed.create(f"b{int(time.time() * 1000) % 10**9}", CONFIG, deadline_s=600.0)
        t0 = time.monotonic()
        out = _bundle(fed, tmp_path)
        built = time.monotonic() - t0
        home = tmp_path / "elsewhere"
        home.mkdir()
        installed = _install(out, home)
        t1 = time.monotonic()
        _run_federation(fed, out, home, tmp_path / "bundle-device.log")
        ran = time.monotonic() - t1
        print(f"bundle built in {built:.0f} s, installed in {installed:.0f} s, federation ran {ran:.0f} s")
    finally:
        fed.close()
        shutil.rmtree(tmp_path / "device-bundle" / "venv", ignore_errors=True)


# ------------------------------------------------------------------------------- a hostile or busy server
def _http(handler: Any) -> Any:
    import httpx

    from edge_runtime.http import Http

    http = Http("http://127.0.0.1:9", 30.0)
    http.client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    http.token = "admin-token"
    return http


def _info(data: bytes, **over: Any) -> Any:
    from pfl_edge.modelcard import ProgramInfo

    fields: dict[str, Any] = dict(file="m.pte", kind="training", runtime="executorch", mode="fedper",
                                  sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
                                  url="/v1/federations/f/programs/m.pte")
    return ProgramInfo(**{**fields, **over})


def test_a_program_is_fetched_after_503_retry_after_and_checked(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from edge_runtime import bundle

    data = os.urandom(5000)
    calls: list[httpx.Request] = []
    slept: list[float] = []
    monkeypatch.setattr(bundle.time, "sleep", slept.append)

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) < 3:
            return httpx.Response(503, headers={"Retry-After": "7"}, json={"detail": "exporting"})
        return httpx.Response(200, content=data)

    got = bundle.fetch_program(_http(handler), "f", _info(data), tmp_path, time.monotonic() + 60)
    assert got.read_bytes() == data and slept == [7.0, 7.0]
    assert all(c.headers["authorization"] == "Bearer admin-token" and c.url.path == "/v1/federations/f/programs/m.pte"
               for c in calls)


@pytest.mark.parametrize("served", ["other", "longer", "shorter"])
def test_a_program_unlike_its_card_is_refused(tmp_path: Path, served: str) -> None:
    import httpx

    from edge_runtime import bundle
    from pfl_edge.errors import PflEdgeError

    data = os.urandom(4000)
    body = {"other": os.urandom(4000), "longer": data + b"x", "shorter": data[:-1]}[served]
    http = _http(lambda req: httpx.Response(200, content=body))
    with pytest.raises(PflEdgeError, match="bytes"):
        bundle.fetch_program(http, "f", _info(data), tmp_path, time.monotonic() + 60)
    assert list(tmp_path.iterdir()) == []  # nothing of it is left to be mistaken for the program


@pytest.mark.parametrize(("field", "value"), [("file", "../start.sh"), ("file", ".hidden"),
                                              ("url", "https://elsewhere.example/p.pte"), ("url", "//evil/p.pte"),
                                              ("url", "/v1/../../etc/passwd")])
def test_a_card_cannot_name_another_file_or_host(tmp_path: Path, field: str, value: str) -> None:
    import httpx

    from edge_runtime import bundle
    from pfl_edge.errors import PflEdgeError

    calls: list[httpx.Request] = []
    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        return httpx.Response(200, content=b"x")

    http = _http(handler)
    with pytest.raises(PflEdgeError):
        bundle.fetch_program(http, "f", _info(b"x", **{field: value}), tmp_path, time.monotonic() + 60)
    assert calls == []  # the admin token went nowhere


def test_a_failed_bundle_leaves_nothing(tmp_path: Path) -> None:
    from edge_runtime.bundle import BundleOptions, write_bundle
    from edge_runtime.fleet import free_port
    from edge_runtime.http import ServerUnavailable

    opts = BundleOptions(server=f"http://127.0.0.1:{free_port()}", federation="f", profile=PROFILE,
                         out=tmp_path / "b", admin_token="t", enrol_secret="s", wait_s=1.5)
    with pytest.raises(ServerUnavailable):
        write_bundle(opts)
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor its half-built folder (with the secret)
