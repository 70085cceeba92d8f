"""The device's HTTP client: JSON and blob calls to the server with retries and back-off."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import httpx

from pfl_edge.errors import PflEdgeError

__all__ = ["Http", "ServerError", "ServerUnavailable"]

log = logging.getLogger("pfl_edge.client")


class ServerError(PflEdgeError):
    """The server refused a request (a 4xx answer): a user error, shown with the server's reason."""

    exit_code = 6

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailable(PflEdgeError):
    """The server could not be reached within the agent's patience."""

    exit_code = 7


class Http:
    """JSON and blob calls with retries: connection failures and 5xx answers back off (0.5 s doubling to 10 s)
    until ``patience_s``; a 4xx answer is the caller's error and raises ``ServerError`` at once."""

    def __init__(self, base: str, patience_s: float) -> None:
        self.client = httpx.Client(base_url=base.rstrip("/"), timeout=60.0)
        self.patience_s = patience_s
        self.token: str | None = None
        self.stop = threading.Event()

    def call(self, method: str, path: str, *, json_body: Any = None, content: bytes | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        deadline = time.monotonic() + self.patience_s
        delay = 0.5
        while True:
            why: str
            try:
                r = self.client.request(method, path, json=json_body, content=content, headers=headers)
                if r.status_code < 500:
                    if r.status_code >= 400:
                        raise ServerError(f"{method} {path}: {r.status_code} {_detail(r)}", r.status_code)
                    return r
                why = f"{r.status_code} {_detail(r)}"
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() + delay > deadline or self.stop.is_set():
                raise ServerUnavailable(f"{method} {path}: server unavailable for {self.patience_s:.0f} s ({why})")
            log.warning("%s %s failed (%s); retrying in %.1f s", method, path, why, delay)
            self.stop.wait(delay)
            delay = min(delay * 2, 10.0)


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except (json.JSONDecodeError, AttributeError):
        return r.text[:300]


