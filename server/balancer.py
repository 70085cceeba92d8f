"""The load balancer in front of server replicas: HAProxy's configuration (``haproxy_config``: what
``docker/haproxy.cfg`` holds for compose's replicated profile, and what the tests and benchmarks run), and a
private HAProxy process for them (``start_haproxy``).

Devices see one URL. HAProxy sends each request to a replica that answers ``/healthz`` (checked every second;
two failures take a replica out, one success puts it back), round robin. A request whose connection to a replica
fails (a replica that has just died) is sent to another (``retry-on conn-failure`` with ``option redispatch``);
one that fails after its body was sent is the device's to retry, as against a single server (every write of the
protocol is idempotent: docs/protocol.md). HAProxy adds the device's address (``option forwardfor``), which a
replica believes only from the balancer (``forwarded_allow_ips``); a replica never caps the balancer's
connections, so the devices' port limits each source address itself (``SourceLimits``: a stick-table of
connections open and requests without a token, set so that a fleet behind one NAT address passes). A broker
that asks the replicas' HTTP hook (RabbitMQ) reaches it on a listener of its own, ``hook_bind``, which serves
nothing else; the devices' listener then refuses the hook's paths, so the hook's token is no use from the
devices' network."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from pfl_edge.errors import ConfigError

from .broker import free_port
from .launch import SubprocessServer, start_subprocess

__all__ = ["Haproxy", "Replicas", "SourceLimits", "haproxy_config", "start_haproxy", "start_replicas"]

HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)


@dataclass(frozen=True)
class SourceLimits:
    """What one source address may do at the devices' port (an IPv6 one counted by its /64, as a replica counts
    its peers: one client holds a /64). ``connections``: open at once, silent ones included (more are refused at
    accept, before a byte is read); HAProxy cannot tell a device's new connection from a stranger's silent one
    before its request, so the bound is high enough for a fleet behind one NAT address to pass (issue 49: 100
    devices fetching at once) and low enough that a few sources cannot fill ``maxconn``. ``unsigned_per_10s``:
    requests without an ``Authorization`` header (enrolment, ``/healthz``, strangers') in 10 s, more answered
    429 by HAProxy; a request with one is never refused for its source's count."""

    connections: int = 1000
    unsigned_per_10s: int = 300

    def lines(self) -> list[str]:
        signed = "{ req.hdr(authorization) -m found }"
        return [
            "    # per source address, an IPv6 one by its /64: connections open, opened in 10 s, requests in 10 s,",
            "    # requests without Authorization in 10 s (gpc0)",
            "    stick-table type ipv6 size 100k expire 30s store conn_cur,conn_rate(10s),http_req_rate(10s),"
            "gpc0_rate(10s)",
            "    tcp-request connection track-sc0 src,ipmask(32,64)",
            f"    # more than {self.connections} open from one source: refused at accept (a stranger's silent sockets"
            " bounded,",
            f"    # a fleet behind one NAT address passes while it holds {self.connections} or fewer)",
            f"    tcp-request connection reject if {{ sc_conn_cur(0) gt {self.connections} }}",
            f"    # requests without a token past {self.unsigned_per_10s} in 10 s from one source: 429 here; signed"
            " ones never refused for it",
            f"    http-request sc-inc-gpc0(0) unless {signed}",
            f"    http-request deny deny_status 429 if !{signed} {{ sc_gpc0_rate(0) gt {self.unsigned_per_10s} }}",
        ]


def haproxy_config(bind: str, servers: Sequence[str], *, max_body_s: int = 300,
                   mode: Literal["http", "tcp"] = "http", dns: str | None = None, hook_bind: str | None = None,
                   maxconn: int = 4096, per_source: SourceLimits | None = SourceLimits()) -> str:
    """HAProxy's configuration: listen on ``bind`` (``host:port``), balance over ``servers`` (``host:port``
    each). ``max_body_s``: the longest a request or response may take (a large model's upload on a slow link).
    ``mode="tcp"``: connections balanced as they are (MQTT over a broker cluster's nodes; each connection stays
    on its node for its life). ``dns``: a name server (``host:port``) that HAProxy asks again at run time, where
    replicas are names whose addresses change; ``"resolv.conf"``: the ones /etc/resolv.conf names (a container's:
    Docker's ``127.0.0.11``, podman's network gateway). ``hook_bind``: the broker hook's own listener (only
    ``/v1/broker/hook/``; ``bind`` then answers those paths 404, percent-encoded ones too, as the replicas decode
    them). ``maxconn``: connections held at once (more wait in HAProxy's queue, and time out there; each takes two
    open files). ``per_source``: the devices' port's limits per source address (None: none)."""
    if not servers:
        raise ConfigError("a load balancer needs at least one server")
    if mode == "tcp":
        lines = ["global", f"    maxconn {maxconn}", "", "defaults", "    mode tcp", "    timeout connect 2s",
                 "    timeout client 1h", "    timeout server 1h", "", "frontend mqtt", f"    bind {bind}",
                 "    default_backend nodes", "", "backend nodes", "    balance roundrobin"]
        lines += [f"    server n{i} {addr} check inter 1s fall 2 rise 1" for i, addr in enumerate(servers)]
        return "\n".join(lines) + "\n"
    lines = [
        "global", f"    maxconn {maxconn}",  # each needs two descriptors (client and server side)
        "",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        f"    timeout client {max_body_s}s",
        f"    timeout server {max_body_s}s",
        "    timeout http-request 10s",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response response-timeout",
        "    option forwardfor",  # the device's address, for the replicas' per-address limits
        "",
        "frontend pfl",
        f"    bind {bind}",
        *(per_source.lines() if per_source is not None else []),
    ]
    hook = "{ path,url_dec -m beg /v1/broker/hook/ }"
    if hook_bind:
        lines += [f"    http-request deny deny_status 404 if {hook}", "    default_backend replicas", "",
                  "frontend hook", f"    bind {hook_bind}", f"    http-request deny deny_status 404 unless {hook}"]
    lines += [
        "    default_backend replicas",
        "",
        "backend replicas",
        "    balance roundrobin",
        "    option httpchk GET /healthz",
        "    http-check expect status 200",
        # a busy replica answers late, not never (at 1 s, 2,000 uploads got the only one marked down: all 503);
        # a dead one refuses the connection at once and its calls are redispatched, so waiting costs little
        "    timeout check 10s",
        "    default-server init-addr last,libc,none",  # a replica's name that does not resolve yet: down, not fatal
    ]
    res = " resolvers dns" if dns else ""
    lines += [f"    server r{i} {addr} check inter 1s fall 2 rise 1{res}" for i, addr in enumerate(servers)]
    if dns:
        server = "    parse-resolv-conf" if dns == "resolv.conf" else f"    nameserver dns1 {dns}"
        lines += ["", "resolvers dns", server, "    hold valid 10s"]
    return "\n".join(lines) + "\n"


@dataclass
class Haproxy:
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_haproxy(folder: Path, port: int, servers: Sequence[str], *, timeout_s: float = 15.0,
                  mode: Literal["http", "tcp"] = "http", maxconn: int = 4096,
                  per_source: SourceLimits | None = SourceLimits()) -> Haproxy:
    """A private HAProxy on 127.0.0.1:``port`` in front of ``servers`` (``haproxy_config``'s, the shipped limits
    per source unless ``per_source`` says otherwise); returns once it accepts connections. ConfigError where
    HAProxy is not installed (Debian: ``apt-get install haproxy``)."""
    if HAPROXY is None:
        raise ConfigError("haproxy is not installed (Debian: apt-get install haproxy)")
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / "haproxy.cfg"
    cfg.write_text(haproxy_config(f"127.0.0.1:{port}", servers, mode=mode, maxconn=maxconn, per_source=per_source))
    log = open(folder / "haproxy.log", "ab")  # noqa: SIM115  (the child owns it)
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"haproxy exited with {proc.returncode}; see {folder / 'haproxy.log'}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return Haproxy(proc, f"http://127.0.0.1:{port}")
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise ConfigError(f"haproxy did not listen on port {port} within {timeout_s:.0f} s")


@dataclass
class Replicas:
    """``n`` server processes on one database, broker and blob directory, behind a private HAProxy: what the
    tests and benchmarks of replicas run (``start_replicas``). Devices are given :attr:`url`."""

    folder: Path
    env: dict[str, str]
    ports: list[int]
    servers: list[SubprocessServer | None]
    balancer: Haproxy | None = None

    @property
    def url(self) -> str:
        if self.balancer is None:
            raise ConfigError("the replicas' load balancer is not running")
        return self.balancer.url

    @property
    def admin_token(self) -> str:
        return self.env["PFL_ADMIN_TOKEN"]

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def leader_of(self, fed_id: str) -> int | None:
        """The replica whose ``/metrics`` says it leads ``fed_id`` now (``pfl_federation_led``), or None."""
        want = f'pfl_federation_led{{federation="{fed_id}"}} 1.0'
        for i, srv in enumerate(self.servers):
            if srv is None or srv.proc.poll() is not None:
                continue
            try:
                r = httpx.get(f"{self.replica_url(i)}/metrics", timeout=15.0,
                              headers={"Authorization": f"Bearer {self.admin_token}"})
            except httpx.TransportError:
                continue
            if r.status_code == 200 and want in r.text.splitlines():
                return i
        return None

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i``: no shutdown, its database session (and leadership) dies with it."""
        srv = self.servers[i]
        if srv is not None:
            srv.kill()
            self.servers[i] = None

    def start(self, i: int, timeout_s: float = 120.0) -> None:
        """(Re)start replica ``i`` on its port and data dir."""
        env = {**self.env, "PFL_DATA_DIR": str(self.folder / f"replica-{i}")}
        self.servers[i] = start_subprocess(env, port=self.ports[i], timeout=timeout_s,
                                           log=self.folder / f"replica-{i}.log")

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for srv in self.servers:
            if srv is not None:
                srv.stop()


def start_replicas(folder: Path, n: int, env: dict[str, str], *, timeout_s: float = 120.0,
                   port: int | None = None) -> Replicas:
    """``n`` replicas (``python -m server.main`` with ``env``: ``PFL_ADMIN_TOKEN``, ``PFL_DATABASE_URL`` of a
    PostgreSQL database, ``PFL_BROKER_URL`` of an external broker) sharing ``folder/blobs``, behind HAProxy; each
    tells devices the balancer's URL (on ``port``, default a free one). ConfigError where HAProxy is missing."""
    if HAPROXY is None:
        raise ConfigError("haproxy is not installed (Debian: apt-get install haproxy)")
    folder.mkdir(parents=True, exist_ok=True)
    ports, lb = [free_port() for _ in range(n)], port or free_port()
    # the replicas believe the devices' addresses that their HAProxy, on loopback, adds
    env = {"PFL_BLOB_DIR": str(folder / "blobs"), "PFL_FORWARDED_ALLOW_IPS": "127.0.0.1", **env,
           "PFL_PUBLIC_URL": f"http://127.0.0.1:{lb}"}
    reps = Replicas(folder, env, ports, [None] * n)
    try:
        for i in range(n):
            reps.start(i, timeout_s)
        # every device of a test or benchmark is 127.0.0.1: one source, thousands of devices
        reps.balancer = start_haproxy(folder / "haproxy", lb, [f"127.0.0.1:{p}" for p in ports], per_source=None)
    except BaseException:
        reps.stop()
        raise
    return reps
