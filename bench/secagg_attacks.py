"""One hostile device in a secure round, against a real ``pfl-edge`` server (issue 48, "Evidence" item 5): each
attack of tests/server/test_secure_hostile.py run once and measured instead of asserted.

A server in this process (``server.launch.start_background``, as the tests' ``background_server``: a fresh SQLite
file, the round worker ticking every 50 ms) on a private broker as the tests get theirs (tests/server/conftest.py:
a private Mosquitto when the binary is there, else the embedded broker). Five devices enrol over HTTP in a secure
FedPer federation (bound 0.5, 16 bits, degree 4, threshold 3); each plays round 1's four steps with the project's
own ``pfl_edge.secagg.Client``, slot 0 forging one message:

- input-out-of-range: its masked input + 2^31 (mod 2^32);
- forged-unmask-share: one revealed share of a survivor's self-mask seed with its last byte flipped;
- forged-share-of-a-dropout: the same with a share of a dropout's mask key (slot 4 sends no input);
- sealed-pair-of-random-bytes: the sealed pair for its lowest neighbour replaced by random bytes;
- false-complaint: it accuses an honest neighbour whose pair opened.

As in the test, the server's clock is moved past the input and the unmask steps' deadlines once every device has
answered (no waiting out a deadline), and measured per attack: the HTTP status of the forged message, whether
round 1 published a base, the published base's max and median |delta| per coordinate from the mean of the inputs
of the survivors the server named (from the round's start where nothing was published) and from the honest
devices' (1-4) mean, whether round 2 opened and how long after the unmask step's end (the clock's move), the
refused counts in the admin's device listing and the log's "is named for a forged" lines.

    .venv/bin/python bench/secagg_attacks.py --commit HEAD --out bench/results/secagg_attacks.json

``--commit``: run against a git worktree of that commit (made in a temp folder and removed; the checkout's
uncommitted edits stay out); without it, against the checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
ATTACKS = ["input-out-of-range", "forged-unmask-share", "forged-share-of-a-dropout", "sealed-pair-of-random-bytes",
           "false-complaint"]
ADMIN = "admin-token-for-secagg-attacks-bench"
BOUND, BITS = 0.5, 16


def git(*args: str, cwd: Path = HERE) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@contextlib.contextmanager
def broker(folder: Path) -> Iterator[tuple[str, str]]:
    """As tests/server/conftest.py's ``broker_url``: a private Mosquitto, else the embedded broker."""
    from mosquitto_kit import MOSQUITTO  # tests/: the same binary tests/server/conftest.py looks for

    from server.broker import EmbeddedBroker

    if MOSQUITTO is None:
        with EmbeddedBroker() as b:
            yield b.url, "embedded (server.broker.EmbeddedBroker)"
        return
    from mosquitto_kit import mosquitto  # tests/

    with mosquitto(folder) as url:
        yield url, f"private Mosquitto ({MOSQUITTO})"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _flip(share_hex: str) -> str:
    raw = bytearray(bytes.fromhex(share_hex))
    raw[-1] ^= 0x5A  # the share's value, not its index
    return bytes(raw).hex()


def flat(tensors: dict[str, Any], keys: list[str]) -> Any:
    import numpy as np

    return np.concatenate([tensors[k].double().numpy().ravel() for k in keys])


