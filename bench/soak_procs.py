"""The soak's processes: the broker (a private Mosquitto, or none: the server's embedded one), the server, the
fault proxy (all in the server's namespace) and the device agents (each in its own namespace), started, killed
and restarted on the same state. The caller reaches the server through the management link, never faulted."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from netns import MGMT_IP, SERVICE_IP, Netns

from server.launch import wait_healthy

__all__ = ["BlobWitness", "DeviceSpec", "Procs"]

REPO = Path(__file__).resolve().parent.parent
SERVER_PORT, BROKER_PORT, HTTP_PROXY_PORT, MQTT_PROXY_PORT = 8080, 1883, 9080, 9883
PG_PORT, PG_FORWARD_PORT = 5432, 15432  # the host's PostgreSQL; its forwarder on the management link
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


class _Cfg(Protocol):  # what of bench/soak.py's SoakConfig this module reads
    @property
    def broker(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def cut(self) -> float: ...
    @property
    def devices(self) -> int: ...
    @property
    def deadline_s(self) -> float: ...
    @property
    def database(self) -> str: ...

    def fed_config(self, algorithm: str) -> dict[str, Any]: ...


class BlobWitness:
    """Hard links to every blob the server stores, made as they appear (polled each ``every_s``), so the
    server's garbage collection of old rounds' blobs cannot take what the end check recomputes aggregates from.
    Same layout as the server's blob dir (``<first two hex>/<digest>``)."""

    def __init__(self, src: Path, dst: Path, every_s: float = 0.5) -> None:
        self.src, self.dst, self.every_s = src, dst, every_s
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blob-witness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def scan(self) -> None:
        if not self.src.is_dir():
            return
        for sub in os.scandir(self.src):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                if f.name in self.seen or f.name.startswith("."):
                    continue
                (self.dst / sub.name).mkdir(parents=True, exist_ok=True)
                try:
                    os.link(f.path, self.dst / sub.name / f.name)
                except FileExistsError:
                    pass
                except FileNotFoundError:
                    continue  # collected between the listing and the link
                self.seen.add(f.name)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.scan()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.scan()


@dataclass
class DeviceSpec:
    fed: str
    index: int  # its slot in its federation
    g: int  # its namespace number
    state: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None


