"""The soak's end check: every device's ledger (one line per update the server accepted, ``ledger.jsonl`` in its
state dir) held against the server's database, and each FedPer round's published average recomputed from the
updates the database holds for that round.

What counts:
* **lost**: a ledger entry with no update row of that device, round and digest; or an update row accepted after
  its round closed (the close read the round's updates before it: that update is in no aggregate);
  or a FedPer round whose published model is not the average of its update rows; or a closed round whose update
  rows are not what its close took (``Round.inputs`` and ``inputs_digest``, written in the close's transaction:
  FedPer and DisPFL).
* **double counted**: more than one update row for a (federation, round, device).
* **unlogged**: update rows no ledger names (a device killed between the server's answer and its ledger write,
  and never restarted to repeat the post); not lost, reported.
* **inconsistent devices**: a device whose saved progress and model do not match what the server holds for it.

Each close records the count and a digest of the (device, digest) pairs it took; the check holds every closed
round's rows to that record, and recomputes FedPer's average from them besides. DisPFL has no server aggregate:
a neighbour's next task names the latest update of each device from before the round (``Planner.latest_models``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

__all__ = ["check"]


def check(database_url: str, blob_dir: Path, device_dirs: list[Path], *, recompute: bool = True) -> dict[str, Any]:
    """The check's figures (see the module's doc), as one JSON-able dict."""
    from sqlalchemy import select

    from edge_runtime.state import StateDir
    from server.db import Device, Federation, Round, Update, make_engine
    from server.migrations import make_sessionmaker

    engine = make_engine(database_url)
    sessions = make_sessionmaker(engine)
    try:
        with sessions() as s:
            feds = {f.id: f for f in s.scalars(select(Federation))}
            devices = {d.id: d for d in s.scalars(select(Device))}
            rows = list(s.scalars(select(Update)))
            rounds = {(r.federation, r.round): r for r in s.scalars(select(Round))}
        by_key: dict[tuple[str, int, str], list[Any]] = defaultdict(list)
        for u in rows:
            by_key[u.federation, u.round, u.device].append(u)
        out: dict[str, Any] = {"updates_on_server": len(rows), "double_counted": 0, "lost": 0, "lost_detail": [],
                               "unlogged": 0, "ledger_entries": 0, "ledger_repeats": 0}
        out["double_counted"] = sum(len(v) - 1 for v in by_key.values() if len(v) > 1)
        logged = _check_ledgers(device_dirs, by_key, out, StateDir)
        out["unlogged"] = len(set(by_key) - logged)
        _check_rounds(feds, rounds, rows, out)
        _check_inputs(rounds, rows, out)
        out["rounds"] = _rounds_summary(feds, rounds, rows)
        out["devices"] = _check_devices(device_dirs, by_key, devices, StateDir)
        out["inconsistent_devices"] = sum(1 for d in out["devices"] if not d["consistent"])
        if recompute:
            out["aggregates"] = _recompute(sessions, blob_dir, feds, rounds)
            out["lost"] += out["aggregates"]["mismatched"]
        return out
    finally:
        engine.dispose()


def _check_ledgers(device_dirs: list[Path], by_key: dict[tuple[str, int, str], list[Any]], out: dict[str, Any],
                   state_dir: Any) -> set[tuple[str, int, str]]:
    """Every ledger entry against the update rows; the (federation, round, device) keys the ledgers name."""
    logged: set[tuple[str, int, str]] = set()
    for d in device_dirs:
        sd = state_dir(d)
        enr = sd.enrolment
        if enr is None:
            continue
        fed, dev = enr["federation"], enr["device_id"]
        entries = Counter((int(e["round"]), str(e["digest"])) for e in sd.read_ledger())
        out["ledger_entries"] += len(entries)
        out["ledger_repeats"] += sum(n - 1 for n in entries.values())
        for (t, digest), _n in sorted(entries.items()):
            logged.add((fed, t, dev))
            got = [u.digest for u in by_key.get((fed, t, dev), [])]
            if digest not in got:
                out["lost"] += 1
                out["lost_detail"].append({"device": d.name, "round": t, "digest": digest, "server": got,
                                           "why": "accepted (ledger) but no such update row"})
    return logged


def _check_rounds(feds: dict[str, Any], rounds: dict[tuple[str, int], Any], rows: list[Any],
                  out: dict[str, Any]) -> None:
    """Update rows accepted after their round closed are in no aggregate: lost."""
    late = 0
    for u in rows:
        r = rounds.get((u.federation, u.round))
        if u.round == 0 or r is None or r.closed_at is None:
            continue
        if u.accepted_at > r.closed_at:
            late += 1
            out["lost_detail"].append({"federation": u.federation, "round": u.round, "device": u.device,
                                       "why": f"accepted {u.accepted_at - r.closed_at:.3f} s after the close"})
    out["accepted_after_close"] = late
    out["lost"] += late


def _check_inputs(rounds: dict[tuple[str, int], Any], rows: list[Any], out: dict[str, Any]) -> None:
    """Each closed round's record of what its close took (``Round.inputs``, ``inputs_digest``: FedPer and DisPFL)
    against its update rows now: a row the close did not take, or one it took that is gone, is lost."""
    from server.db import inputs_digest

    by_round: dict[tuple[str, int], list[tuple[str, str]]] = defaultdict(list)
    for u in rows:
        by_round[u.federation, u.round].append((u.device, u.digest))
    checked = mismatched = 0
    for key, r in rounds.items():
        if r.inputs_digest is None:
            continue  # not closed yet
        checked += 1
        pairs = by_round.get(key, [])
        if (len(pairs), inputs_digest(pairs)) != (r.inputs, r.inputs_digest):
            mismatched += 1
            out["lost_detail"].append({"federation": key[0], "round": key[1], "rows": len(pairs),
                                       "taken": r.inputs, "why": "the rows differ from what the close took"})
    out["inputs_checked"], out["inputs_mismatched"] = checked, mismatched
    out["lost"] += mismatched


def _rounds_summary(feds: dict[str, Any], rounds: dict[tuple[str, int], Any], rows: list[Any]) -> dict[str, Any]:
    """Per federation: rounds closed, and device-rounds that closed without the device's update (its deadline
    passed: never accepted, so not lost; the device sits that round out)."""
    counts = Counter((u.federation, u.round) for u in rows)
    out: dict[str, Any] = {}
    for f in feds:
        closed = [(t, r) for (g, t), r in rounds.items() if g == f and r.closed_at is not None and t > 0]
        out[f] = {"closed": len(closed), "round_now": feds[f].round, "state_now": feds[f].state,
                  "device_rounds_missed": sum(max(0, r.active - counts[f, t]) for t, r in closed),
                  "rounds_without_every_device": sum(1 for t, r in closed if counts[f, t] < r.active)}
    return out


def _check_devices(device_dirs: list[Path], by_key: dict[tuple[str, int, str], list[Any]], devices: dict[str, Any],
                   state_dir: Any) -> list[dict[str, Any]]:
    """Each device's saved progress and model against the server's rows for it."""
    res = []
    for d in device_dirs:
        sd = state_dir(d)
        enr = sd.enrolment
        if enr is None:
            res.append({"device": d.name, "consistent": False, "why": "never enrolled"})
            continue
        fed, dev = enr["federation"], enr["device_id"]
        prog = sd.progress
        got = sd.load_tensors_meta("model.safetensors")
        model_round = int(got[1].get("round", "0")) if got is not None else -1
        server_rounds = sorted(t for (f, t, x) in by_key if f == fed and x == dev)
        last = server_rounds[-1] if server_rounds else None
        row = by_key.get((fed, prog.round, dev), [])
        why = _device_verdict(prog, model_round, last, row, (fed, model_round, dev) in by_key)
        res.append({"device": d.name, "device_id": dev, "progress_round": prog.round, "posted": prog.posted,
                    "abandoned": prog.abandoned, "model_round": model_round, "server_last_round": last,
                    "server_updates": len(server_rounds), "consistent": why is None, "why": why})
    return res


def _device_verdict(prog: Any, model_round: int, last: int | None, row: list[Any], ahead_on_server: bool) -> str | None:
    """None if the device's state matches the server; else why not."""
    if model_round < prog.round:
        return f"its model is of round {model_round}, its progress of round {prog.round}"
    if model_round > prog.round and ahead_on_server:
        return f"trained round {model_round} (not staged) but the server holds an update of that round"
    if last is not None and last > max(prog.round, model_round):
        return f"the server holds an update of round {last}, the device is at round {prog.round}"
    counted = prog.round > 0 and prog.posted and prog.abandoned != prog.round
    if (counted or (prog.round == 0 and prog.initial_sent)) and [u.digest for u in row] != [prog.digest]:
        return f"posted round {prog.round} ({prog.digest}) but the server holds {[u.digest for u in row]}"
    if prog.posted and prog.abandoned == prog.round and row:
        return f"abandoned round {prog.round} but the server counted an update of it"
    if not prog.posted and row and row[0].digest != prog.digest:
        return f"round {prog.round} pending with {prog.digest}, the server holds {row[0].digest}"
    return None


