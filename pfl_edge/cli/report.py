"""``pfl-edge report``: plots and a one-page summary of a run folder, a simulator result, or a live federation."""

from __future__ import annotations

import argparse
import json
import ssl
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from ..errors import ConfigError, DataError
from ..secret_file import read_secret_file

_USAGE = """\
Writes report.md, report.html (one self-contained page: plots inline, nothing fetched), report.json (every
number computed) and PNG plots (accuracy.png, traffic.png, rounds.png, profiles.png).

Inputs:
  pfl-edge report runs/demo                  a `pfl-edge demo` run folder (metrics.json, devices.json,
                                             summary.json); report in runs/demo/report/
  pfl-edge report runs/fedper.json           a `pfl-edge simulate --out` result; report in runs/fedper-report/
  pfl-edge report runs/sim                   a folder of simulator results (`demo --simulate`): one report
                                             per result, in runs/sim/report/NAME/
  pfl-edge report --server https://HOST:8000 --federation FED --admin-token-file TOKEN --out DIR
                                             a live federation: fetches /v1/federations/FED, .../metrics and
                                             .../devices, saves them in DIR (federation.json, metrics.json,
                                             devices.json: `pfl-edge report DIR` reports them again) and
                                             reports into DIR

The report: final round's mean/median/min/max device accuracy; accuracy per device over rounds and its spread
per round; bytes up/down per round and in all; per device class (profile): count, density, K_P, mean final
accuracy, mean step ms, bytes; round wall times, updates per round, and rounds that closed short of quorum.
Inputs over 256 MB are refused; a server is given 30 s per request (--timeout)."""

_PATHS = {"info": "", "metrics": "/metrics", "devices": "/devices"}
_SAVED = {"info": "federation.json", "metrics": "metrics.json", "devices": "devices.json"}


def _fetch(url: str, headers: dict[str, str], verify: ssl.SSLContext | bool, timeout: float, limit: int) -> bytes:
    """GET ``url``, reading at most ``limit`` bytes of its body (the Content-Length is not trusted) within about
    ``timeout`` seconds in all."""
    import httpx

    try:
        with httpx.stream("GET", url, headers=headers, verify=verify, timeout=timeout) as r:
            if r.status_code != 200:
                detail = next(r.iter_raw(300), b"")[:300].decode("utf-8", "replace")  # the first bytes only
                raise ConfigError(f"GET {url}: the server answered {r.status_code}: {detail}")
            if r.headers.get("content-encoding", "identity") != "identity":
                raise DataError(f"GET {url}: a compressed answer ({r.headers['content-encoding']}) is not read")
            body, deadline = bytearray(), time.monotonic() + timeout
            for chunk in r.iter_raw():
                body += chunk
                if time.monotonic() > deadline:  # httpx's timeout is per read: a slow drip would never end
                    raise ConfigError(f"GET {url}: the answer took over {timeout:g} s (--timeout)")
                if len(body) > limit:
                    raise DataError(f"GET {url}: the answer is over {limit} bytes, the limit of a report input")
            return bytes(body)
    except httpx.HTTPError as e:
        raise ConfigError(f"GET {url}: {type(e).__name__}: {e}") from None


def fetch_live(server: str, fed: str, token: str, *, ca_file: str | None = None, timeout: float = 30.0,
               limit: int | None = None, paths: dict[str, str] | None = None) -> dict[str, bytes]:
    """The federation's admin answers, as raw bytes: ``info``, ``metrics``, ``devices`` (or ``paths``: name ->
    path under the federation's, e.g. ``{"classes": "/classes"}``)."""
    from ..protocol import API_PREFIX
    from ..report import MAX_INPUT_BYTES

    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--server must be http(s)://host[:port], got {server!r}")
    try:
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--ca-file {ca_file}: {e}") from None
    base = f"{server.rstrip('/')}{API_PREFIX}/federations/{quote(fed, safe='')}"
    # identity: a compressed body could expand past any bound set on the bytes read
    headers = {"Authorization": f"Bearer {token}", "Accept-Encoding": "identity"}
    return {k: _fetch(base + p, headers, verify, timeout, limit or MAX_INPUT_BYTES)
            for k, p in (paths or _PATHS).items()}


def _report_live(args: argparse.Namespace) -> list[tuple[Any, Path]]:
    from ..report import from_server, parse_json

    if not (args.federation and args.admin_token_file and args.out):
        raise ConfigError("a live report needs --server, --federation, --admin-token-file and --out")
    token = read_secret_file(args.admin_token_file)
    raw = fetch_live(args.server, args.federation, token, ca_file=args.ca_file, timeout=args.timeout)
    docs = {k: parse_json(v, f"the server's {k} answer") for k, v in raw.items()}
    run = from_server(docs["info"], docs["metrics"], docs["devices"], source="live")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for k, doc in docs.items():  # saved as parsed (and checked): `pfl-edge report OUT` reports them again
        (out / _SAVED[k]).write_text(json.dumps(doc, indent=1))
    return [(run, out)]


def _report_path(args: argparse.Namespace) -> list[tuple[Any, Path]]:
    from ..report import load_runs

    src = Path(args.run)
    runs = load_runs(src)
    if args.out is not None:
        base = Path(args.out)
    elif src.is_file():
        base = src.with_name(f"{src.stem}-report")
    else:
        base = src / "report"
    if len(runs) == 1:
        return [(runs[0], base)]
    return [(r, base / r.name) for r in runs]


def _cmd_report(args: argparse.Namespace) -> int:
    from ..report import summarise, write_report

    if (args.run is None) == (args.server is None):
        raise ConfigError("give a run folder or result file, or --server (a live federation), not both")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    jobs = _report_live(args) if args.server else _report_path(args)
    for run, out in jobs:
        summary = summarise(run)
        paths = write_report(summary, out)
        acc = summary["final"]["accuracy"]["mean"]
        print(f"{run.name}: final mean accuracy {'-' if acc is None else f'{acc:.3f}'} after "
              f"{summary['final']['rounds_recorded']} rounds; report: {paths['markdown']}, {paths['html']}, "
              f"{paths['json']} and {len(paths) - 3} plots in {out}/")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="plots and a one-page summary (Markdown, HTML) of a run or live federation",
                       description=_USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", help="a demo run folder, a simulator result JSON, or a folder of them")
    p.add_argument("--out", help="report folder (default: RUN/report/, or NAME-report/ beside a result file)")
    p.add_argument("--server", help="a live federation: the server's URL, http(s)://host:port")
    p.add_argument("--federation", help="the live federation's id")
    p.add_argument("--admin-token-file", help="a file whose first line is the admin token (or a device's)")
    p.add_argument("--ca-file", help="the CA certificate the server's (https://) certificate must chain to")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request to the server (default 30)")
    p.set_defaults(func=_cmd_report)
