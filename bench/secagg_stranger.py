"""One stranger's large secure-aggregation bodies against a real server (issue 48: "a stranger's 4 MiB JSON is
parsed before any token on POST /v1/rounds/{t}/secagg/(shares|unmask): 637 ms of server CPU per unauthenticated
request; one stranger at 1.25 MiB/s made /healthz 8.8x and device calls 9.5x slower", on 319f720).

The server is a subprocess (``python -m server.main`` of a ``git archive`` of ``--commit``, HEAD by default, so
that edits in the work tree do not enter; SQLite in a temp dir, the embedded broker) with a secure FedPer
federation (``[secure_aggregation]``, as tests/server/test_secure_rounds.py's ``SECURE``) and one enrolled device
(round 1 not open: 1 of 7 devices). A prober thread here asks, back to back on one keep-alive connection with
20 ms between calls, ``GET /healthz`` and two device calls with the device's token: ``GET /v1/federations/{fed}``
(200) and ``GET /v1/rounds/1/secagg`` (409: no secure round yet; the token is checked in the database first). A
stranger (its own process, raw sockets) POSTs a ``{"shares": [...]}`` of just under 4 MiB (the 4 MiB route limit
at 319f720) to ``/v1/rounds/1/secagg/shares``, alternately with a bogus ``Authorization: Bearer`` and none, in a
loop; the body (``--bodies``) is ``pairs`` (8,365 valid-looking sealed pairs with commitments, in hex: cheap to
parse) or ``zeros`` (``[0,0,...]``: 2 million numbers, the costliest 4 MiB for the old JSON check); sent:

- ``paced``: one request every 4 MiB / 1.25 MiB/s = 3.2 s, its body written at 1.25 MiB/s in pieces of
  ``--pieces`` bytes until the server answers: 1,448 (one TCP segment on a 1,500-byte MTU, as a 10 Mbit/s link
  would deliver it; phase ``paced_<body>``) and 256 (a trickle: each piece a wake-up of the server's event loop;
  ``paced_<body>_256``);
- ``flat``: the next request as soon as the last is answered, the body written in 256 KiB pieces as fast as the
  socket takes them.

Phases, each on the same server: idle (its CPU rate), baseline (probes alone), then per body paced + probes,
flat + probes, paced alone and flat alone (the server's CPU per stranger request: its CPU seconds, with its
children, over the phase less the idle rate, divided by the answered requests). Per request: the answer's status,
the time from its headers sent to the answer, and the body bytes the stranger had handed to its socket by then (an
upper bound on what the server read: loopback buffers hold some). ``--before-commit`` runs the same against that
commit's server first, in the same invocation.

    .venv/bin/python bench/secagg_stranger.py [--before-commit 319f720] [--phase-s 15] [--alone-s 8] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
FED = "stranger"
SECRET = "stranger-bench-enrol-secret"
CONFIG: dict[str, Any] = dict(
    algorithm="fedper", kp=2, clients=7, rounds=2, dataset="synthetic", partition="pathological:2",
    samples_per_client=48, test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=3,
    secure_aggregation={"bound": 0.5, "bits": 16, "degree": 6, "threshold": 4})
BODY_BYTES = (4 << 20) - 4096  # under 319f720's 4 MiB limit on the route, so that it is read and parsed there
RATE = 1.25 * (1 << 20)  # the stranger: 1.25 MiB/s
PIECE = 1448  # what the paced stranger writes at a time: one TCP segment's payload on a 1500-byte MTU link
TRICKLE = 256  # a trickle: the same 1.25 MiB/s in small writes, each a wake-up of the server's event loop
FLAT_PIECE = 256 << 10
PATH = "/v1/rounds/1/secagg/shares"


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def shares_body(kind: str = "pairs", size: int = BODY_BYTES) -> bytes:
    """At most ``size`` bytes of ``{"shares": [...]}``: ``pairs``: sealed pairs as the route takes them
    (``{"index", "box", "commits"}``, hex of the right lengths: cheap to parse); ``zeros``: ``[0,0,...]``, 2 million
    numbers (the costliest 4 MiB to check: a hook call per number)."""
    if kind == "zeros":
        return b'{"shares":[' + b",".join([b"0"] * ((size - 13) // 2)) + b"]}"
    rnd = os.urandom(1 << 16).hex()
    out, n, i = [], len('{"shares":[]}'), 0
    while True:
        off = (i * 97) % (len(rnd) - 500)
        item = json.dumps({"index": i, "box": rnd[off:off + 336], "commits": rnd[off + 336:off + 464]},
                          separators=(",", ":"))
        if n + len(item) + 1 > size or i >= 9_999:
            break
        out.append(item)
        n += len(item) + 1
        i += 1
    return ('{"shares":[' + ",".join(out) + "]}").encode()


# ---- the stranger (its own process) ----

def _one(host: str, port: int, body: bytes, auth: str | None, rate: float | None, piece: int,
         stop: Any) -> dict[str, Any]:
    """One request: its headers at once, then its body in ``piece``-byte writes, each when ``rate`` allows (None:
    as fast as the socket takes them), until the server answers (or closes) or ``stop``."""
    head = (f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            + (f"Authorization: Bearer {auth}\r\n" if auth else "")
            + f"Content-Length: {len(body)}\r\n\r\n").encode()
    view = memoryview(body)
    sent, end = 0, len(body)
    res: dict[str, Any] = {"start": time.time(), "auth": "bogus" if auth else "none", "status": None,
                           "answer_s": None, "sent_before_answer": None}
    s = socket.create_connection((host, port), timeout=10)
    try:
        s.sendall(head)
        s.setblocking(False)
        t0, resp = time.perf_counter(), bytearray()
        while res["status"] is None:
            now = time.perf_counter() - t0
            if now > 120:
                res["status"] = "timeout"
                break
            if stop.is_set():  # the phase is over: what is still in flight is not counted
                res["status"] = "abandoned"
                break
            n = min(piece, end - sent)
            due = 0.0 if rate is None else (sent + n) / rate  # when this piece may go
            want_write = n > 0 and now >= due
            wait = 0.5 if n == 0 or want_write else max(0.0005, due - now)
            r, w, _ = select.select([s], [s] if want_write else [], [], wait)
            if r:
                try:
                    data = s.recv(1 << 16)
                except ConnectionResetError:
                    res["status"] = "reset"
                    break
                if not data:
                    res["status"] = "closed"
                    break
                resp += data
                if b"\r\n" in resp:
                    res["status"] = int(resp.split(b" ", 2)[1])
                    res["answer_s"] = time.perf_counter() - t0
                    res["sent_before_answer"] = sent
                    break
            if w:
                try:
                    sent += s.send(view[sent:sent + n])
                except (BrokenPipeError, ConnectionResetError):
                    end = sent  # the server closed its end: read what it answered, if anything
    except OSError as e:
        res["status"] = f"error: {type(e).__name__}"
    finally:
        s.close()
    res["sent_total"] = sent
    return res


def stranger(url: str, mode: str, kind: str, piece: int, ready: Any, go: Any, stop: Any, conn: Any) -> None:
    """Requests in ``mode`` (``paced`` or ``flat``) from ``go`` until ``stop``; sends the list of their results."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    body = shares_body(kind)
    rate = RATE if mode == "paced" else None
    every = len(body) / RATE if mode == "paced" else 0.0
    out: list[dict[str, Any]] = []
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    i, t_next = 0, time.monotonic()
    while not stop.is_set():
        if time.monotonic() < t_next:
            stop.wait(t_next - time.monotonic())
            continue
        t_next = time.monotonic() + every
        auth = secrets.token_urlsafe(32) if i % 2 == 0 else None
        out.append(_one(host, port, body, auth, rate, piece if rate else FLAT_PIECE, stop))
        i += 1
    conn.send({"body_bytes": len(body), "cpu_s": time.process_time() - cpu0, "requests": out})


