"""The device's HTTP client: JSON and blob calls to the server with retries and back-off, the server verified
against a CA (HTTPS), and the device's token, which it rotates before it expires."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from pfl_edge.errors import ConfigError, PflEdgeError

from .state import atomic_write

__all__ = ["Http", "ServerError", "ServerUnavailable", "is_loopback"]

log = logging.getLogger("pfl_edge.client")

ROTATE_PATH = "/v1/devices/me/token"


class ServerError(PflEdgeError):
    """The server refused a request (a 4xx answer): a user error, shown with the server's reason."""

    exit_code = 6

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailable(PflEdgeError):
    """The server could not be reached within the agent's patience."""

    exit_code = 7


MAX_JSON_BYTES = 16 * 1024 * 1024  # a JSON answer (a task names at most MAX_CLIENTS neighbours: ~2 MB)


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _verify(base: str, ca_file: str | None) -> ssl.SSLContext | bool:
    """How the server is verified: against ``ca_file`` (its certificate must chain to that CA and name the host),
    or the system's CAs. Plain HTTP beyond this machine carries the enrolment secret and tokens in clear: said."""
    if base.lower().startswith("http://"):  # HTTP:// is plain HTTP too
        if ca_file is not None:
            raise ConfigError(f"--ca-file is given but the server URL {base!r} is plain http://; use https://")
        if not is_loopback(base):
            log.warning("the server %s is reached over plain HTTP: the enrolment secret and the device's token "
                        "travel in clear; serve it over HTTPS (pfl-edge server --tls-cert/--tls-key) and use "
                        "https:// with --ca-file", base)
        return True
    if ca_file is None:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot use CA file {ca_file}: {e}") from None