def _recompute(sessions: Any, blob_dir: Path, feds: dict[str, Any],
               rounds: dict[tuple[str, int], Any]) -> dict[str, Any]:
    """Each closed round with a server model: its published average against one recomputed, by the server's own
    code under the federation's aggregation rule, from the round's start model and its update rows (slot order;
    the updates' norms recomputed from the blobs, not taken from the rows)."""
    import torch
    from sqlalchemy import select

    from server.blobs import DirBlobStore
    from server.db import Device, Update
    from server.services import BlobAccess, Planner, Publisher, RoundMachine, Store

    store = Store(sessions)
    access = BlobAccess(store, DirBlobStore(blob_dir))
    machine = RoundMachine(store, access, Planner(store, access), Publisher(store, None))
    try:
        from server.services.updates import aggregation_rule
    except ImportError:  # a server without aggregation rules: the algorithm's plain average
        aggregation_rule = None
    res: dict[str, Any] = {"checked": 0, "mismatched": 0, "unverifiable": 0, "max_abs_diff": 0.0, "errors": []}
    for (fed_id, t), r in sorted(rounds.items()):
        if r.closed_at is None or r.start_digest is None or r.base_digest is None:
            continue
        fm = store.model(feds[fed_id])
        with sessions() as s:
            ups = [(u.digest, u.n_samples, kp) for u, kp in s.execute(
                select(Update, Device.kp).join(Device, Device.id == Update.device)
                .where(Update.federation == fed_id, Update.round == t).order_by(Device.slot))]
            try:  # a small round's bound takes the previous round's norms too, as the close did
                from server.services.rounds import norm_history
                history = norm_history(s, fed_id, t, len(ups))
            except ImportError:  # a server of before the shared definition: none
                history = []
        try:
            rule = () if aggregation_rule is None else (aggregation_rule(feds[fed_id]),)
            new = machine.average(fm, r.start_digest, ups, *rule, **({"history": history} if history else {}))
            pub = access.load(r.base_digest, fm).tensors
        except Exception as e:  # a blob collected, or the server's code moved on: say so, never guess
            res["unverifiable"] += 1
            if len(res["errors"]) < 5:
                res["errors"].append(f"{fed_id} round {t}: {type(e).__name__}: {e}")
            continue
        res["checked"] += 1
        diff = max((float((new[k].double() - pub[k].double()).abs().max()) for k in pub if k in new), default=0.0)
        same = set(new) == set(pub) and all(torch.equal(new[k].to(pub[k].dtype), pub[k]) for k in pub)
        res["max_abs_diff"] = max(res["max_abs_diff"], diff)
        if not same:
            res["mismatched"] += 1
    return res
