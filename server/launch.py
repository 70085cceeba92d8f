"""Whole servers on a free port, for tests and demos (not part of the server itself): ``start_background`` (a
thread in this process) and ``start_subprocess`` (a separate process, which can be killed for real)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from pfl_edge.errors import InternalError

from .app import AppState, create_app
from .broker import free_port
from .settings import Settings, ensure_admin_token

__all__ = ["BackgroundServer", "SubprocessServer", "start_background", "start_subprocess"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def _wait_healthy(url: str, timeout: float, alive: object = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if callable(alive) and not alive():
            raise RuntimeError(f"the server at {url} exited while starting")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
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
    url = f"http://{host}:{port}"
    settings = ensure_admin_token(settings.model_copy(update={"public_url": url}), announce=False)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="pfl-server", daemon=True)
    thread.start()
    _wait_healthy(url, timeout, thread.is_alive)
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
                     timeout: float = 60.0) -> SubprocessServer:
    """Start ``python -m server.main`` with settings from ``env`` (``PFL_*``; ``PFL_ADMIN_TOKEN`` required)."""
    if "PFL_ADMIN_TOKEN" not in env:
        raise ValueError("start_subprocess needs PFL_ADMIN_TOKEN in env")
    port = port or free_port(host)
    url = f"http://{host}:{port}"
    full = {**os.environ, **env, "PFL_PUBLIC_URL": url}
    # the repository root on the path, whether or not the package is installed
    full["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "server.main", "--host", host, "--port", str(port),
                             "--log-level", "warning"], env=full)
    try:
        _wait_healthy(url, timeout, lambda: proc.poll() is None)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return SubprocessServer(url, env["PFL_ADMIN_TOKEN"], proc)
