"""How the server is served (``uvicorn_config``: HTTPS, connection limits and timeouts), and whole servers on a
free port for tests and demos: ``start_background`` (a thread in this process) and ``start_subprocess`` (a
separate process, which can be killed for real)."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import h11
import httpx
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from pfl_edge.errors import InternalError

from .app import AppState, create_app
from .broker import free_port
from .peers import PeerLimit
from .ratelimit import install_flood_filter
from .settings import Settings, ensure_admin_token

__all__ = [
    "BackgroundServer",
    "PeerLimit",
    "SubprocessServer",
    "start_background",
    "start_subprocess",
    "uvicorn_config",
    "wait_healthy",
]

REPO_ROOT = Path(__file__).resolve().parent.parent

_log = logging.getLogger("uvicorn.error")  # where uvicorn's own lines about connections go


class _HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection from an address that already holds ``peers.cap`` open ones is
    reset at once, before uvicorn counts it (its ``limit_concurrency`` counts every open connection: 4,200 idle
    sockets of one stranger made every request 503); a new connection that sends no byte within
    ``first_byte_timeout_s`` is reset, and one that has not sent a whole request header within
    ``header_timeout_s`` (uvicorn bounds neither: a connection that sends nothing, or a header one byte a minute,
    held its descriptor forever). Between requests, uvicorn's keep-alive timeout applies as before."""

    header_timeout_s = 10.0
    first_byte_timeout_s = 5.0
    peers: ClassVar[PeerLimit] = PeerLimit(0)  # each server's subclass has its own (uvicorn_config)
    _header_timer: asyncio.TimerHandle | None = None
    _first_byte_timer: asyncio.TimerHandle | None = None
    _peer: str | None = None  # the address this connection counts against, until it is lost
    _gone = False  # refused, or handed to the WebSocket protocol: none of this connection is ours any more

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")  # cached by the transport: no system call
        if isinstance(peer, tuple) and peer:
            key = self.peers.admit(str(peer[0]))
            if key is None:
                # before uvicorn's own connection_made: never in its connections, no timer, no h11 state used
                self._gone = True
                _reset(transport)
                return
            self._peer = key
        super().connection_made(transport)
        if self._peer is not None:
            self.peers.hold(self, self._peer)
        self._arm()
        if not transport.is_closing():
            self._first_byte_timer = self.loop.call_later(self.first_byte_timeout_s, self._first_byte_timed_out)

    def _arm(self) -> None:
        if self._header_timer is None and not self._gone and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        if self._first_byte_timer is not None:
            self._first_byte_timer.cancel()
            self._first_byte_timer = None

    def data_received(self, data: bytes) -> None:
        if self._gone:
            return
        if self._first_byte_timer is not None:
            self._first_byte_timer.cancel()
            self._first_byte_timer = None
        super().data_received(data)
        if self._gone:  # upgraded to a WebSocket: the header timer must not close that connection later
            return
        if self.cycle is None or self.cycle.response_complete:
            self._arm()  # bytes of a request whose header is not complete yet
        else:
            self._disarm()
            self.peers.prove(self)  # a whole request header: a client, not a silent socket

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()  # idle between requests: the keep-alive timeout's business

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # the WebSocket protocol takes the transport, and its connection_lost is not ours: let go of it now
        self._disarm()
        self._release()
        self.peers.prove(self)
        self._gone = True
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._gone:  # refused (uvicorn never saw it), or no longer ours
            return
        self._disarm()
        self._release()
        self.peers.prove(self)
        super().connection_lost(exc)

    def unread(self) -> bool:
        """Whether bytes of this connection wait in the kernel, not read yet (FIONREAD): a request the loop has
        not come to, which ``PeerLimit`` does not take for a silent socket."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        waiting = array.array("i", [0])
        try:
            fcntl.ioctl(sock.fileno(), termios.FIONREAD, waiting)
        except (OSError, ValueError):  # closed meanwhile: nothing to spare
            return False
        return waiting[0] > 0

    def reset(self) -> None:
        """Evicted as the oldest connection without a request (``PeerLimit``): uncounted and reset now."""
        self._release()
        if not self._gone and self.transport is not None and not self.transport.is_closing():
            _reset(self.transport)

    def _release(self) -> None:
        if self._peer is not None:
            self.peers.release(self._peer)
            self._peer = None

    def _first_byte_timed_out(self) -> None:
        self._first_byte_timer = None
        if not self.transport.is_closing():
            _reset(self.transport)  # not a byte sent: nothing to answer, nothing to flush

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


def _proxies(spec: str) -> Callable[[str], bool]:
    """Whether an address is one of ``spec`` (``forwarded_allow_ips``: addresses or networks, comma-separated;
    ``*``: any), as uvicorn reads that setting."""
    items = {x.strip() for x in spec.split(",") if x.strip()}
    if "*" in items:
        return lambda _host: True
    nets = []
    for x in items:
        with contextlib.suppress(ValueError):  # not an address: compared as text
            nets.append(ipaddress.ip_network(x, strict=False))

    def proxy(host: str) -> bool:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return host in items
        return any(ip in net for net in nets)

    return proxy


def _reset(transport: asyncio.Transport) -> None:
    """Close a stranger's connection now, leaving nothing behind: a reset (SO_LINGER 0) leaves no TIME_WAIT
    socket in the kernel (a flood of refused connections made one each), and abort, not close, for a TLS close
    would wait for the stranger's close_notify."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _raise_nofile() -> None:
    """The descriptor limit up to its hard limit: each connection holds one (a 1,024 soft limit is ~1,000
    idle clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):  # a limit the platform refuses: serve with what there is
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def uvicorn_config(app: FastAPI, settings: Settings, host: str, port: int, *,
                   log_level: str = "info") -> uvicorn.Config:
    """How the server is served: HTTPS when ``tls_cert``/``tls_key`` are set; at most ``http_limit_concurrency``
    connections or tasks (more are answered 503), and at most ``http_max_connections_per_address`` open
    connections per TCP peer address but a trusted proxy's (more are reset at once, unread, uncounted by uvicorn;
    0: no limit); closed when a new connection sends no byte within ``http_first_byte_timeout_s``, a request
    header takes longer than ``http_header_timeout_s`` or a kept-alive connection idles ``http_keep_alive_s``;
    headers bounded by ``http_max_header_bytes``; and log lines about an exhausted descriptor table at most one
    per 10 s."""
    _raise_nofile()
    proto = type("PflH11Protocol", (_HeaderTimeout,), {  # a class per server: its own count of peers
        "header_timeout_s": settings.http_header_timeout_s,
        "first_byte_timeout_s": settings.http_first_byte_timeout_s,
        "peers": PeerLimit(settings.http_max_connections_per_address, _proxies(settings.forwarded_allow_ips),
                           settings.http_ipv6_prefix, settings.http_max_unproven_connections)})
    cfg = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on", http=proto,
        limit_concurrency=settings.http_limit_concurrency, backlog=settings.http_backlog,
        timeout_keep_alive=settings.http_keep_alive_s,  # type: ignore[arg-type]  # a float works as well
        h11_max_incomplete_event_size=settings.http_max_header_bytes,
        # X-Forwarded-For only from the configured balancer (uvicorn's default trusts 127.0.0.1: any local client)
        proxy_headers=bool(settings.forwarded_allow_ips), forwarded_allow_ips=settings.forwarded_allow_ips,
        ssl_certfile=settings.tls_cert, ssl_keyfile=settings.tls_key)
    install_flood_filter()  # after uvicorn configured its loggers
    return cfg


def wait_healthy(url: str, timeout: float, alive: object = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if callable(alive) and not alive():
            raise RuntimeError(f"the server at {url} exited while starting")
        try:
            # only whether it answers: the caller verifies the server's certificate when it talks to it
            if httpx.get(f"{url}/healthz", timeout=2, verify=False).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.05)
    raise RuntimeError(f"the server at {url} did not become healthy within {timeout} s ({last})")


@dataclass
class BackgroundServer:
    """A server in a thread of this process. ``url``: its HTTP root; ``state``: the app's AppState."""

    url: str
    admin_token: str
    server: uvicorn.Server
    thread: threading.Thread
    app_state: AppState | None = field(default=None)

    @property
    def broker_url(self) -> str:
        if self.app_state is None:
            raise InternalError("a background server without its app state")
        return self.app_state.broker_url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_background(settings: Settings, host: str = "127.0.0.1", port: int | None = None, *,
                     timeout: float = 30.0) -> BackgroundServer:
    """Start the server (and its embedded broker, if configured) in a thread on a free port; returns once
    ``/healthz`` answers. ``settings.public_url`` is set to the real URL."""
    port = port or free_port(host)
    url = f"{settings.scheme}://{host}:{port}"
    settings = ensure_admin_token(settings.model_copy(update={"public_url": url}), announce=False)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings, host, port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="pfl-server", daemon=True)
    thread.start()
    wait_healthy(url, timeout, thread.is_alive)
    if settings.admin_token is None:
        raise InternalError("ensure_admin_token left no admin token")
    return BackgroundServer(url, settings.admin_token.get_secret_value(), server, thread, app.state.pfl)