class Procs:
    def __init__(self, cfg: _Cfg, net: Netns, root: Path) -> None:
        self.cfg, self.net, self.root = cfg, net, root
        self.token = secrets.token_urlsafe(24)
        self.url = f"http://{MGMT_IP}:{SERVER_PORT}"
        self.http = httpx.Client(base_url=self.url, timeout=10.0,
                                 headers={"Authorization": f"Bearer {self.token}"})
        self.server: subprocess.Popen[bytes] | None = None
        self.broker: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.devices: list[DeviceSpec] = []
        self.secrets: dict[str, str] = {}
        self.witness = BlobWitness(self.data_dir / "blobs", self.root / "witness-blobs")
        self.pg_schema = f"pflsoak_{secrets.token_hex(4)}" if cfg.database == "postgresql" else None
        self.pg_forward: subprocess.Popen[bytes] | None = None
        self._engine: Any = None

    @property
    def data_dir(self) -> Path:
        return self.root / "server"

    def _pg_url(self, host: str, port: int) -> str:
        return f"postgresql+psycopg://postgres@{host}:{port}/test?options=-csearch_path%3D{self.pg_schema}"

    @property
    def database_url(self) -> str:
        """The server's database as this process reaches it."""
        if self.pg_schema is not None:
            return self._pg_url("127.0.0.1", PG_PORT)
        return f"sqlite:///{(self.data_dir / 'state.db').resolve()}"

    def _start_postgresql(self) -> None:
        """A fresh schema in the host's PostgreSQL (database ``test``), reached from the server's namespace
        through a plain forwarder on the management link (PostgreSQL itself is left as it is)."""
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{PG_PORT}/test", autocommit=True) as c:
            c.execute(f'CREATE SCHEMA "{self.pg_schema}"')
        with open(self.root / "pg-forward.log", "ab") as f:
            self.pg_forward = subprocess.Popen([
                sys.executable, str(REPO / "bench" / "fault_proxy.py"), "--route",
                f"{self.net.host_ip}:{PG_FORWARD_PORT}=127.0.0.1:{PG_PORT}", "--latency-ms", "0", "--cut", "0"],
                stdout=f, stderr=subprocess.STDOUT)

    def drop_database(self) -> None:
        """Drop the run's PostgreSQL schema (after the check)."""
        if self.pg_schema is None:
            return
        import psycopg

        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{PG_PORT}/test", autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{self.pg_schema}" CASCADE')

    @property
    def blob_dir(self) -> Path:
        """Every blob the server stored during the run (its own dir loses old rounds' blobs to collection)."""
        return self.witness.dst

    def state_dirs(self) -> list[Path]:
        return [d.state for d in self.devices]

    def _spawn(self, ns: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as f:
            return subprocess.Popen(self.net.exec_prefix(ns) + cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                         "PYTHONUNBUFFERED": "1", **(env or {})})

    # ------------------------------------------------------------------------------------------------ start
    def start_all(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)
        (self.root / "devices").mkdir(parents=True)
        self.data_dir.mkdir()
        if self.pg_schema is not None:
            self._start_postgresql()
        if self.cfg.broker == "embedded":
            (self.data_dir / "broker-port").write_text(str(BROKER_PORT))  # the port the proxy forwards to
        else:
            self.start_broker()
        self.start_server()
        self.witness.start()
        self.proxy = self._spawn(self.net.server_ns, [
            sys.executable, str(REPO / "bench" / "fault_proxy.py"),
            "--route", f"{SERVICE_IP}:{HTTP_PROXY_PORT}=127.0.0.1:{SERVER_PORT}",
            "--route", f"{SERVICE_IP}:{MQTT_PROXY_PORT}=127.0.0.1:{BROKER_PORT}",
            "--latency-ms", str(self.cfg.latency_ms), "--cut", str(self.cfg.cut), "--seed", str(self.cfg.seed),
            "--stats", str(self.root / "proxy.json")], self.root / "proxy.log")

    def start_broker(self) -> None:
        conf = self.root / "mosquitto.conf"
        conf.write_text(f"listener {BROKER_PORT} 127.0.0.1\nallow_anonymous true\npersistence false\n")
        self.broker = self._spawn(self.net.server_ns, [MOSQUITTO, "-c", str(conf)], self.root / "broker.log")

    def kill_broker(self) -> None:
        _kill(self.broker)

    def start_server(self, timeout_s: float = 90.0, *, wait: bool = True) -> None:
        """Start the server; ``wait``: until it answers (else the fault loop goes on while it boots)."""
        broker = "embedded" if self.cfg.broker == "embedded" else f"mqtt://127.0.0.1:{BROKER_PORT}"
        env = {"PFL_ADMIN_TOKEN": self.token, "PFL_PUBLIC_URL": f"http://{SERVICE_IP}:{HTTP_PROXY_PORT}",
               "PFL_PUBLIC_BROKER_URL": f"mqtt://{SERVICE_IP}:{MQTT_PROXY_PORT}"}
        db = [] if self.pg_schema is None else ["--database-url", self._pg_url(self.net.host_ip, PG_FORWARD_PORT)]
        self.server = self._spawn(self.net.server_ns, [
            sys.executable, "-m", "pfl_edge", "server", "--host", "0.0.0.0", "--port", str(SERVER_PORT),
            "--data-dir", str(self.data_dir), "--broker-url", broker, *db], self.root / "server.log", env)
        if not wait:
            return
        server = self.server
        try:
            wait_healthy(self.url, timeout_s, lambda: server.poll() is None)
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {self.log_tail('server')}") from None

    def kill_server(self) -> None:
        _kill(self.server)

    def create_federation(self, algorithm: str) -> str:
        fed = f"soak-{algorithm}"
        self.secrets[fed] = secrets.token_hex(16)
        r = self.http.post("/v1/federations", json={"id": fed, "enrol_secret": self.secrets[fed],
                                                    "config": self.cfg.fed_config(algorithm),
                                                    "deadline_s": self.cfg.deadline_s})
        if r.status_code >= 400:
            raise RuntimeError(f"the server refused federation {fed}: {r.status_code} {r.text[:500]}")
        for i in range(self.cfg.devices):
            g = len(self.devices)
            self.devices.append(DeviceSpec(fed, i, g, self.root / "devices" / f"{fed}-{i}",
                                           self.root / "devices" / f"{fed}-{i}.log"))
        return fed

    def start_devices(self) -> None:
        for k in range(len(self.devices)):
            self.start_device(k)

    def start_device(self, k: int) -> None:
        d = self.devices[k]
        d.proc = self._spawn(self.net.device_ns(d.g), [
            sys.executable, "-m", "pfl_edge", "client", "--server", f"http://{SERVICE_IP}:{HTTP_PROXY_PORT}",
            "--federation", d.fed, f"--enrol-secret={self.secrets[d.fed]}", "--profile", "phone-mid",
            "--state-dir", str(d.state), "--partition-id", str(d.index), "--threads", "1", "--name", d.state.name,
            "--training-backend", "torch", "--patience", "900", "-v"], d.log)

    def kill_device(self, k: int) -> None:
        _kill(self.devices[k].proc)

    # ------------------------------------------------------------------------------------------------ watch
    def info(self, fed: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The federation as the server reports it (retried while the server is down or restarting)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = self.http.get(f"/v1/federations/{fed}")
                r.raise_for_status()
                return dict(r.json())
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def wait_round(self, feds: list[str], t: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(self.info(f)["round"] < t for f in feds):
            if time.monotonic() > deadline:
                raise RuntimeError(f"round {t} did not open within {timeout_s} s; see {self.root}")
            for what, code in self.unexpected_exits(set()):
                raise RuntimeError(f"{what} exited with {code}: {self.log_tail(what)}")
            time.sleep(0.5)

    def full_round_after(self, fed: str, t: int) -> int | None:
        """The first round after ``t`` that closed with an update of every device (None: none yet)."""
        from sqlalchemy import create_engine, text
        from sqlalchemy.exc import SQLAlchemyError

        if self._engine is None:
            self._engine = create_engine(self.database_url)
        try:
            with self._engine.connect() as c:
                row = c.execute(text(
                    "SELECT r.round FROM pfl_rounds r WHERE r.federation = :f AND r.round > :t"
                    " AND r.closed_at IS NOT NULL AND (SELECT count(*) FROM pfl_updates u"
                    " WHERE u.federation = r.federation AND u.round = r.round) >= :n ORDER BY r.round LIMIT 1"),
                    {"f": fed, "t": t, "n": self.cfg.devices}).first()
        except SQLAlchemyError:
            return None
        return None if row is None else int(row[0])

    def unexpected_exits(self, down: set[str]) -> list[tuple[str, int]]:
        """Processes that died though nobody killed them; each is restarted."""
        out: list[tuple[str, int]] = []
        for k, d in enumerate(self.devices):
            if f"device:{k}" not in down and d.proc is not None and d.proc.poll() is not None:
                out.append((f"device:{k}", d.proc.returncode))
                self.start_device(k)
        if "server" not in down and self.server is not None and self.server.poll() is not None:
            out.append(("server", self.server.returncode))
            self.start_server()
        if "broker" not in down and self.broker is not None and self.broker.poll() is not None:
            out.append(("broker", self.broker.returncode))
            self.start_broker()
        return out

    def log_tail(self, what: str, n: int = 1500) -> str:
        path = {"server": self.root / "server.log", "broker": self.root / "broker.log"}.get(what)
        if path is None and what.startswith("device:"):
            path = self.devices[int(what.split(":")[1])].log
        return path.read_text(errors="replace")[-n:] if path is not None and path.exists() else ""

    # ------------------------------------------------------------------------------------------------ stop
    def stop_devices(self, timeout_s: float = 30.0) -> None:
        procs = [d.proc for d in self.devices if d.proc is not None and d.proc.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        _wait_all(procs, timeout_s)

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            _wait_all([self.server], 30.0)

    def stop_proxy(self) -> dict[str, Any]:
        import json

        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            _wait_all([self.proxy], 10.0)
        path = self.root / "proxy.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    def close(self) -> None:
        """Kill whatever still runs (only the processes started here)."""
        for p in [*(d.proc for d in self.devices), self.server, self.proxy, self.broker, self.pg_forward]:
            _kill(p)
        if self._engine is not None:
            self._engine.dispose()
        self.witness.stop()
        self.http.close()


def _kill(p: subprocess.Popen[bytes] | None) -> None:
    if p is not None and p.poll() is None:
        p.kill()
        p.wait(30)


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
