"""What the fleet benchmarks run against (``bench/fleet_load.py``, ``bench/responsiveness.py``): a private
Mosquitto with the dynamic-security plugin and a raised descriptor limit, a fresh PostgreSQL database on the
system server, the server itself as a subprocess, and a sampler of their resident memory."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from server.broker import free_port, listening
from server.broker_setup import init_dynsec
from server.launch import SubprocessServer, start_subprocess, wait_healthy

__all__ = ["RssSampler", "config_for", "mosquitto", "postgres_db", "raise_nofile", "server", "server_env"]

ADMIN = ("pfl-admin", "fleet-admin-password")
ENROL_SECRET = "fleet-enrol-secret"
DYNSEC = Path("/usr/lib/x86_64-linux-gnu/mosquitto_dynamic_security.so")


def raise_nofile(want: int = 1 << 20) -> int:
    """RLIMIT_NOFILE raised to ``want`` where this process may (root: the hard limit too), else to its hard limit
    (children inherit it); the new soft limit. A broker holds a socket per connected device: where the hard
    limit cannot be raised (20,000 in this project's containers) one broker process holds at most that many."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, hard)))
        return want
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard


def config_for(devices: int, rounds: int, *, own_data: bool = False, participation: float = 1.0) -> dict[str, Any]:
    """The demo's FedPer cnn federation sized for ``devices`` clients: one class per client and a few samples
    each, so that Fashion-MNIST can be dealt to 10,000 (the model, and so the payloads, are the demo's).
    ``own_data``: the devices bring their own data (partition "device", nothing dealt: up to 100,000 slots);
    ``participation``: the fraction of slots the server samples each round."""
    from edge_runtime.fleet import DemoConfig

    extra: dict[str, Any] = {} if own_data else {"test_per_client": 1}
    if participation != 1.0:
        extra["participation"] = participation
    return DemoConfig(devices=devices, rounds=rounds, partition="device" if own_data else "pathological:1",
                      samples_per_client=4, profile_capacity=False, extra=extra).federation_config()


@contextmanager
def mosquitto(folder: Path) -> Iterator[tuple[str, int]]:
    """A private Mosquitto with dynamic security on a free port (no persistence); (its URL, its pid)."""
    exe = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    folder.mkdir(parents=True, exist_ok=True)
    dyn = init_dynsec(folder / "dynamic-security.json", *ADMIN)
    port = free_port()
    (folder / "mosquitto.conf").write_text("\n".join([
        "user root", f"listener {port} 127.0.0.1", "persistence false", "max_connections -1",
        "max_queued_messages 10000", f"plugin {DYNSEC}", f"plugin_opt_config_file {dyn}",
        "allow_anonymous false", "log_type error", "log_type warning"]) + "\n")
    log = (folder / "mosquitto.log").open("w")
    proc = subprocess.Popen([exe, "-c", str(folder / "mosquitto.conf")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while not listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mosquitto did not start: {(folder / 'mosquitto.log').read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"mqtt://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@contextmanager
def postgres_db(base_url: str = "postgresql://postgres@127.0.0.1:5432/test") -> Iterator[str]:
    """A fresh database on the system PostgreSQL (dropped after); its URL."""
    import psycopg

    name = f"pfl_fleet_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(base_url, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        yield base_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(base_url, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_env(data_dir: Path, *, database_url: str | None, broker_url: str | None, admin_token: str,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """A fleet benchmark's server settings: the given database (None: SQLite in ``data_dir``), the private
    Mosquitto with dynamic security (None: the embedded broker), enrolment rate limits raised for a fleet on one
    address; ``extra`` last."""
    env = {"PFL_DATA_DIR": str(data_dir), "PFL_ADMIN_TOKEN": admin_token,
           "PFL_ENROL_RATE_PER_ADDRESS": "1000000", "PFL_ENROL_BURST_PER_ADDRESS": "1000000",
           "PFL_ENROL_RATE_PER_FEDERATION": "1000000", "PFL_ENROL_BURST_PER_FEDERATION": "1000000",
           "PFL_HTTP_LIMIT_CONCURRENCY": "100000", "PFL_HTTP_BACKLOG": "4096",
           # a fleet of virtual devices comes from a handful of loopback addresses: no per-address caps
           "PFL_HTTP_MAX_CONNECTIONS_PER_ADDRESS": "0", "PFL_EMBEDDED_BROKER_MAX_PER_ADDRESS": "0"}
    if database_url:
        env["PFL_DATABASE_URL"] = database_url
    if broker_url:
        env.update({"PFL_BROKER_URL": broker_url, "PFL_BROKER_DYNSEC": "true", "PFL_MQTT_USERNAME": ADMIN[0],
                    "PFL_MQTT_PASSWORD": ADMIN[1]})
    env.update(extra or {})
    return env


def server(data_dir: Path, *, database_url: str | None, broker_url: str | None, admin_token: str,
           extra: dict[str, str] | None = None, root: Path | None = None) -> SubprocessServer:
    """The server as a subprocess with :func:`server_env`'s settings; ``root``: the server of another checkout
    (a ``git worktree``; environment settings it does not know are ignored)."""
    env = server_env(data_dir, database_url=database_url, broker_url=broker_url, admin_token=admin_token,
                     extra=extra)
    if root is None:
        return start_subprocess(env, timeout=120)
    return _subprocess_at(root, env)


def _subprocess_at(root: Path, env: dict[str, str]) -> SubprocessServer:
    """``python -m server.main`` of another checkout (``git worktree``): a side-by-side comparison."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    full = {**os.environ, **env, "PFL_PUBLIC_URL": url, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "server.main", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], env=full, cwd=root)
    try:
        wait_healthy(url, 120, lambda: proc.poll() is None)
    except BaseException:
        proc.kill()
        raise
    return SubprocessServer(url, env["PFL_ADMIN_TOKEN"], proc)


class RssSampler:
    """Peak resident memory of processes (each with its children) sampled every ``every_s`` in a thread."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.25) -> None:
        self.pids = pids
        self.every_s = every_s
        self.peak_mb: dict[str, float] = {k: 0.0 for k in pids}
        self.peak_main_mb: dict[str, float] = {k: 0.0 for k in pids}
        self.timeline: list[tuple[float, float]] = []  # (unix time, MB) of the first process
        self.cpu_timeline: list[tuple[float, float]] = []  # (unix time, CPU s with its children) of the first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                p = psutil.Process(pid)
                main = p.memory_info().rss
                total = main + sum(c.memory_info().rss for c in p.children(recursive=True))
            except psutil.Error:
                continue
            self.peak_main_mb[name] = max(self.peak_main_mb[name], main / 2**20)
            if name == next(iter(self.pids)):
                self.timeline.append((time.time(), main / 2**20))
                self.cpu_timeline.append((time.time(), self.cpu_s(name)))
            self.peak_mb[name] = max(self.peak_mb[name], total / 2**20)

    def cpu_s(self, name: str) -> float:
        """CPU seconds (user + system) used so far by ``name`` and its children, live and reaped (0: gone)."""
        try:
            p = psutil.Process(self.pids[name])
            t = p.cpu_times()
            own = t.user + t.system + t.children_user + t.children_system
            return own + sum(c.cpu_times().user + c.cpu_times().system for c in p.children(recursive=True))
        except psutil.Error:
            return 0.0

    def cpu_between(self, t0: float, t1: float) -> float | None:
        """CPU seconds the first process (with its children) used between unix times ``t0`` and ``t1``."""
        inside = [c for t, c in self.cpu_timeline if t0 <= t <= t1]
        return inside[-1] - inside[0] if len(inside) >= 2 else None

    def current_mb(self, name: str) -> float | None:
        """Resident memory of ``name`` (its main process) now."""
        try:
            return float(psutil.Process(self.pids[name]).memory_info().rss) / 2**20
        except psutil.Error:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()
