"""The server's image built and run by a container engine (issue 32): both compose files, end to end.

Where podman runs (as root, with mmdebstrap), ``docker/debian/images.sh`` builds the base from Debian's packages
and the server, Mosquitto, PostgreSQL, HAProxy and RabbitMQ images on it (no registry is reachable here), and
podman-compose (PyPI's: Debian's 1.0.3 cannot give HAProxy its fixed address) runs each compose file under a
project of its own, on free host ports.

compose.yaml (server, Mosquitto with dynamic security, PostgreSQL):
- the broker's and the database's health checks pass, then the server's (its image's HEALTHCHECK: ``/healthz``
  with the database and the MQTT link up);
- the server's process runs as the image's unprivileged user (uid 10001), not root;
- a federation is created through the published port, and two ``pfl-edge client`` devices on this host (one on
  the ONNX training program, one on the ExecuTorch one: both exported by the export worker inside the image) take
  part to the end through compose's Mosquitto, each with its own credentials;
- the server's container is restarted mid-federation; the federation finishes, and the ledger check of the soak
  (``bench/soak_ledger.py``: every update a device's ledger says was accepted is in the database once, every
  FedPer average recomputed from the updates) finds nothing lost;
- the server's volume holds its data (the blobs and programs, owned by the unprivileged user).

compose.replicated.yaml (three replicas behind HAProxy, RabbitMQ asking their hook, PostgreSQL): the same
federation (its devices training eagerly) through HAProxy's published port and RabbitMQ, one replica restarted
mid-federation, the same ledger check, the blobs on the replicas' shared volume.

The tests skip, saying why, where no engine runs. Their figures (build time, image sizes, time from ``up`` to
healthy) go to ``$PFL_CONTAINER_REPORT`` if set (docs/operations.md "Containers" quotes them).
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fedkit import BASE, device_log, ended

from edge_runtime.fleet import Federation, free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
IMAGES_SH = ROOT / "docker" / "debian" / "images.sh"
COMPOSE = Path(sys.executable).parent / "podman-compose"  # the dev extra's
PFL_UID = 10001  # the Dockerfile's PFL_UID
CONFIG = dict(algorithm="fedper", clients=2, kp=2, **{**BASE, "rounds": 3})
RESTART_AT = 2  # restart the server's container once this round is open


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    # this host's cgroups need runc and container ulimits at or below the host's (docker/debian/containers.conf)
    if "CONTAINERS_CONF" not in env and shutil.which("runc"):
        env["CONTAINERS_CONF"] = str(ROOT / "docker" / "debian" / "containers.conf")
    return env


def _why_not() -> str | None:
    for tool in ("podman", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian's podman, runc and mmdebstrap: .ci/run installs them)"
    if not COMPOSE.exists():
        return "podman-compose is not installed (pip install -e .[dev])"
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (mmdebstrap, rootful podman)"
    r = subprocess.run(["podman", "info"], capture_output=True, text=True, env=_engine_env(), timeout=60)
    if r.returncode != 0:
        return f"podman does not run here: {r.stderr.strip()[-300:]}"
    return None


def _podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, env=_engine_env(), timeout=timeout,
                          check=check)


def _report(**figures: Any) -> None:
    path = os.environ.get("PFL_CONTAINER_REPORT")
    if path:
        old = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        Path(path).write_text(json.dumps({**old, **figures}, indent=2) + "\n")
    print("container:", json.dumps(figures))


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    r = subprocess.run(["sh", str(IMAGES_SH)], capture_output=True, text=True, env=_engine_env(), timeout=2400)
    assert r.returncode == 0, r.stderr[-4000:]
    names = dict(line.split("=", 1) for line in r.stdout.split())
    sizes = {k: int(_podman("image", "inspect", "--format", "{{.Size}}", v).stdout) for k, v in names.items()}
    _report(build_s=round(time.monotonic() - t0, 1), image_bytes=sizes)
    return names


class Compose:
    """A compose file under a project of its own (``podman-compose -p``), on free host ports."""

    def __init__(self, images: dict[str, str], root: Path, file: str) -> None:
        self.project = "pflct" + secrets.token_hex(3)
        self.file = ROOT / file
        self.http_port, self.mqtt_port = free_port(), free_port()
        self.admin = secrets.token_urlsafe(24)
        self.env = {**_engine_env(), **images, "PFL_ADMIN_TOKEN": self.admin,
                    "PFL_MQTT_PASSWORD": secrets.token_hex(16), "POSTGRES_PASSWORD": secrets.token_hex(16),
                    "PFL_BROKER_HOOK_TOKEN": secrets.token_hex(16),
                    "PFL_HTTP_PORT": str(self.http_port), "PFL_MQTT_PORT": str(self.mqtt_port),
                    "PFL_PUBLIC_URL": f"http://127.0.0.1:{self.http_port}",
                    "PFL_PUBLIC_BROKER_URL": f"mqtt://127.0.0.1:{self.mqtt_port}"}
        self.url = self.env["PFL_PUBLIC_URL"]
        self.root = root

    def run(self, *args: str, timeout: float = 300.0) -> None:
        r = subprocess.run([str(COMPOSE), "-p", self.project, "-f", str(self.file), *args], capture_output=True,
                           text=True, env=self.env, timeout=timeout, cwd=ROOT)
        assert r.returncode == 0, f"podman-compose {' '.join(args)}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}"

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"  # podman-compose's naming

    def wait_healthy(self, service: str, timeout_s: float) -> float:
        """Seconds until the service's own health check passes (run on demand: podman runs health checks from
        systemd timers, which a CI container lacks)."""
        t0 = time.monotonic()
        while True:
            r = _podman("healthcheck", "run", self.container(service), check=False, timeout=60)
            if r.returncode == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                logs = _podman("logs", "--tail", "60", self.container(service), check=False).stdout
                pytest.fail(f"{service} not healthy after {timeout_s:.0f} s: {r.stdout}{r.stderr}\n{logs}")
            time.sleep(1.0)

    def volume(self, name: str) -> Path:
        out = _podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{self.project}_{name}").stdout
        return Path(out.strip())

    def ip(self, service: str) -> str:
        fmt = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        return _podman("inspect", "--format", fmt, self.container(service)).stdout.strip()

    def uid(self, service: str) -> list[str]:
        status = _podman("exec", self.container(service), "cat", "/proc/1/status").stdout
        return next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))

    def down(self) -> None:
        names = _podman("ps", "-a", "--format", "{{.Names}}", "--filter", f"name={self.project}_", check=False)
        for name in names.stdout.split():
            r = _podman("logs", name, check=False)
            (self.root / f"{name}.log").write_text(r.stdout + r.stderr)
        subprocess.run([str(COMPOSE), "-p", self.project, "-f", str(self.file), "down", "-v"], capture_output=True,
                       env=self.env, timeout=300, cwd=ROOT)
        _podman("network", "rm", "-f", f"{self.project}_default", check=False)


def _ledger_check(c: Compose, blobs: Path, device_dirs: list[Path]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        ledger = importlib.import_module("soak_ledger")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    db = f"postgresql://pfl:{c.env['POSTGRES_PASSWORD']}@{c.ip('postgres')}:5432/pfl"
    return dict(ledger.check(db, blobs, device_dirs))


def _federate(c: Compose, root: Path, restart: str, log_from: str, backends: tuple[str, str]) -> dict[str, Any]:
    """CONFIG's federation through the published port with two devices on this host (training with
    ``backends``), ``restart``'s container restarted once round RESTART_AT is open; the ledger check of the run."""
    (root / "devices").mkdir()
    logs = subprocess.Popen(["podman", "logs", "-f", c.container(log_from)], env=c.env,
                            stdout=open(root / "server.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    fed = Federation(c.url, c.admin, logs, root, ([], {}))
    try:
        fed.create("contained", CONFIG, deadline_s=600.0)
        for i, backend in enumerate(backends):
            fed.start_device(i, "phone-mid", extra=["--training-backend", backend])
        restarted, deadline = False, time.monotonic() + 900
        while True:
            try:
                info = fed.info()
            except httpx.HTTPError:  # the server (or a replica behind HAProxy) is restarting
                info = {"state": "?", "round": -1}
            if ended(fed, root, info):
                break
            assert time.monotonic() < deadline, f"not finished: {info}\n" + device_log(root, 0)
            if not restarted and info["round"] >= RESTART_AT:
                _podman("restart", c.container(restart), timeout=180)
                restarted = True
                c.wait_healthy(restart, 300)
            time.sleep(1.0)
        assert restarted
        assert [p.returncode for p in fed.devices] == [0, 0]
    finally:
        fed.close()
    volume = "server-data" if restart == "server" else "shared"
    return _ledger_check(c, c.volume(volume) / "blobs", [root / "devices" / f"device-{i:02d}" for i in range(2)])


def _assert_nothing_lost(report: dict[str, Any]) -> None:
    rounds = int(CONFIG["rounds"])
    assert report["lost"] == 0, report["lost_detail"]
    assert report["double_counted"] == 0 and report["unlogged"] == 0, report
    assert report["inconsistent_devices"] == 0, report["devices"]
    # both devices' updates of every round (FedPer: rounds 1..T), each in a ledger and in the database
    assert report["updates_on_server"] == report["ledger_entries"] == 2 * rounds, report
    assert report["aggregates"]["checked"] >= rounds - 1 and report["aggregates"]["mismatched"] == 0, report


def test_compose_runs_a_federation_through_a_server_restart(images: dict[str, str], tmp_path: Path) -> None:
    c = Compose(images, tmp_path, "compose.yaml")
    try:
        t0 = time.monotonic()
        c.run("up", "-d", "postgres", "mosquitto")
        # podman-compose starts a service without waiting for its dependencies' health on podman 4: wait here,
        # as docker compose's "condition: service_healthy" does
        for svc in ("postgres", "mosquitto"):
            c.wait_healthy(svc, 180)
        c.run("up", "-d", "server")
        healthy_s = c.wait_healthy("server", 300)
        _report(up_to_healthy_s=round(time.monotonic() - t0, 1), server_start_to_healthy_s=round(healthy_s, 1))
        assert c.uid("server") == [str(PFL_UID)] * 4, "the server's process does not run as the image's user"
        # a private federation's accountant runs in the image (the build prunes what the server never imports)
        r = subprocess.run(["podman", "exec", c.container("server"), "python", "-c",
                            "from pfl_edge.privacy import _epsilon; print(_epsilon(1.0, 0.1, 10, 1e-5))"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and 0 < float(r.stdout) < 10, r.stderr[-2000:]
        report = _federate(c, tmp_path, restart="server", log_from="server", backends=("onnxruntime", "executorch"))
        _assert_nothing_lost(report)
        data = c.volume("server-data")
        assert (data / "blobs").is_dir() and any((data / "blobs").rglob("*")), "the volume holds no blobs"
        assert any((data / "programs").glob("*.onnx")) and any((data / "programs").glob("*.pte")), \
            "the volume holds no exported programs"
        assert data.stat().st_uid == PFL_UID and (data / "blobs").stat().st_uid == PFL_UID
    finally:
        c.down()


def test_replicated_compose_runs_a_federation_through_a_replica_restart(images: dict[str, str],
                                                                       tmp_path: Path) -> None:
    c = Compose(images, tmp_path, "compose.replicated.yaml")
    replicas = ("replica-1", "replica-2", "replica-3")
    try:
        t0 = time.monotonic()
        c.run("up", "-d", "postgres")
        c.wait_healthy("postgres", 180)
        c.run("up", "-d")
        for r in replicas:
            c.wait_healthy(r, 300)
        # through HAProxy, with the replicas' MQTT link to RabbitMQ up (RabbitMQ asks their hook to let them in)
        deadline = time.monotonic() + 300
        while not _healthz(c.url).get("mqtt"):
            assert time.monotonic() < deadline, f"not healthy through HAProxy: {_healthz(c.url)}"
            time.sleep(1.0)
        _report(replicated_up_to_healthy_s=round(time.monotonic() - t0, 1))
        assert all(c.uid(r) == [str(PFL_UID)] * 4 for r in replicas)
        # eager training on the devices: the programs were proven above, and the slow tier has a time budget
        report = _federate(c, tmp_path, restart="replica-1", log_from="replica-2", backends=("torch", "torch"))
        _assert_nothing_lost(report)
        assert any((c.volume("shared") / "blobs").rglob("*")), "the replicas' shared volume holds no blobs"
    finally:
        c.down()


def _healthz(url: str) -> dict[str, Any]:
    try:
        r = httpx.get(f"{url}/healthz", timeout=2.0)
        return dict(r.json()) if r.status_code == 200 else {}
    except (httpx.TransportError, ValueError):
        return {}