# ---- the prober (a thread here) ----

def prober(url: str, token: str, stop: threading.Event, out: list[tuple[str, float, int]]) -> None:
    dev = {"Authorization": f"Bearer {token}"}
    probes: tuple[tuple[str, str, dict[str, str]], ...] = (
        ("healthz", "/healthz", {}), ("federation", f"/v1/federations/{FED}", dev),
        ("secagg_state", "/v1/rounds/1/secagg", dev))
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            for name, path, h in probes:
                t = time.perf_counter()
                try:
                    code = c.get(path, headers=h).status_code
                except httpx.HTTPError:
                    code = 0
                out.append((name, time.perf_counter() - t, code))
                time.sleep(0.02)


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    q = lambda p: 1e3 * s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"n": len(s), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "max_ms": 1e3 * s[-1],
            "mean_ms": 1e3 * sum(s) / len(s)}


class Server:
    """CPU seconds (user + system) of the server process with its children, live and reaped."""

    def __init__(self, pid: int) -> None:
        self.p = psutil.Process(pid)

    def cpu(self) -> float:
        t = self.p.cpu_times()
        own = t.user + t.system + t.children_user + t.children_system
        for c in self.p.children(recursive=True):
            try:
                ct = c.cpu_times()
                own += ct.user + ct.system
            except psutil.Error:
                pass
        return own

    def settle(self, share: float = 0.05, timeout: float = 120.0) -> float:
        """Waits until the server uses under ``share`` of a core over 2 s (after the federation's creation its
        children work for a while); the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            c0 = self.cpu()
            time.sleep(2.0)
            if self.cpu() - c0 < 2.0 * share:
                break
        return time.monotonic() - t0


def phase(name: str, url: str, token: str, srv: Server, seconds: float, mode: str | None, probes: bool,
          kind: str = "pairs", piece: int = PIECE) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    samples: list[tuple[str, float, int]] = []
    stop_p = threading.Event()
    th = threading.Thread(target=prober, args=(url, token, stop_p, samples), daemon=True) if probes else None
    ready, go, stop_s = ctx.Event(), ctx.Event(), ctx.Event()
    rx, tx = ctx.Pipe(duplex=False)
    proc = None
    if mode is not None:
        proc = ctx.Process(target=stranger, args=(url, mode, kind, piece, ready, go, stop_s, tx), daemon=True)
        proc.start()
        if not ready.wait(120):
            raise RuntimeError("the stranger did not start")
    load0 = os.getloadavg()
    cpu0, t0 = srv.cpu(), time.monotonic()
    go.set()
    if th is not None:
        th.start()
    time.sleep(seconds)
    stop_s.set()
    stop_p.set()
    if th is not None:
        th.join(70)
    dt, cpu = time.monotonic() - t0, srv.cpu() - cpu0
    got: dict[str, Any] = rx.recv() if proc is not None else {"requests": []}
    if proc is not None:
        proc.join(30)
    reqs = got["requests"]
    answered = [r for r in reqs if isinstance(r["status"], int)]
    codes: dict[str, int] = {}
    for r in reqs:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    res: dict[str, Any] = {
        "seconds": dt, "stranger": mode, "load_average_before": load0, "load_average_after": os.getloadavg(),
        "server_cpu_s": cpu, "server_cpu_share_of_one_core": cpu / dt,
        "probes": {k: stats([lat for n, lat, _ in samples if n == k]) | {
            "codes": sorted({c for n, _, c in samples if n == k})} for k in ("healthz", "federation", "secagg_state")}
        if probes else None,
    }
    if mode is not None:
        sent = sorted(r["sent_before_answer"] for r in answered)
        res["requests"] = {
            "count": len(reqs), "answered": len(answered), "codes": codes,
            "answered_per_s": len(answered) / dt, "body_bytes": got.get("body_bytes"),
            "piece_bytes": piece if mode == "paced" else FLAT_PIECE, "stranger_cpu_s": got.get("cpu_s"),
            "answer_after_headers": stats([r["answer_s"] for r in answered]),
            "body_bytes_sent_before_answer": {"p50": sent[len(sent) // 2] if sent else None,
                                              "min": sent[0] if sent else None, "max": sent[-1] if sent else None},
            "body_bytes_sent_total": sum(r.get("sent_total", 0) for r in reqs),
            "offered_mib_per_s": sum(r.get("sent_total", 0) for r in reqs) / dt / (1 << 20)}
    p = res.get("probes") or {}
    q = res.get("requests") or {}
    say(f"  {name}: {dt:.1f} s, load {load0[0]:.1f}, server CPU {cpu:.2f} s ({cpu / dt:.0%} of a core)"
        + "".join(f", {k} p50 {v['p50_ms']:.1f} p90 {v['p90_ms']:.1f} ms (n {v['n']})"
                  for k, v in p.items() if v.get("n"))
        + (f"; stranger {q['answered']}/{q['count']} answered {codes}, answer p50 "
           f"{q['answer_after_headers'].get('p50_ms', float('nan')):.1f} ms, body bytes sent before the answer "
           f"p50 {q['body_bytes_sent_before_answer']['p50']}, {q['offered_mib_per_s']:.2f} MiB/s sent, stranger CPU "
           f"{q['stranger_cpu_s']:.1f} s"
           if mode else ""))
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(root: Path, data_dir: Path, admin: str) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m server.main`` of the tree at ``root`` (PYTHONPATH there), SQLite and the embedded broker in
    ``data_dir``; (the process, its URL) once /healthz answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PFL_DATA_DIR": str(data_dir), "PFL_ADMIN_TOKEN": admin, "PFL_PUBLIC_URL": url,
           "PYTHONPATH": str(root)}
    log = (data_dir / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "server.main", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(data_dir / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server not healthy within 120 s")


def variants(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(phase key, mode, body, piece) of each stranger: paced in each ``--pieces``, then flat, for each body."""
    return [v for kind in args.bodies for v in (
        *((f"paced_{kind}" + ("" if i == 0 else f"_{piece}"), "paced", kind, piece)
          for i, piece in enumerate(args.pieces)),
        (f"flat_{kind}", "flat", kind, FLAT_PIECE))]


