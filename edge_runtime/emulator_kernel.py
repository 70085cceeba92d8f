"""The kernel objects of one emulated run, made and undone: per device a cgroup v1 ``cpu`` group (CFS quota and
period from its plan) and ``memory`` group (``memory.limit_in_bytes``), and a network namespace joined to a
bridge on the host by a veth pair shaped by ``tc tbf`` each way (the host's end: what the device receives; the
device's end: what it sends). Names carry the run's id, so that a run never meets a crashed one's leftovers;
each run records what it makes in /run/pfl-edge-emulate/<id>.json, and the next run undoes a dead run's
(``reap_stale``). Needs root and cgroup v1 controllers (``require_kernel`` names what is missing)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from pfl_edge.errors import PflEdgeError

from .emulation_plan import FleetPlan, tbf_args

__all__ = ["STATE_DIR", "EmulationUnavailable", "Kernel", "reap_stale", "require_kernel"]

STATE_DIR = Path("/run/pfl-edge-emulate")
CGROUPS = Path("/sys/fs/cgroup")
# each controller's file the emulator writes, which a kernel without that cgroup v1 controller lacks
NEEDED = {"cpu": "cpu.cfs_quota_us", "memory": "memory.limit_in_bytes"}
SHARES = 16 * 1024  # cpu.shares of a device's group: 16 times a plain task's


class EmulationUnavailable(PflEdgeError):
    """This machine cannot hold devices to their limits: the message names what is missing."""

    exit_code = 2


def require_kernel() -> None:
    """Root, cgroup v1 cpu (CFS bandwidth) and memory controllers, iproute2's ``ip`` and ``tc``; or an
    EmulationUnavailable naming each that is missing."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (it makes cgroups, network namespaces and veth links: run it as root, e.g. sudo)")
    for ctrl, f in NEEDED.items():
        if not (CGROUPS / ctrl / f).exists():
            missing.append(f"the cgroup v1 {ctrl} controller ({CGROUPS / ctrl / f} does not exist; a cgroup v2-only "
                           f"system has no such file)")
    missing += [f"iproute2's `{tool}` command" for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationUnavailable("pfl-edge emulate cannot run here: it needs " + "; ".join(missing))


def _run(*args: str) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise EmulationUnavailable(f"`{' '.join(args)}` failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


def _own_cgroup(ctrl: str) -> Path:
    """This process's group under controller ``ctrl``: the run's groups nest in it (within its limits)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if ctrl in ctrls.split(","):
            return CGROUPS / ctrl / path.lstrip("/")
    return CGROUPS / ctrl


def _used_octets() -> set[int]:
    text = _run("ip", "-4", "-o", "addr") + _run("ip", "-4", "route")
    used = {int(m) for m in re.findall(r"\b10\.(\d+)\.", text)}
    for f in STATE_DIR.glob("*.json") if STATE_DIR.exists() else []:
        try:
            used.add(int(json.loads(f.read_text())["octet"]))
        except (OSError, ValueError, KeyError):
            continue
    return used


class Kernel:
    """One run's bridge, namespaces, links and cgroups. ``setup()`` makes them, ``wrap(i, cmd)`` is the
    launcher that puts device i's process into them, ``teardown()`` undoes whatever exists (safe to repeat)."""

    def __init__(self, plan: FleetPlan, run_id: str | None = None) -> None:
        self.plan = plan
        self.id = run_id or secrets.token_hex(3)
        free = sorted(set(range(200, 255)) - _used_octets())
        if not free:
            raise EmulationUnavailable("no free 10.200-254.0.0/16 network for the emulated links")
        self.octet = free[0]
        self.bridge = f"pfe{self.id}"
        self.bridge_ip = f"10.{self.octet}.0.1"
        self.state_file = STATE_DIR / f"{self.id}.json"
        self.pids: list[int] = []  # processes of the run outside the device groups (its server)

    def netns(self, i: int) -> str:
        return f"pfe-{self.id}-{i}"

    def host_link(self, i: int) -> str:
        return f"pfe{self.id}h{i}"

    def device_ip(self, i: int) -> str:
        n = i + 2
        return f"10.{self.octet}.{n // 256}.{n % 256}"

    def cgroup(self, ctrl: str, i: int | None = None) -> Path:
        run = _own_cgroup(ctrl) / f"pfl-emulate-{self.id}"
        return run if i is None else run / f"device-{i:04d}"

    def record(self) -> dict[str, Any]:
        n = len(self.plan.devices)
        return {"id": self.id, "pid": os.getpid(), "octet": self.octet, "bridge": self.bridge,
                "bridge_ip": self.bridge_ip, "netns": [self.netns(i) for i in range(n)],
                "links": [self.host_link(i) for i in range(n)],
                "cgroups": [str(self.cgroup(c)) for c in NEEDED], "pids": self.pids}

    def note_process(self, pid: int) -> None:
        """Record a process the run started outside the device groups: a later run kills it if this one dies."""
        self.pids.append(pid)
        self.state_file.write_text(json.dumps(self.record()))

    def setup(self) -> None:
        """Make everything; on any failure undo what was made and raise."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.record()))  # first: a crash from here on is reaped later
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_ip}/16", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for ctrl in NEEDED:
                self.cgroup(ctrl).mkdir()
            for d in self.plan.devices:
                self._device(d.index)
        except BaseException:
            self.teardown()
            raise

    def _device(self, i: int) -> None:
        d = self.plan.devices[i]
        ns, host, peer = self.netns(i), self.host_link(i), f"pfe{self.id}d{i}"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", host, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", ns)
        _run("ip", "link", "set", host, "master", self.bridge)
        _run("ip", "link", "set", host, "up")
        _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{self.device_ip(i)}/16", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("tc", "qdisc", "add", "dev", host, "root", "tbf", *tbf_args(d.downlink_kbit))
        _run("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf_args(d.uplink_kbit))
        cpu, mem = self.cgroup("cpu", i), self.cgroup("memory", i)
        cpu.mkdir()
        (cpu / "cpu.cfs_period_us").write_text(str(d.period_us))
        (cpu / "cpu.cfs_quota_us").write_text(str(d.quota_us))
        # weight enough to reach the quota beside the host's other work (CI's CPU hogs): the quota is the ceiling
        (cpu / "cpu.shares").write_text(str(SHARES))
        mem.mkdir()
        (mem / "memory.limit_in_bytes").write_text(str(d.memory_bytes))
        if (mem / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit either
            (mem / "memory.memsw.limit_in_bytes").write_text(str(d.memory_bytes))

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """Device i's command line as it runs: the shell joins both cgroups before anything runs (its children
        inherit them), then becomes ``ip netns exec`` in the device's namespace, which becomes the command (one
        pid throughout: killing the process the launcher started kills the device)."""
        procs = [str(self.cgroup(c, i) / "cgroup.procs") for c in NEEDED]
        script = 'for f in "$1" "$2"; do echo $$ > "$f" || exit 97; done; shift 2; exec "$@"'
        return ["sh", "-c", script, "sh", *procs, "ip", "netns", "exec", self.netns(i), *cmd]

    def teardown(self) -> None:
        _undo(self.record())
        self.state_file.unlink(missing_ok=True)


def _kill_members(group: Path) -> None:
    """SIGKILL what is left in a run's device groups (its device processes) and wait until they are gone."""
    for procs in group.glob("device-*/cgroup.procs"):
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                pids = [int(p) for p in procs.read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)


