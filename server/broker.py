"""The embedded MQTT 3.1.1 broker: amqtt in-process, on a free loopback port, in its own thread and event loop.

One command runs everything (DESIGN.md); deployments point ``broker_url`` at Mosquitto or EMQX instead. The
embedded broker holds retained messages and sessions in memory only: the server re-publishes every current task
when it starts, so a restart of both loses nothing that matters.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any

from amqtt.broker import Broker
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import Session

__all__ = ["EmbeddedBroker", "SessionAuthPlugin", "free_port"]

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SessionAuthPlugin(BaseAuthPlugin):
    """Lets every client in, like amqtt's AnonymousAuthPlugin, but without marking sessions anonymous: amqtt
    drops anonymous sessions on disconnect, which would break persistent sessions (clean_session False) and the
    QoS 1 messages queued for a device while it is away. The broker only listens on loopback."""

    @dataclass
    class Config:
        pass

    async def authenticate(self, *, session: Session) -> bool:
        session.is_anonymous = False
        return True


class EmbeddedBroker:
    """``start()`` returns ``mqtt://127.0.0.1:PORT``; ``stop()`` shuts the broker and its thread down."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broker: Broker | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the embedded broker is not started")
        return f"mqtt://{self.host}:{self.port}"

    def _config(self, port: int) -> dict[str, Any]:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{port}"}},
            # only what we need: no $SYS topics, no packet/event logging plugins
            "plugins": {f"{__name__}.SessionAuthPlugin": {}},
        }

    def start(self, timeout: float = 10.0) -> str:
        if self._thread is not None:
            return self.url
        port = self.port or free_port(self.host)
        loop = asyncio.new_event_loop()
        started = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)

            async def boot() -> None:
                self._broker = Broker(self._config(port), loop=loop)
                await self._broker.start()

            try:
                loop.run_until_complete(boot())
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
            self._thread = None
            raise RuntimeError(f"the embedded MQTT broker could not start on {self.host}:{port}: {error[0]}")
        self.port = port
        log.info("embedded MQTT broker on %s", self.url)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        loop, broker, thread = self._loop, self._broker, self._thread
        if loop is None or thread is None:
            return
        if broker is not None:
            fut = asyncio.run_coroutine_threadsafe(broker.shutdown(), loop)
            try:
                fut.result(timeout)
            except Exception as e:  # a failed shutdown must not keep the process alive
                log.warning("embedded broker shutdown: %s", e)

        async def drain() -> None:
            # let amqtt's own tasks finish, then stop the loop
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            asyncio.get_running_loop().stop()

        asyncio.run_coroutine_threadsafe(drain(), loop)
        thread.join(timeout)
        self._loop = self._broker = self._thread = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