def run_server(label: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    say(f"{label}: server of {root}")
    admin = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="stranger-") as d:
        proc, url = start_server(root, Path(d), admin)
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                r = c.post("/v1/federations", json={"id": FED, "enrol_secret": SECRET, "config": CONFIG},
                           headers={"Authorization": f"Bearer {admin}"})
                assert r.status_code == 201, r.text
                r = c.post("/v1/devices", json={"federation": FED, "enrol_secret": SECRET, "profile": "phone-mid",
                                                "index": 0})
                assert r.status_code == 201, r.text
                token = r.json()["token"]
            s = Server(proc.pid)
            settled = s.settle()
            say(f"  settled after {settled:.0f} s")
            ph: dict[str, Any] = {}
            ph["idle"] = phase("idle", url, token, s, args.idle_s, None, probes=False)
            ph["baseline"] = phase("baseline", url, token, s, args.phase_s, None, probes=True)
            for key, m, kind, piece in variants(args):
                ph[key] = phase(f"{key} + probes", url, token, s, args.phase_s, m, True, kind, piece)
                ph[f"{key}_alone"] = phase(f"{key} alone", url, token, s, args.alone_s, m, False, kind, piece)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    idle = ph["idle"]["server_cpu_share_of_one_core"]
    base = ph["baseline"]["probes"]
    out: dict[str, Any] = {"settled_s": settled, "phases": ph, "ratios": {}, "cpu_per_request_ms": {},
                           "cpu_per_request_with_idle_ms": {}}
    for m, *_ in variants(args):
        out["ratios"][m] = {k: {q: ph[m]["probes"][k][q] / base[k][q] for q in ("p50_ms", "p90_ms", "mean_ms")}
                            for k in base if ph[m]["probes"][k].get("n")}
        p = ph[f"{m}_alone"]
        n = p["requests"]["answered"]
        out["cpu_per_request_ms"][m] = 1e3 * (p["server_cpu_s"] - idle * p["seconds"]) / n if n else None
        out["cpu_per_request_with_idle_ms"][m] = 1e3 * p["server_cpu_s"] / n if n else None  # an upper bound
    say(f"{label}: ratios {json.dumps(out['ratios'])}")
    say(f"{label}: server CPU per stranger request, less idle (ms) {json.dumps(out['cpu_per_request_ms'])}")
    return out


