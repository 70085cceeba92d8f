"""The embedded MQTT 3.1.1 broker: ``server.broker_core`` in its own thread and event loop, on loopback by default.

One command runs everything (docs/design.md); deployments may point ``broker_url`` at Mosquitto or EMQX instead. Why a
small broker of our own instead of amqtt (the earlier default): amqtt 0.12 shared one session between two
connections with the same client id (after a network blip the device's live connection went deaf, silently) and
sent a subscriber of one exact topic every retained message of every federation; fixing that around the library
meant replacing its session handling, retained delivery and access plugins -- most of what it does for us. What
pfl-edge needs of MQTT (QoS 0/1, retained, wills, persistent sessions, takeover, keepalive, identities and topic
access rules, TLS) is ~500 lines that the tests here hold to MQTT 3.1.1 next to a real Mosquitto.

The broker holds retained messages and sessions in memory only: the server re-publishes every current task when
it starts, so a restart of both loses nothing that matters.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .broker_core import Authenticator, BrokerCore
from .broker_door import Door

__all__ = ["EmbeddedBroker", "free_port", "listening", "loopback"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_ANY_HOST = ("0.0.0.0", "::", "")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Does something accept TCP connections on ``host:port`` now?"""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    import ipaddress

    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class EmbeddedBroker:
    """``start()`` returns the broker's URL as this process reaches it (``mqtt://`` or, with a certificate,
    ``mqtts://``); ``stop()`` shuts the broker and its thread down. ``authenticate`` decides who may connect and
    what each may read and write (``server.broker_core``); None admits everyone to every topic (tests only).
    ``max_per_address``: connections one client address (an IPv6 one: its ``v6_prefix`` network) may hold open
    before they log in, loopback too; ``max_unauthenticated``: all addresses together (0: no bound; at a bound
    the oldest without a whole CONNECT is reset: ``server.broker_door``). Logged-in sessions count in neither."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *,
                 authenticate: Authenticator | None = None, tls_cert: Path | None = None,
                 tls_key: Path | None = None, max_per_address: int = 256, max_unauthenticated: int = 1024,
                 v6_prefix: int = 64) -> None:
        self.host = host
        self.port = port
        self.core = BrokerCore(authenticate, door=Door(max_per_address, max_unauthenticated, v6_prefix=v6_prefix))
        self._ssl = self._ssl_context(tls_cert, tls_key)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def _ssl_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise ValueError("the embedded broker's TLS needs both a certificate and its key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(cert), str(key))
        return ctx

    @property
    def tls(self) -> bool:
        return self._ssl is not None

    @property
    def url(self) -> str:
        """The broker as this process reaches it (a wildcard bind address is reached on 127.0.0.1)."""
        if self.port is None:
            raise RuntimeError("the embedded broker is not started")
        host = "127.0.0.1" if self.host in _ANY_HOST else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{'mqtts' if self.tls else 'mqtt'}://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> str:
        if self._thread is not None:
            return self.url
        port = self.port if self.port is not None else free_port("127.0.0.1" if self.host in _ANY_HOST else self.host)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(asyncio.start_server(
                    self.core.handle, self.host or None, port, ssl=self._ssl, reuse_address=True,
                    ssl_handshake_timeout=10.0 if self._ssl else None))
            except BaseException as e:  # reported to start()'s caller
                error.append(e)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="pfl-broker", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise RuntimeError(f"the embedded MQTT broker did not start within {timeout} s")
        if error:
            self._thread = self._loop = None
            raise RuntimeError(f"the embedded MQTT broker could not listen on {self.host}:{port}: {error[0]}")
        self.port = port
        log.info("embedded MQTT broker on %s:%d%s", self.host, port, " (TLS)" if self.tls else "")
        return self.url

    def call(self, fn: Callable[..., T], *args: object, timeout: float = 10.0) -> T:
        """``fn(*args)`` on the broker's loop (its state is that loop's alone), waited for."""
        if self._loop is None:
            raise RuntimeError("the embedded broker is not started")

        async def run() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def kick(self, username: str) -> int:
        """Close every connection of ``username`` now and forget its sessions (revocation)."""
        return self.call(self.core.kick, username)

    def stop(self, timeout: float = 10.0) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def down() -> None:
            if self._server is not None:
                self._server.close()
            self.core.close_all()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(down(), loop)
        thread.join(timeout)
        self._loop = self._server = self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