class Http:
    """JSON and blob calls with retries: connection failures and 5xx answers back off (0.5 s doubling to 10 s)
    until ``patience_s``, a 429 waits as long as its Retry-After says (a 503 too, up to 60 s); any other 4xx answer
    is the caller's error and raises ``ServerError`` at once."""

    def __init__(self, base: str, patience_s: float, *, ca_file: str | None = None) -> None:
        self.client = httpx.Client(base_url=base.rstrip("/"), timeout=60.0, verify=_verify(base, ca_file))
        self.patience_s = patience_s
        self.token: str | None = None
        self.stop = threading.Event()
        self.token_file: Path | None = None
        self._issued = 0.0  # when the token in use was issued, and when it expires (None: not known yet)
        self._expires: float | None = None
        self._next_try = 0.0
        self._enrolled = ""  # the tag of the enrolment the token descends from
        self.chain_ended = False  # a rotation was refused (401): the device must enrol again (``Agent``)
        # each rotation's body: the device's signed proof (edge_runtime.enrol.DeviceKey); None: no body
        self.rotation_body: Callable[[], Any] | None = None

    def call(self, method: str, path: str, *, json_body: Any = None, content: bytes | None = None,
             max_bytes: int = MAX_JSON_BYTES) -> httpx.Response:
        """The answer, its body read to at most ``max_bytes`` (more is refused before it is all read: a JSON
        answer, a payload, a program each have their bound). ``json_body`` may be a function, called for each
        attempt (a signed body is signed afresh for a retry)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        deadline = time.monotonic() + self.patience_s
        delay = 0.5
        while True:
            why: str
            wait = delay
            try:
                r = self._request(method, path, json_body, content, headers, max_bytes)
                if r.status_code == 429 and "retry-after" in r.headers:
                    why, wait = f"429 {_detail(r)}", max(delay, _seconds(r.headers["retry-after"]))
                elif r.status_code == 503 and "retry-after" in r.headers:  # e.g. programs still exporting
                    why, wait = f"503 {_detail(r)}", max(delay, min(_seconds(r.headers["retry-after"]), 60.0))
                elif r.status_code < 500:
                    if r.status_code >= 400:
                        raise ServerError(f"{method} {path}: {r.status_code} {_detail(r)}", r.status_code)
                    return r
                else:
                    why = f"{r.status_code} {_detail(r)}"
            except httpx.TransportError as e:
                if _bad_certificate(e):  # no retry makes a certificate trustworthy
                    raise ConfigError(f"{method} {path}: the server's certificate does not verify ({e}); is "
                                      "--ca-file the CA that signed it, and the URL's host a name in it?") from None
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() + wait > deadline or self.stop.is_set():
                raise ServerUnavailable(f"{method} {path}: server unavailable for {self.patience_s:.0f} s ({why})")
            log.warning("%s %s failed (%s); retrying in %.1f s", method, path, why, wait)
            self.stop.wait(wait)
            delay = min(delay * 2, 10.0)

    def _request(self, method: str, path: str, json_body: Any, content: bytes | None, headers: dict[str, str],
                 max_bytes: int) -> httpx.Response:
        body = json_body() if callable(json_body) else json_body
        req = self.client.build_request(method, path, json=body, content=content, headers=headers)
        r = self.client.send(req, stream=True)
        try:
            declared = r.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise ServerError(f"{method} {path}: the answer is {declared} bytes, over this call's bound of "
                                  f"{max_bytes}", r.status_code)
            body = bytearray()
            for chunk in r.iter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ServerError(f"{method} {path}: the answer ran past this call's bound of {max_bytes} bytes",
                                      r.status_code)
        finally:
            r.close()
        # iter_bytes has already undone any content coding: the copy must not claim it again
        kept = [(k, v) for k, v in r.headers.multi_items()
                if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(r.status_code, headers=kept, content=bytes(body), request=req)

    # ------------------------------------------------------------------------------------------------ token
    def use_token(self, token_file: Path, enrolled: str) -> None:
        """The device's token: the one saved in ``token_file`` by its last rotation, or else (a fresh enrolment,
        or an enrolment newer than that file) ``enrolled``."""
        self.token_file, self._enrolled, self.chain_ended = token_file, _tag(enrolled), False
        self.token, self._issued, self._expires = enrolled, time.time(), None
        try:
            saved = json.loads(token_file.read_text())
        except (OSError, ValueError):
            return
        if isinstance(saved, dict) and saved.get("enrolled") == self._enrolled and isinstance(saved.get("token"), str):
            self.token, self._issued = saved["token"], float(saved.get("issued", 0.0))
            self._expires = None if saved.get("expires") is None else float(saved["expires"])

    def rotate_if_due(self) -> bool:
        """Rotate the token once half its life has passed (or at once, when its expiry is not known yet: a fresh
        enrolment's). The new one is saved (atomically, 0600) before it is used; the old one is dead as soon
        as the server answers. True if it rotated; a failure is logged and tried again a minute later."""
        now = time.time()
        if self.token_file is None or self.token is None or now < self._next_try:
            return False
        if self._expires is not None and now < self._issued + (self._expires - self._issued) / 2:
            return False
        self._next_try = now + 60.0
        try:
            got = self.call("POST", ROTATE_PATH, json_body=self.rotation_body).json()
        except (ServerError, ServerUnavailable) as e:
            if isinstance(e, ServerError) and e.status == 401:  # expired, or past its chain's absolute lifetime
                self.chain_ended = True
                log.warning("token rotation refused (%s): the device enrols again", e)
                return False
            log.warning("token rotation failed (%s); will retry", e)
            return False
        record = {"token": got["token"], "issued": now, "expires": float(got["expires"]),
                  "enrolled": self._enrolled}
        atomic_write(self.token_file, json.dumps(record).encode(), mode=0o600)
        self.token, self._issued, self._expires = got["token"], now, float(got["expires"])
        log.info("device token rotated; the new one expires at %s", time.ctime(self._expires))
        return True


def _bad_certificate(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _tag(token: str) -> str:
    """Which enrolment a rotated token descends from (a hash of that enrolment's token, not the token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def _seconds(value: str) -> float:
    try:
        return max(0.0, float(value))
    except ValueError:
        return 1.0


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except (json.JSONDecodeError, AttributeError):
        return r.text[:300]
