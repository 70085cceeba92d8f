"""The device's HTTP client reads no answer past its bound: a JSON answer, a payload and a program each have one,
and a server (or anything posing as one) that sends more is refused before the rest is read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from edge_runtime.http import Http, ServerError

SENT: dict[str, int] = {}


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        size = int(self.path.rsplit("/", 1)[1])
        declared = not self.path.startswith("/chunked/")
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if declared:
            self.send_header("Content-Length", str(size))
        else:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            while sent < size:
                n = min(65536, size - sent)
                block = b"x" * n
                self.wfile.write(block if declared else b"%x\r\n%s\r\n" % (n, block))
                sent += n
            if not declared:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client hung up: what we want to see
            pass
        SENT[self.path] = sent

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.parametrize("kind", ["declared", "chunked"])
def test_an_answer_within_its_bound_is_read_whole(url: str, kind: str) -> None:
    r = Http(url, 5).call("GET", f"/{kind}/100000", max_bytes=100_000)
    assert r.status_code == 200 and r.content == b"x" * 100_000


def test_a_declared_length_over_the_bound_is_refused_unread(url: str) -> None:
    with pytest.raises(ServerError, match="over this call's bound of 1000"):
        Http(url, 5).call("GET", "/declared/50000000", max_bytes=1000)


def test_a_chunked_answer_running_past_the_bound_is_cut_off(url: str) -> None:
    with pytest.raises(ServerError, match="ran past this call's bound of 200000"):
        Http(url, 5).call("GET", "/chunked/50000000", max_bytes=200_000)
    # the client stopped reading: the server could not send its 50 MB
    deadline = time.monotonic() + 5
    while "/chunked/50000000" not in SENT and time.monotonic() < deadline:
        time.sleep(0.05)
    assert SENT.get("/chunked/50000000", 0) < 50_000_000


def test_json_answers_have_a_default_bound(url: str) -> None:
    with pytest.raises(ServerError, match="over this call's bound"):
        Http(url, 5).call("GET", f"/declared/{64 * 1024 * 1024}")


class _Busy(BaseHTTPRequestHandler):
    """503 with Retry-After 1 twice (a card whose programs are exporting), then the answer."""

    asked: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        _Busy.asked.append(time.monotonic())
        if len(_Busy.asked) <= 2:
            self.send_response(503)
            self.send_header("Retry-After", "1")
            body = b'{"detail": "exporting"}'
        else:
            self.send_response(200)
            body = b"{}"
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_503_is_asked_again_when_its_retry_after_says() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = Http(f"http://127.0.0.1:{srv.server_address[1]}", 30).call("GET", "/card")
    finally:
        srv.shutdown()
    assert r.status_code == 200
    gaps = [b - a for a, b in zip(_Busy.asked, _Busy.asked[1:], strict=False)]
    # without the header the back-off would ask again after 0.5 s, then 1 s
    assert len(gaps) == 2 and all(g >= 0.95 for g in gaps), gaps
