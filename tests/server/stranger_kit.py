"""Helpers of the stranger tests (issues 33 and 49): TCP connections from any loopback address, a flood of silent
sockets from many addresses re-opened as the server closes them, a device's probes, and a fleet of enrolled
devices fetching its round's base at once from one address (a NAT's)."""

from __future__ import annotations

import resource
import select
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from server_testkit import SECRET, wait_for


def raise_nofile(want: int) -> None:
    """This process's descriptor limit up to ``want`` (skip the test where the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the descriptor limit {hard} is under the {want} this test's sockets need")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped at a full accept queue (Linux, all sockets; None elsewhere): a
    client whose SYN is dropped retries after 1 s, then 3 s, which is what a flood's churn costs a device."""
    try:
        names, values = [ln.split() for ln in Path("/proc/net/netstat").read_text().splitlines()
                         if ln.startswith("TcpExt:")][:2]
    except (OSError, ValueError):
        return None
    return int(dict(zip(names, values, strict=True)).get("ListenOverflows", 0))


def connect_from(source: str, addr: tuple[str, int], first: bytes = b"", *, wait: bool = True) -> socket.socket:
    """A TCP connection from ``source`` (any 127/8 address is this machine's loopback on Linux), non-blocking once
    made; ``wait``: connected (and ``first`` sent) before it returns. A connection the server resets at once may
    fail here already: it is returned all the same, and reads as closed."""
    s = socket.socket()
    s.bind((source, 0))
    if wait:
        s.settimeout(10)
        try:
            s.connect(addr)
            s.sendall(first)
        except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError):
            pass
    s.setblocking(False)
    if not wait:
        s.connect_ex(addr)
    return s


class Flood:
    """``n`` silent sockets from each of ``sources``; with ``reopen``, each is reopened from its address as soon
    as the server closes it (as the issue's attacker did), in a thread until ``close``."""

    def __init__(self, sources: Sequence[str], addr: tuple[str, int], n: int, *, reopen: bool) -> None:
        self.sources, self.addr, self.n, self.reopen = list(sources), addr, n, reopen
        self.opened = self.seen_closed = 0
        self.open_s = 0.0
        self.socks: dict[int, tuple[socket.socket, str]] = {}
        self.stop = threading.Event()
        self.poll = select.poll()
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def _open(self, source: str) -> None:
        s = connect_from(source, self.addr, wait=False)
        self.socks[s.fileno()] = (s, source)
        self.poll.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
        self.opened += 1

    def start(self) -> None:
        t0 = time.monotonic()
        for _ in range(self.n):
            for source in self.sources:
                self._open(source)
        self.open_s = time.monotonic() - t0
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for fd, _ev in self.poll.poll(100):  # readable or hung up: the server closed it (idle: nothing sent)
                s, source = self.socks.pop(fd)
                self.poll.unregister(fd)
                s.close()
                self.seen_closed += 1
                if self.reopen and not self.stop.is_set():
                    self._open(source)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for s, _ in self.socks.values():
            s.close()


def probe(url: str, headers: dict[str, str], n: int, source: str = "127.0.0.1") -> list[tuple[int | str, int | str,
                                                                                              float]]:
    """``n`` probes from ``source``, each on a fresh connection (as the issue's): /healthz and a device's task
    call, (status or the error's name, the same, seconds the two took)."""
    out: list[tuple[int | str, int | str, float]] = []
    for _ in range(n):
        a = time.monotonic()
        # generous: a loaded machine, a connect retried
        with httpx.Client(base_url=url, timeout=60, transport=httpx.HTTPTransport(local_address=source)) as c:
            h, t = _status(c, "/healthz", {}), _status(c, "/v1/rounds/current/task", headers)
        out.append((h, t, time.monotonic() - a))
    return out


def _status(c: httpx.Client, path: str, headers: dict[str, str]) -> int | str:
    try:
        return c.get(path, headers=headers).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def enrol(url: str, fed: str, n: int, first: int = 1) -> list[dict[str, str]]:
    """``n`` devices of ``fed`` enrolled, each from its own address (127.0.20.``first``...: enrolment's
    per-address bucket is not what is under test), 8 at a time; their Authorization headers."""
    def one(i: int) -> dict[str, str]:
        source = f"127.0.{20 + (first + i) // 250}.{(first + i) % 250 + 1}"
        with httpx.Client(base_url=url, timeout=120, transport=httpx.HTTPTransport(local_address=source)) as c:
            r = c.post("/v1/devices", json={"federation": fed, "enrol_secret": SECRET, "profile": "phone-mid"})
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['token']}"}

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


@dataclass
class Fetch:
    """One device's fetch of its round's base: the task call's status and the blob's (or the error's name), and
    seconds from the common start to the blob's last byte."""

    task: int | str
    blob: int | str
    seconds: float


def fetch_at_once(url: str, devices: Sequence[dict[str, str]], source: str) -> list[Fetch]:
    """Every device of ``devices`` (Authorization headers) from ``source``, a connection each, started together:
    its task (``GET /v1/rounds/current/task``), then its base blob on the same connection; each holds its
    connection until all are answered, so that they all stand at once."""
    start = threading.Barrier(len(devices), timeout=120)
    done = threading.Barrier(len(devices), timeout=300)
    got: list[Fetch | None] = [None] * len(devices)

    def one(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120, transport=httpx.HTTPTransport(local_address=source)) as c:
            start.wait()
            t0 = time.monotonic()
            task: int | str = "none"
            blob: int | str = "none"
            try:
                r = c.get("/v1/rounds/current/task", headers=devices[i])
                task = r.status_code
                if r.status_code == 200:
                    blob = _status(c, f"/v1/blobs/{r.json()['base']}", devices[i])
            except httpx.HTTPError as e:
                task = type(e).__name__
            got[i] = Fetch(task, blob, time.monotonic() - t0)
            done.wait()

    threads = [threading.Thread(target=one, args=(i,), name=f"device-{i}") for i in range(len(devices))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(600)
    wait_for(lambda: all(g is not None for g in got), timeout=1, what="every device's fetch")
    return [g for g in got if g is not None]


def summary(fetches: Sequence[Fetch]) -> str:
    counts: dict[tuple[int | str, int | str], int] = {}
    for f in fetches:
        counts[(f.task, f.blob)] = counts.get((f.task, f.blob), 0) + 1
    return (f"{len(fetches)} devices: (task, blob) statuses {dict(sorted(counts.items(), key=str))}, "
            f"slowest {max(f.seconds for f in fetches):.2f} s")