def _kill_ours(pid: int) -> None:
    """SIGKILL ``pid`` if it is still a pfl-edge process (the run's server; not a stranger that took its pid)."""
    try:
        if b"pfl_edge" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def _undo(rec: dict[str, Any]) -> None:
    """Undo a run's record, whatever of it exists: processes, links (deleting one end deletes the pair at once; a
    namespace's own go with it only later, in the kernel's cleanup), namespaces, bridge, cgroups. Errors are
    collected and raised at the end, after every step was tried."""
    errors = []
    for pid in rec.get("pids", []):
        _kill_ours(int(pid))
    for g in rec["cgroups"]:
        _kill_members(Path(g))
    for link in rec.get("links", []):
        if Path("/sys/class/net", link).exists():
            out = subprocess.run(["ip", "link", "del", link], capture_output=True, text=True)
            if out.returncode:
                errors.append(out.stderr.strip())
    for ns in rec["netns"]:
        if Path("/run/netns", ns).exists():
            out = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if out.returncode:
                errors.append(out.stderr.strip())
    if Path("/sys/class/net", rec["bridge"]).exists():
        out = subprocess.run(["ip", "link", "del", rec["bridge"]], capture_output=True, text=True)
        if out.returncode:
            errors.append(out.stderr.strip())
    for g in map(Path, rec["cgroups"]):
        for d in [*sorted(g.glob("device-*")), g] if g.exists() else []:
            try:
                d.rmdir()
            except OSError as e:
                errors.append(f"rmdir {d}: {e}")
    if errors:
        raise EmulationUnavailable("could not undo all of emulation run " + rec["id"] + ": " + "; ".join(errors))


def reap_stale() -> list[str]:
    """Undo the runs recorded in STATE_DIR whose process is gone (a crash, a SIGKILL); their ids."""
    reaped = []
    for f in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        try:
            rec = json.loads(f.read_text())
            os.kill(int(rec["pid"]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError, KeyError):
            continue
        _undo(rec)
        f.unlink(missing_ok=True)
        reaped.append(str(rec["id"]))
    return reaped
