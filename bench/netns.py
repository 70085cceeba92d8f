"""Network namespaces for fault tests: a server namespace and one namespace per device, each device joined to the
server's by its own veth link, plus a management link from the caller's namespace to the server's (never
faulted: the soak's driver reads the server through it).

Addresses: the server's services answer on one service address (``SERVICE_IP``, on the server namespace's
loopback), which every device reaches through its own link (device i: 10.231.(10+i).2 -> 10.231.(10+i).1), so a
single URL handed out at enrolment works for all of them. A link set down is a partition (the server's end of
the veth is set down: the device's end keeps its address and route, its packets vanish, as on a real network);
``tc qdisc ... tbf`` on both ends limits bandwidth. Every name carries the prefix, and ``close()`` (also at
exit) removes what was made."""

from __future__ import annotations

import atexit
import shutil
import subprocess
from dataclasses import dataclass, field

__all__ = ["MGMT_IP", "SERVICE_IP", "Netns", "available", "unavailable_reason"]

SERVICE_IP = "10.231.255.1"  # the server's services, as devices reach them
MGMT_IP = "10.231.0.2"  # the server namespace, as the caller reaches it (10.231.0.1 is the caller's end)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (None: they can)."""
    import os

    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = "pflprobe-ns"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` fails here: {getattr(e, 'stderr', '') or e}"
    _ip("netns", "del", probe, check=False)
    return None


def available() -> bool:
    return unavailable_reason() is None


@dataclass
class Netns:
    """``prefix``: at most 6 characters (interface names are at most 15)."""

    prefix: str = "pflsk"
    devices: int = 3
    rate: str | None = None  # e.g. "20mbit": tbf on every device link, both directions
    made: list[str] = field(default_factory=list)  # namespaces made
    host_link: str = ""

    @property
    def host_ip(self) -> str:
        """The caller's end of the management link, as the server's namespace reaches it."""
        return "10.231.0.1"

    @property
    def server_ns(self) -> str:
        return f"{self.prefix}-srv"

    def device_ns(self, i: int) -> str:
        return f"{self.prefix}-d{i}"

    def _srv_if(self, i: int) -> str:
        return f"{self.prefix}{i}s"

    def _dev_if(self, i: int) -> str:
        return f"{self.prefix}{i}d"

    def exec_prefix(self, ns: str) -> list[str]:
        """Prepend to a command to run it in ``ns`` (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", ns]

    def create(self) -> Netns:
        atexit.register(self.close)
        self.close()  # leftovers of a killed run with the same prefix
        srv = self.server_ns
        self._add_ns(srv)
        _ip("-n", srv, "addr", "add", f"{SERVICE_IP}/32", "dev", "lo")
        # the management link: caller <-> server namespace
        self.host_link = f"{self.prefix}m"
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", f"{self.prefix}ms")
        _ip("link", "set", f"{self.prefix}ms", "netns", srv)
        _ip("addr", "add", "10.231.0.1/24", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")
        _ip("-n", srv, "addr", "add", f"{MGMT_IP}/24", "dev", f"{self.prefix}ms")
        _ip("-n", srv, "link", "set", f"{self.prefix}ms", "up")
        for i in range(self.devices):
            self._add_device(i)
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _add_device(self, i: int) -> None:
        ns, s_if, d_if = self.device_ns(i), self._srv_if(i), self._dev_if(i)
        self._add_ns(ns)
        _ip("-n", self.server_ns, "link", "add", s_if, "type", "veth", "peer", "name", d_if, "netns", ns)
        _ip("-n", self.server_ns, "addr", "add", f"10.231.{10 + i}.1/24", "dev", s_if)
        _ip("-n", ns, "addr", "add", f"10.231.{10 + i}.2/24", "dev", d_if)
        _ip("-n", self.server_ns, "link", "set", s_if, "up")
        _ip("-n", ns, "link", "set", d_if, "up")
        _ip("-n", ns, "route", "add", SERVICE_IP, "via", f"10.231.{10 + i}.1")
        if self.rate is not None:
            self.set_rate(i, self.rate)

    # ------------------------------------------------------------------------------------------------ faults
    def partition(self, i: int) -> None:
        """Device i cut off: the server's end of its link down."""
        _ip("-n", self.server_ns, "link", "set", self._srv_if(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.server_ns, "link", "set", self._srv_if(i), "up")

    def blackhole(self, i: int) -> None:
        """Device i cut off silently: its link stays up but drops every packet both ways (a token bucket whose
        burst, 10 B, no packet fits in; this kernel has no netem and no drop action). Connections stall and
        retransmit, as across a real silent partition; ``restore`` ends it."""
        self._tbf(i, ["rate", "8bit", "burst", "10", "limit", "1"])

    def restore(self, i: int) -> None:
        """Device i's link back to its normal rate (or no limit)."""
        if self.rate is not None:
            self.set_rate(i, self.rate)
            return
        for ns, dev in ((self.server_ns, self._srv_if(i)), (self.device_ns(i), self._dev_if(i))):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    def _tbf(self, i: int, args: list[str]) -> None:
        for ns, dev in ((self.server_ns, self._srv_if(i)), (self.device_ns(i), self._dev_if(i))):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", *args],
                           capture_output=True, text=True, check=True, timeout=30)

    def set_rate(self, i: int, rate: str) -> None:
        """Device i's link limited to ``rate`` both ways (token bucket; ``tc qdisc replace``)."""
        self._tbf(i, ["rate", rate, "burst", "64kb", "latency", "500ms"])

    # ------------------------------------------------------------------------------------------------ cleanup
    def close(self) -> None:
        """Remove every namespace of this prefix (their veths go with them) and the management link."""
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        names = {line.split()[0] for line in listed if line.strip()}
        for ns in sorted(n for n in names if n.startswith(f"{self.prefix}-")):
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", f"{self.prefix}m", check=False)
        self.made.clear()

    def __enter__(self) -> Netns:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()