def archive(commit: str, into: Path) -> str:
    """``commit``'s tree (``git archive``) unpacked into ``into``; its short hash."""
    short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    tar = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return short


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", default="HEAD", help="the server measured (git archive of it, not the work tree)")
    ap.add_argument("--before-commit", help="also run this commit's server first (the issue's: 319f720)")
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds of baseline, paced and flat with probes")
    ap.add_argument("--alone-s", type=float, default=8.0, help="seconds of each stranger alone (CPU per request)")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--bodies", nargs="+", default=["pairs", "zeros"], choices=["pairs", "zeros"])
    ap.add_argument("--pieces", type=int, nargs="+", default=[PIECE, TRICKLE],
                    help="bytes the paced stranger writes at a time (a paced phase for each)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "secagg_stranger.json")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_average_before": os.getloadavg(), "rate_bytes_per_s": RATE, "paced_piece_bytes": args.pieces,
        "flat_piece_bytes": FLAT_PIECE, "route": PATH, "runs": {}}
    t0 = time.monotonic()
    for label, commit in (("before", args.before_commit), ("after", args.commit)):
        if commit is None:
            continue
        with tempfile.TemporaryDirectory(prefix=f"stranger-{label}-") as d:
            short = archive(commit, Path(d))
            result["runs"][label] = {"commit": short, **run_server(f"{label} ({short})", Path(d), args)}
    result["load_average_after"] = os.getloadavg()
    result["wall_s"] = time.monotonic() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {args.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
