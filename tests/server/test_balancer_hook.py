"""The load balancer's two listeners (``server.balancer.haproxy_config`` with ``hook_bind``): the devices' port
never passes the broker hook's paths, however they are spelt, and adds the device's address; the hook's own port
passes nothing else. And the replicas believe that address only from the configured balancer
(``forwarded_allow_ips``)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest
from fastapi import FastAPI

from server.balancer import HAPROXY, haproxy_config
from server.broker import free_port
from server.launch import uvicorn_config
from server.settings import Settings


class _Backend(BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, list[str]]]] = []  # (path, X-Forwarded-For) of every request it got

    def _answer(self) -> None:
        self.seen.append((self.path, self.headers.get_all("X-Forwarded-For") or []))
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = _answer

    def log_message(self, *_a: Any) -> None:
        pass


def _status(port: int, method: str, path: str, headers: str = "", source: str = "127.0.0.1") -> int:
    """The status of one raw request (the path sent byte for byte, as a client could)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n{headers}\r\n"
                  .encode())
        got = b""
        while b"\r\n" not in got:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
    return int(got.split(b" ", 2)[1])


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[tuple[int, int]]:
    if HAPROXY is None:
        pytest.skip("haproxy is not installed")
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    public, hook = free_port(), free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(f"127.0.0.1:{public}", [f"127.0.0.1:{backend.server_address[1]}"],
                                  hook_bind=f"127.0.0.1:{hook}"))
    check = subprocess.run([HAPROXY, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:  # both listeners up and the backend seen healthy
            try:
                if _status(public, "GET", "/healthz") == 200 and _status(hook, "POST", "/v1/broker/hook/t/user") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "haproxy did not come up"
            time.sleep(0.05)
        _Backend.seen.clear()
        yield public, hook
    finally:
        proc.terminate()
        proc.wait(10)
        backend.shutdown()


def test_the_devices_port_refuses_the_hook_and_the_hooks_port_serves_only_it(balancer: tuple[int, int]) -> None:
    public, hook = balancer
    for path in ("/v1/broker/hook/tok/user", "/v1/broker/%68ook/tok/user", "/v1/broker/hook/%74ok/topic",
                 "/v1%2Fbroker/hook/tok/user"):
        assert _status(public, "POST", path) == 404, path
    assert _Backend.seen == []  # none of them reached a replica
    for path in ("/healthz", "/v1/federations", "/v1/broker/hoo/tok/user", "/"):
        assert _status(hook, "GET", path) == 404, path
    assert _Backend.seen == []
    assert _status(hook, "POST", "/v1/broker/hook/tok/user") == 200
    assert _status(public, "GET", "/v1/federations") == 200
    assert [p for p, _ in _Backend.seen] == ["/v1/broker/hook/tok/user", "/v1/federations"]


def test_the_devices_port_adds_the_devices_address(balancer: tuple[int, int]) -> None:
    public, _ = balancer
    assert _status(public, "GET", "/healthz", "X-Forwarded-For: 6.6.6.6\r\n", source="127.0.0.2") == 200
    (_, forwarded), = _Backend.seen
    assert ", ".join(forwarded).split(", ")[-1] == "127.0.0.2"  # the last one: HAProxy's, whatever came before


def _client_seen(settings: Settings, peer: str, forwarded: str) -> str:
    """The client address the app sees for a request from ``peer`` that says X-Forwarded-For ``forwarded``."""
    seen: list[str] = []

    async def app(scope: dict[str, Any], _receive: Any, _send: Any) -> None:
        seen.append(scope["client"][0])

    cfg = uvicorn_config(cast(FastAPI, app), settings, "127.0.0.1", 1)
    cfg.load()  # the app as uvicorn serves it, behind its proxy-headers middleware if configured
    scope = {"type": "http", "client": (peer, 5000), "headers": [(b"x-forwarded-for", forwarded.encode())]}
    asyncio.run(cfg.loaded_app(scope, None, None))
    return seen[0]


def test_replicas_believe_a_forwarded_address_only_from_the_configured_balancer() -> None:
    trusting = Settings(forwarded_allow_ips="10.0.0.5")
    assert _client_seen(trusting, "10.0.0.5", "6.6.6.6, 192.0.2.7") == "192.0.2.7"  # the balancer's word
    assert _client_seen(trusting, "10.0.0.9", "192.0.2.7") == "10.0.0.9"  # anyone else's: ignored
    assert _client_seen(Settings(), "127.0.0.1", "192.0.2.7") == "127.0.0.1"  # the default believes nobody