def one(attack: str, broker_url: str, folder: Path) -> dict[str, Any]:
    import httpx
    import numpy as np
    from secure_kit import adverts, at_step, dealt_json, enrolled, expected_base, inbox
    from server_testkit import FEDPER, background_server, bearer, fed_state

    from pfl_edge.protocol import task_topic
    from pfl_edge.secagg import Client, Params, encode_masked, round_id
    from pfl_edge.secagg.aggregate import secure_input

    config: dict[str, Any] = {**FEDPER, "clients": 5, "rounds": 2,
                              "secure_aggregation": {"bound": BOUND, "bits": BITS, "degree": 4, "threshold": 3}}
    lines = Lines()
    logging.getLogger().addHandler(lines)
    srv = background_server(folder, broker_url, ADMIN)
    out: dict[str, Any] = {"attack": attack, "statuses": {}}
    try:
        c, cfg, devs, mq, task, start, keys, sent = enrolled(srv, ADMIN, "hx", config, 2)
        xs = [secure_input(cfg, start, s) for s in sent]
        clients = {d.index: Client(d.index, Params(4, 3, 1)) for d in devs}
        for d in devs:
            cl = clients[d.index]
            r = c.post("/v1/rounds/1/secagg/keys", headers=d.h,
                       json={"c_public": cl.c.public.hex(), "s_public": cl.s.public.hex()})
            out["statuses"].setdefault("keys", []).append(r.status_code)
        at = {d.index: at_step(c, d, 1, "share") for d in devs}
        size = sum(start[k].numel() for k in keys)
        victim = min(n["index"] for n in at[0]["neighbours"])
        for d in devs:
            cl = clients[d.index]
            cl.params = Params(4, 3, size, round_id("hx", 1))
            dealt = cl.share_keys(adverts(at[d.index]))
            if d.index == 0 and attack == "sealed-pair-of-random-bytes":
                box, commits = dealt[victim]
                dealt[victim] = (np.random.default_rng(0).bytes(len(box)), commits)
            r = c.post("/v1/rounds/1/secagg/shares", headers=d.h, json=dealt_json(dealt))
            out["statuses"].setdefault("shares", []).append(r.status_code)
        dropped = {4} if attack == "forged-share-of-a-dropout" else set()
        for i in (i for i in range(5) if i not in dropped):
            cl = clients[i]
            y = cl.masked_input(xs[i], inbox(at_step(c, devs[i], 1, "input")))
            if i == 0 and attack == "input-out-of-range":
                y = (y.astype(np.uint64) + (1 << 31)).astype(np.uint32)
            if i == 0 and attack == "false-complaint":
                r = c.post("/v1/rounds/1/secagg/complaint", headers=devs[0].h,
                           json={"c_secret": cl.c.secret.hex(), "accused": [victim]})
                out["forged_message_status"] = r.status_code
                out["forged_message_answer"] = r.text[:300]
            if cl.accused:  # the victim of the random pair complains
                secret, accused = cl.complaint()
                r = c.post("/v1/rounds/1/secagg/complaint", headers=devs[i].h,
                           json={"c_secret": secret.hex(), "accused": accused})
                out["victim_complaint"] = {"slot": i, "accused": accused, "status": r.status_code}
            r = devs[i].update(1, devs[i].put(encode_masked(y, 1)))
            out["statuses"].setdefault("input", []).append(r.status_code)
            if i == 0 and attack in ("input-out-of-range", "sealed-pair-of-random-bytes"):
                out["forged_message_status"] = (r.status_code if attack == "input-out-of-range"
                                                else out["statuses"]["shares"][0])
        coord = srv.app_state.coordinator
        coord.rounds.clock = lambda: time.time() + 10**6
        coord.worker.kick()
        ask = at_step(c, devs[1], 1, "unmask")
        survivors, gone = frozenset(ask["survivors"]), frozenset(ask["dropped"])
        out["unmask_request"] = {"survivors": sorted(survivors), "dropped": sorted(gone)}
        for i in sorted(survivors):
            body = [{"about": j, "kind": k, "share": s.hex()}
                    for j, (k, s) in clients[i].unmask(survivors, gone).items()]
            forging = i == 0 and attack in ("forged-unmask-share", "forged-share-of-a-dropout")
            if forging:
                want = "s" if dropped else "b"
                forged = next(x for x in body if x["kind"] == want)
                forged["share"] = _flip(forged["share"])
            r = c.post("/v1/rounds/1/secagg/unmask", headers=devs[i].h, json={"shares": body})
            out["statuses"].setdefault("unmask", []).append(r.status_code)
            if forging:
                out["forged_message_status"] = r.status_code
                out["forged_message_answer"] = r.text[:300]
        coord.rounds.clock = lambda: time.time() + 2 * 10**6  # the unmask step's deadline passes now
        t_end = time.perf_counter()
        coord.worker.kick()
        try:
            nxt = mq.wait(task_topic("hx", devs[0].id), lambda x: x["round"] == 2, timeout=60)
            out["round2_opened"] = True
            out["round2_after_unmask_end_s"] = round(time.perf_counter() - t_end, 3)
        except AssertionError:
            nxt = None
            out["round2_opened"] = False
            out["round2_after_unmask_end_s"] = None
        out["federation_state_after"] = list(fed_state(c, ADMIN, "hx"))
        start_v = flat(start, keys)
        honest = [i for i in sorted(survivors) if i != 0] if survivors else [1, 2, 3, 4]
        honest_all = [1, 2, 3, 4]
        ref_survivors = flat(expected_base(start, keys, xs, sorted(survivors), BOUND, BITS), keys)
        ref_honest = flat(expected_base(start, keys, xs, honest_all, BOUND, BITS), keys)
        out["honest_mean_max_abs_update"] = float(np.abs(ref_honest - start_v).max())
        out["honest_survivors"] = honest
        if nxt is not None:
            published = nxt["base"] != task["base"]
            got = flat(devs[0].get(nxt["base"]).tensors, keys)
            out["round1_published"] = published
            ref = ref_survivors if published else start_v
            d = np.abs(got - ref)
            out["delta_vs_survivors_mean_or_start"] = {"max": float(d.max()), "median": float(np.median(d)),
                                                       "reference": ("the mean of the named survivors' inputs"
                                                                     if published else "round 1's start")}
            dh = np.abs(got - ref_honest)
            out["delta_vs_honest_mean"] = {"max": float(dh.max()), "median": float(np.median(dh)),
                                           "reference": "round 1's start + the mean of devices 1-4's inputs"}
            out["moved_from_start_max"] = float(np.abs(got - start_v).max())
            out["per_device_bound_2b_over_n"] = 2 * BOUND / 5
        listing = {d["index"]: d for d in httpx.get(f"{srv.url}/v1/federations/hx/devices",
                                                    headers=bearer(ADMIN)).json()}
        out["refused"] = {i: listing[i]["refused"] for i in sorted(listing)}
        out["named_slots"] = [i for i in sorted(listing) if listing[i]["refused"]]
        out["log_named"] = [r.getMessage() for r in lines.records if "is named for a forged" in r.getMessage()]
        out["log_lines"] = [f"{r.levelname} {r.name}: {r.getMessage()}"[:400] for r in lines.records
                            if r.levelno >= logging.WARNING and r.name.startswith(("server.services", "pfl_edge"))]
        out["log_errors"] = sum(1 for r in lines.records if r.levelno >= logging.ERROR)
        out["log_tracebacks"] = sum(1 for r in lines.records if r.exc_info)
        mq.close()
    finally:
        srv.stop()
        logging.getLogger().removeHandler(lines)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default=None, help="run against a worktree of this commit")
    ap.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--out", type=Path, default=HERE / "bench/results/secagg_attacks.json")
    args = ap.parse_args()
    if args.commit and args.tree is None:
        sha = git("rev-parse", args.commit)
        tree = Path(tempfile.mkdtemp(prefix="secagg-attacks-")) / "tree"
        git("worktree", "add", "--detach", str(tree), sha)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            argv = [sys.executable, str(Path(__file__).resolve()), "--tree", str(tree), "--attacks", args.attacks,
                    "--out", str(args.out.resolve()), "--commit", sha]
            rc = subprocess.run(argv, env=env, cwd=tree).returncode
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, check=False)
            tree.parent.rmdir()
        raise SystemExit(rc)
    tree = (args.tree or HERE).resolve()
    for p in (tree, tree / "tests", tree / "tests/server"):  # tests/server first
        sys.path.insert(0, str(p))
    import pfl_edge
    import server

    for mod in (pfl_edge, server):
        if not Path(mod.__file__ or "").resolve().is_relative_to(tree):
            raise SystemExit(f"{mod.__name__} came from {mod.__file__}, not {tree}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, broker(Path(tmp) / "broker") as (url, which):
        for attack in args.attacks.split(","):
            t0 = time.perf_counter()
            r = one(attack, url, Path(tmp) / attack)
            r["wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(r)
            d = r.get("delta_vs_survivors_mean_or_start", {})
            print(f"{attack}: forged message {r.get('forged_message_status')}, round 1 published "
                  f"{r.get('round1_published')}, max |delta| {d.get('max', float('nan')):.3g}, round 2 opened "
                  f"{r['round2_opened']} ({r['round2_after_unmask_end_s']} s after the unmask step), named "
                  f"{r['named_slots']}", file=sys.stderr, flush=True)
    sha = args.commit or git("rev-parse", "HEAD", cwd=tree)
    dirty = "" if args.commit else git("status", "--porcelain", "--", "pfl_edge", "server", cwd=tree)
    from machine import cpu_model  # bench/

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python bench/secagg_attacks.py" + (f" --commit {args.commit}" if args.commit else ""),
        "commit": sha, "uncommitted_changes_in_code": dirty or "none",
        "machine": f"{cpu_model()}, {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "load": os.getloadavg(), "broker": which,
        "federation": "FedPer (tests' FEDPER: synthetic, kp 2), 5 devices, secure_aggregation bound 0.5, 16 bits, "
                      "degree 4, threshold 3; slot 0 hostile; each device's model the round's start + 0.05 N(0, 1)",
        "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
