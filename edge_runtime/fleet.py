"""A whole federation on one machine: the server (with its embedded broker, or one by URL) and N device
processes drawn from a fleet, each a real ``pfl-edge client`` talking HTTP and MQTT over loopback. What
``pfl-edge demo`` runs; also used by the integration tests and the round-overhead benchmark."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from device_profiles import get_fleet
from pfl_edge.algorithms import algorithm_class
from pfl_edge.errors import ConfigError, PflEdgeError
from pfl_edge.federation import check_device_algorithm
from pfl_edge.protocol import API_PREFIX

if TYPE_CHECKING:
    from device_profiles import Profile

__all__ = ["DemoConfig", "Federation", "Launcher", "Placement", "free_port", "run_demo", "start_server"]

# what a device's command line becomes before it runs (edge_runtime.emulator: into its cgroups and namespace)
Launcher = Callable[[int, list[str]], list[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DemoConfig:
    devices: int = 6
    rounds: int = 10
    algorithm: str = "fedper"
    fleet: str = "mixed"
    out: str = "runs/demo"
    dataset: str = "fashion-mnist"
    partition: str = "pathological:2"
    seed: int = 0
    samples_per_client: int | None = 600
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    clip_norm: float | None = 10.0
    kp: int = 2
    density: float = 0.5
    topology: str | None = None
    profile_capacity: bool = True  # density and K_P from each device's profile
    broker_url: str = "embedded"
    database_url: str | None = None
    live: bool = True
    training_backend: str | None = "torch"  # None: each device's profile's backend
    deadline_s: float = 600.0
    timeout_s: float = 3600.0
    extra: dict[str, Any] = field(default_factory=dict)  # more federation config keys

    def __post_init__(self) -> None:
        if self.devices < 2:
            raise ConfigError(f"--devices must be >= 2, got {self.devices}")
        if self.rounds < 1:
            raise ConfigError(f"--rounds must be >= 1, got {self.rounds}")
        check_device_algorithm(self.algorithm)
        get_fleet(self.fleet)  # unknown fleets fail here, with the valid names

    def federation_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "algorithm": self.algorithm, "model": "cnn", "dataset": self.dataset, "partition": self.partition,
            "clients": self.devices, "rounds": self.rounds, "local_epochs": self.local_epochs,
            "batch_size": self.batch_size, "lr": self.lr, "clip_norm": self.clip_norm, "momentum": 0.9,
            "kp": self.kp, "density": self.density,
            "samples_per_client": self.samples_per_client, "seed": self.seed, "workers": 1,
        }
        if self.topology is not None:
            cfg["topology"] = self.topology
        if self.profile_capacity and algorithm_class(self.algorithm).has_masks():
            # recorded so that the simulator run of this config gives every client its device's density
            cfg["densities"] = list(get_fleet(self.fleet).densities())
        return {**cfg, **self.extra}


class Federation:
    """A running server process plus its device processes; ``close()`` stops them all."""

    def __init__(self, url: str, admin_token: str, server: subprocess.Popen[bytes], root: Path,
                 launch: tuple[list[str], dict[str, str]], device_url: str | None = None) -> None:
        self.url, self.admin_token, self.server, self.root = url, admin_token, server, root
        self.device_url = device_url or url  # the server as the devices reach it
        self._launch = launch
        self.http = httpx.Client(base_url=url, timeout=30.0)
        self.devices: list[subprocess.Popen[bytes]] = []
        self.fed = ""
        self.secret = ""

    def create(self, fed: str, config: dict[str, Any], **options: Any) -> None:
        self.fed, self.secret = fed, secrets.token_hex(16)  # hex: never a leading "-" that argparse takes for a flag
        body = {"id": fed, "enrol_secret": self.secret, "config": config, **options}
        r = self.http.post(f"{API_PREFIX}/federations", json=body,
                           headers={"Authorization": f"Bearer {self.admin_token}"})
        if r.status_code >= 400:
            raise ConfigError(f"the server refused the federation: {r.status_code} {r.text}")

    def start_device(self, i: int, profile: str, *, threads: int = 1, extra: list[str] | None = None,
                     source: Path | None = None, launcher: Launcher | None = None) -> None:
        """``pfl-edge client`` for slot ``i``; ``source``: run the agent of that source tree (a checkout of another
        release: its directory is the child's working directory and PYTHONPATH) instead of this one's;
        ``launcher``: the command line as it runs (the emulator's cgroups and network namespace)."""
        state = self.root / "devices" / f"device-{i:02d}"
        log = open(self.root / "devices" / f"device-{i:02d}.log", "ab")  # noqa: SIM115 (the child owns it)
        state.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pfl_edge", "client", "--server", self.device_url, "--federation", self.fed,
               f"--enrol-secret={self.secret}", "--profile", profile, "--state-dir", str(state),
               "--partition-id", str(i), "--threads", str(threads), "--name", f"device-{i:02d}", "-v",
               *(extra or [])]
        cmd = cmd if launcher is None else launcher(i, cmd)
        env = _child_env() if source is None else {**_child_env(), "PYTHONPATH": str(source)}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=source)
        if i < len(self.devices):
            self.devices[i] = proc  # a restart of device i (its state dir carries on)
        else:
            self.devices.append(proc)

    def restart_server(self, *, timeout_s: float = 120.0) -> None:
        """Kill the server without warning (SIGKILL: no shutdown, its embedded broker dies with it) and start
        it again on the same port and data: what a crashed and restarted server looks like to devices."""
        self.server.kill()
        self.server.wait()
        cmd, env = self._launch
        self.server = _spawn_server(cmd, env, self.root)
        _wait_healthy(self.url, self.server, self.root, timeout_s)

    def get(self, path: str) -> Any:
        r = self.http.get(path, headers={"Authorization": f"Bearer {self.admin_token}"})
        r.raise_for_status()
        return r.json()

    def info(self) -> dict[str, Any]:
        return dict(self.get(f"{API_PREFIX}/federations/{self.fed}"))

    def close(self) -> None:
        for p in [*self.devices, self.server]:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 15  # for them all: 24 devices stuck in a retry take 15 s, not 6 minutes
        for p in [*self.devices, self.server]:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.http.close()


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # one thread per process for the math libraries too: N devices share this machine's cores
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def start_server(root: Path, *, broker_url: str = "embedded", database_url: str | None = None,
                 timeout_s: float = 120.0, port: int | None = None, env: dict[str, str] | None = None,
                 device_url: str | None = None) -> Federation:
    """``pfl-edge server`` in a child process on a free loopback port (or ``port``), its data under
    ``root/server``; ``env``: more of its settings (PFL_*), ``device_url``: where devices reach it, if not
    where this process does (the emulator's relay)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "devices").mkdir(exist_ok=True)
    port = port or free_port()
    token = secrets.token_urlsafe(24)
    env = {**_child_env(), "PFL_ADMIN_TOKEN": token, "PFL_PUBLIC_URL": device_url or f"http://127.0.0.1:{port}",
           **(env or {})}
    cmd = [sys.executable, "-m", "pfl_edge", "server", "--port", str(port), "--data-dir", str(root / "server"),
           "--broker-url", broker_url]
    if database_url:
        cmd += ["--database-url", database_url]
    proc = _spawn_server(cmd, env, root)
    url = f"http://127.0.0.1:{port}"
    _wait_healthy(url, proc, root, timeout_s)
    return Federation(url, token, proc, root, (cmd, env), device_url)


def _spawn_server(cmd: list[str], env: dict[str, str], root: Path) -> subprocess.Popen[bytes]:
    log = open(root / "server.log", "ab")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], root: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PflEdgeError(f"the server exited with {proc.returncode}; see {root / 'server.log'}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise PflEdgeError(f"the server did not answer within {timeout_s:.0f} s; see {root / 'server.log'}")


class Placement:
    """Where the demo's processes run and when its devices come and go: here, on loopback, at this machine's
    speed, every device from start to end. ``edge_runtime.emulator.Emulation`` overrides each step."""

    def start_server(self, out: Path, cfg: DemoConfig) -> Federation:
        return start_server(out, broker_url=cfg.broker_url, database_url=cfg.database_url)

    def start_devices(self, fed: Federation, profiles: list[Profile], extra: list[str]) -> None:
        for i, prof in enumerate(profiles):
            fed.start_device(i, prof.name, extra=extra)

    def tick(self, fed: Federation, elapsed_s: float, finished: bool) -> set[int]:
        """Called at every poll; returns the devices stopped on purpose (not failures)."""
        return set()


def run_demo(cfg: DemoConfig, placement: Placement | None = None) -> dict[str, Any]:
    """Run the federation to its end, showing a live per-device table; write OUT/metrics.json, OUT/summary.json
    and OUT/accuracy.png. Returns the summary. ``placement``: the emulator's, for an emulated fleet."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = get_fleet(cfg.fleet).assign(cfg.devices)
    placement = placement or Placement()
    fed = placement.start_server(out, cfg)
    t0 = time.perf_counter()
    try:
        fed.create("demo", cfg.federation_config(), profile_capacity=cfg.profile_capacity,
                   deadline_s=cfg.deadline_s)
        print(f"server {fed.url}  federation 'demo': {cfg.algorithm}, {cfg.devices} devices of fleet "
              f"{cfg.fleet!r}, {cfg.rounds} rounds, {cfg.dataset} {cfg.partition}", flush=True)
        # the token rides in the fragment, which the browser never sends to the server
        print(f"dashboard: {fed.url}/dashboard#token={fed.admin_token}  (live while the demo runs)", flush=True)
        if cfg.training_backend is not None:
            print(f"every device trains with {cfg.training_backend} (pfl-edge demo --training-backend profile: "
                  "each with its profile's backend)", flush=True)
        placement.start_devices(fed, profiles, [] if cfg.training_backend is None
                                else ["--training-backend", cfg.training_backend])
        finished = _follow(fed, cfg, t0, placement)
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
    finally:
        fed.close()
    summary = _summarise(cfg, metrics, devices, finished, time.perf_counter() - t0)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    (out / "devices.json").write_text(json.dumps(devices, indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _plot(metrics, out / "accuracy.png", f"{cfg.algorithm}: {cfg.devices} devices ({cfg.fleet})")
    _report(out)
    print(_final_text(summary, out), flush=True)
    return summary


def _report(out: Path) -> None:
    """``pfl-edge report`` of the run folder, into OUT/report/ (what a person opens first)."""
    from pfl_edge.report import load_runs, summarise, write_report

    write_report(summarise(load_runs(out)[0]), out / "report")


def _follow(fed: Federation, cfg: DemoConfig, t0: float, placement: Placement) -> bool:
    """Poll the server until the federation finishes, a device process dies, or the time runs out."""
    tty = cfg.live and sys.stdout.isatty()
    last_round, lines = -1, 0
    deadline = time.monotonic() + cfg.timeout_s
    while time.monotonic() < deadline:
        info = fed.info()
        away = placement.tick(fed, time.perf_counter() - t0, info["state"] == "finished")
        devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
        metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
        table = device_table(devices, metrics)
        head = f"round {info['round']}/{cfg.rounds}  {info['state']}  {time.perf_counter() - t0:.0f} s"
        if tty:
            if lines:
                sys.stdout.write(f"\x1b[{lines}F\x1b[J")
            text = head + "\n" + table
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            lines = text.count("\n") + 1
        elif info["round"] != last_round:
            print(head, flush=True)
            last_round = info["round"]
        if info["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
            if not tty:
                print(table, flush=True)
            return True
        dead = [i for i, p in enumerate(fed.devices) if p.poll() not in (None, 0) and i not in away]
        if dead and info["state"] != "finished":
            raise PflEdgeError(f"device process(es) {dead} failed; see {fed.root / 'devices'}/device-NN.log")
        time.sleep(1.0)
    return False


def _latest(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per device id, its metrics of the latest round it reported."""
    latest: dict[str, dict[str, Any]] = {}
    for rnd in metrics.get("rounds", []):
        for dev, m in rnd.get("devices", {}).items():
            latest[dev] = {"round": rnd["round"], **m}
    return latest


def device_table(devices: list[dict[str, Any]], metrics: dict[str, Any]) -> str:
    from pfl_edge.table import format_table

    latest = _latest(metrics)
    rows = []
    for d in sorted(devices, key=lambda d: d["index"]):
        m = latest.get(d["device_id"], {})
        acc = m.get("accuracy")
        step = m.get("step_ms")
        rows.append([d.get("name") or d["device_id"][:8], d["profile"], f"{d['density']:.2f}", str(d["kp"]),
                     str(m.get("round", "-")), "-" if acc is None else f"{acc:.3f}",
                     _mb(d.get("bytes_up", 0)), _mb(d.get("bytes_down", 0)),
                     "-" if step is None else f"{step:.1f}", "online" if d.get("online") else "offline"])
    head = ["device", "profile", "density", "K_P", "round", "acc", "MB up", "MB down", "step ms", "status"]
    return format_table([head, *rows], rule=True)


def _mb(n: int | float) -> str:
    return f"{n / 1e6:.2f}"


def _summarise(cfg: DemoConfig, metrics: dict[str, Any], devices: list[dict[str, Any]], finished: bool,
               wall_s: float) -> dict[str, Any]:
    rounds = metrics.get("rounds", [])
    per_round = []
    for rnd in rounds:
        accs = [m["accuracy"] for m in rnd.get("devices", {}).values() if m.get("accuracy") is not None]
        train = [m["train_s"] for m in rnd.get("devices", {}).values() if m.get("train_s") is not None]
        per_round.append({"round": rnd["round"], "mean_acc": sum(accs) / len(accs) if accs else None,
                          "devices_reporting": len(accs), "wall_s": rnd.get("wall_s"),
                          "slowest_train_s": max(train) if train else None})
    last = next((r for r in reversed(per_round) if r["mean_acc"] is not None), None)
    return {"config": asdict(cfg), "finished": finished, "wall_s": wall_s,
            "final_mean_acc": None if last is None else last["mean_acc"], "rounds": per_round,
            "devices": devices}


def _final_text(summary: dict[str, Any], out: Path) -> str:
    acc = summary["final_mean_acc"]
    state = "finished" if summary["finished"] else "did NOT finish"
    return (f"\nfederation {state} in {summary['wall_s']:.0f} s; final mean device accuracy "
            f"{'-' if acc is None else f'{acc:.3f}'}. Report: {out}/report/report.html; run folder: {out}/ "
            "(metrics.json, summary.json, accuracy.png, server.log, devices/)")


def _plot(metrics: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for rnd in metrics.get("rounds", []):
        for dev, m in rnd.get("devices", {}).items():
            if m.get("accuracy") is not None:
                series.setdefault(dev, []).append((rnd["round"], m["accuracy"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for _, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], alpha=0.4, lw=1)
    by_round: dict[int, list[float]] = {}
    for pts in series.values():
        for r, a in pts:
            by_round.setdefault(r, []).append(a)
    xs = sorted(by_round)
    ax.plot(xs, [sum(by_round[r]) / len(by_round[r]) for r in xs], color="black", lw=2, label="mean")
    ax.set_xlabel("round")
    ax.set_ylabel("device test accuracy")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