@dataclass
class SubprocessServer:
    url: str
    admin_token: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL: no shutdown at all, as a crash or a power cut."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM: a clean shutdown."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def start_subprocess(env: dict[str, str], host: str = "127.0.0.1", port: int | None = None, *,
                     timeout: float = 60.0, nofile: int | None = None, log: Path | None = None) -> SubprocessServer:
    """Start ``python -m server.main`` with settings from ``env`` (``PFL_*``; ``PFL_ADMIN_TOKEN`` required);
    ``nofile``: its descriptor limit (soft and hard); ``log``: where its output goes."""
    if "PFL_ADMIN_TOKEN" not in env:
        raise ValueError("start_subprocess needs PFL_ADMIN_TOKEN in env")
    port = port or free_port(host)
    url = f"{'https' if env.get('PFL_TLS_CERT') else 'http'}://{host}:{port}"
    full = {**os.environ, "PFL_PUBLIC_URL": url, **env}  # env may name another public URL (a load balancer's)
    # the repository root on the path, whether or not the package is installed
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    out = open(log, "ab") if log is not None else None  # noqa: SIM115  # the child holds it; closed below
    try:
        proc = subprocess.Popen([sys.executable, "-m", "server.main", "--host", host, "--port", str(port),
                                 "--log-level", "warning"], env=full, preexec_fn=limit if nofile else None,
                                stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out is not None:
            out.close()
    try:
        wait_healthy(url, timeout, lambda: proc.poll() is None)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return SubprocessServer(url, env["PFL_ADMIN_TOKEN"], proc)
