"""A second device, written from the specification alone (tests/spec_device/: docs/protocol.md, docs/codec.md),
takes part in real FedPer and DisPFL rounds beside agent devices. The device shares no code with this repository
(checked from its source, and from the modules its process imported); the test side uses the repository's codec
and launcher to check what it sent.

- its codec and ``pfl_edge.codec`` read each other's payloads, every mask coding included, refuse the same
  corrupted payloads, and it meets every golden and negative vector of docs/vectors;
- FedPer: its update is accepted every round and each published base is the n_samples-weighted mean of the three
  uploaded base parts, recomputed here in float64;
- DisPFL: its sparse uploads are accepted, decode to exactly its own values and mask, agents that have it as an
  in-neighbour are told its digest, and its own neighbour average follows the spec."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from sqlalchemy import create_engine, text

from edge_runtime.fleet import Federation, start_server
from pfl_edge.codec import decode, encode

SPEC = Path(__file__).resolve().parents[1] / "spec_device"
THIRD_PARTY = {"httpx", "paho", "numpy", "onnxruntime"}
REPOSITORY = {"pfl_edge", "edge_runtime", "server", "export", "device_profiles", "tests", "bench"}
CONFIG: dict[str, Any] = dict(dataset="synthetic", partition="pathological:2", clients=3, samples_per_client=48,
                              test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=5)
# plain weighted mean: no clipping of update norms, no cap below the declared sample counts
EXACT_MEAN = {"rule": "mean", "max_update_norm": None, "norm_multiple": None, "max_samples": 1_000_000}
SPEC_SLOT, SPEC_SAMPLES = 2, 37


def _spec_codec() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_device_codec", SPEC / "codec.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_the_spec_device_imports_nothing_of_this_repository() -> None:
    local = {p.stem for p in SPEC.glob("*.py")}
    files = sorted(SPEC.glob("*.py"))
    assert {"codec", "device"} <= local
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}: relative import"
                roots = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Name):
                assert node.id != "__import__", f"{path.name}: __import__"
                continue
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                # nothing that could reach the repository's packages by another door
                assert (node.value.id, node.attr) != ("sys", "path"), f"{path.name} touches sys.path"
                continue
            else:
                continue
            for root in roots:
                assert root in sys.stdlib_module_names or root in THIRD_PARTY or root in local, (path.name, root)
                assert root not in REPOSITORY | {"importlib"}, (path.name, root)


def _random(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_the_two_codecs_read_each_other_in_every_mask_coding() -> None:
    sc = _spec_codec()
    rng = np.random.default_rng(0)
    shapes = {"a.weight": (40, 50), "b.weight": (30, 60), "c.weight": (25, 80), "c.bias": (7,)}
    tensors = {k: _random(s, rng) for k, s in shapes.items()}
    # near-empty, half and near-full masks: the codec picks a different mask coding for each
    masks = {k: rng.random(s) < p for (k, s), p in zip(list(shapes.items())[:3], (0.03, 0.5, 0.97), strict=True)}
    sent = {k: np.where(masks[k], a, 0).astype(np.float32) if k in masks else a for k, a in tensors.items()}
    theirs = encode({k: torch.from_numpy(a) for k, a in sent.items()}, model_id="m-1", round=3,
                    masks={k: torch.from_numpy(m) for k, m in masks.items()})
    got = sc.decode(theirs)
    assert got.model_id == "m-1" and got.round == 3
    assert {got.codings[k] for k in masks} == {"bitmap", "rice0", "rice1"}  # each coding was exercised
    for k in shapes:
        np.testing.assert_array_equal(got.tensors[k], sent[k])
    assert set(got.masks) == set(masks) and all(np.array_equal(got.masks[k], masks[k]) for k in masks)
    # and back: the spec device's bytes, read by the repository's codec
    ours = sc.encode(sent, model_id="m-1", round=3, masks=masks)
    back = decode(ours, expected=shapes, model_id="m-1")
    assert back.round == 3
    for k in shapes:
        np.testing.assert_array_equal(back.tensors[k].numpy(), sent[k])
    assert all(np.array_equal(back.masks[k].numpy(), masks[k]) for k in masks)
    dense = sc.encode({k: tensors[k] for k in shapes}, model_id="m-2", round=1)
    assert all(np.array_equal(decode(dense).tensors[k].numpy(), tensors[k]) for k in shapes)


def test_the_two_codecs_refuse_the_same_corrupted_payloads() -> None:
    """Payloads corrupted in their header numbers or data (trailer recomputed, so the checks past the sha256
    run): the spec device's decoder accepts exactly those the repository's decoder accepts, with equal values."""
    sc = _spec_codec()
    rng = np.random.default_rng(11)
    checked = refused = 0
    for i in range(40):
        n = int(rng.integers(1, 200))
        m = rng.random(n) < (0.03, 0.5, 0.97, 0.2)[i % 4]
        v = np.where(m, rng.standard_normal(n), 0).astype(np.float32)
        good = encode({"x": torch.from_numpy(v), "d": torch.ones(2, 3)}, model_id="m", round=i,
                      masks={"x": torch.from_numpy(m)})
        for _ in range(25):
            bad = _corrupt(good, rng)
            try:
                ref: Any = decode(bad)
            except Exception:
                ref = None
            try:
                ours: Any = sc.decode(bad)
            except sc.CodecError:
                ours = None
            assert (ref is None) == (ours is None), bad[9:9 + int.from_bytes(bad[5:9], "little")]
            if ref is not None:
                assert all(np.array_equal(ref.tensors[k].numpy(), ours.tensors[k]) for k in ref.tensors)
            checked, refused = checked + 1, refused + (ref is None)
    assert refused > checked // 3 and refused < checked  # both outcomes were exercised


def _corrupt(good: bytes, rng: np.random.Generator) -> bytes:
    hlen = int.from_bytes(good[5:9], "little")
    head, data = good[9:9 + hlen].decode(), good[9 + hlen:-32]
    if rng.random() < 0.5:  # one number of the header moved by -3 ... 3
        spans = [(a, b) for a, b in _numbers(head)]
        a, b = spans[int(rng.integers(0, len(spans)))]
        head = head[:a] + str(max(0, int(head[a:b]) + int(rng.integers(-3, 4)))) + head[b:]
    else:  # one bit of the data flipped
        flipped = bytearray(data)
        flipped[int(rng.integers(0, len(flipped)))] ^= 1 << int(rng.integers(0, 8))
        data = bytes(flipped)
    body = good[:5] + len(head).to_bytes(4, "little") + head.encode() + data
    return body + hashlib.sha256(body).digest()


def _numbers(text: str) -> list[tuple[int, int]]:
    return [(mm.start(), mm.end()) for mm in re.finditer(r"\d+", text)]


VECTORS = Path(__file__).resolve().parents[2] / "docs" / "vectors"


def _bits(a: np.ndarray) -> list[str]:
    return [format(int(x), "08x") for x in np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)]


def test_the_spec_codec_meets_the_golden_vectors() -> None:
    """docs/vectors: every positive vector decodes to its JSON (bit for bit) and, where it is f32, the spec
    device's encoder writes the same bytes from that JSON; every negative vector is refused."""
    sc = _spec_codec()
    index = json.loads((VECTORS / "index.json").read_text())  # {"format", "positive", "negative"}
    positives = [VECTORS / e["json"] for e in index["positive"]]
    assert len(positives) >= 10
    encoded = 0
    for p in positives:
        want = json.loads(p.read_text())
        data = (VECTORS / f"{want['vector']}.bin").read_bytes()
        got = sc.decode(data)
        assert (got.model_id, got.round, list(got.tensors)) == (want["model"], want["round"],
                                                                 [t["name"] for t in want["tensors"]])
        tensors, masks = {}, {}
        for t in want["tensors"]:
            a = got.tensors[t["name"]]
            assert list(a.shape) == t["shape"], (p.name, t["name"])
            sent = np.zeros(a.size, dtype=bool)
            sent[t["mask_ones"] if t["coding"] else slice(None)] = True
            assert _bits(a.reshape(-1)[sent]) == t["f32_bits"], (p.name, t["name"])
            assert not a.reshape(-1)[~sent].any()
            if t["coding"]:
                assert got.codings[t["name"]] == t["coding"]
                np.testing.assert_array_equal(got.masks[t["name"]].reshape(-1), sent)
                masks[t["name"]] = sent.reshape(t["shape"])
            tensors[t["name"]] = a
        if all(t["dtype"] == "f4" for t in want["tensors"]):
            assert sc.encode(tensors, model_id=want["model"], round=want["round"], masks=masks) == data, p.name
            encoded += 1
    assert encoded >= 10
    negatives = index["negative"]
    assert len(negatives) >= 20
    for case in negatives:
        args = dict(case["decode_args"])
        if "expected" in args:
            args["expected"] = {k: tuple(v) for k, v in args["expected"].items()}
        with pytest.raises(sc.CodecError):
            sc.decode((VECTORS / case["file"]).read_bytes(), **args)


def _start_spec_device(fed: Federation, slot: int, **flags: Any) -> subprocess.Popen[bytes]:
    """The spec device as its own process: a plain script run, beside (not inside) this repository's packages."""
    state = fed.root / "devices" / f"spec-{slot:02d}"
    state.mkdir(parents=True, exist_ok=True)
    # -X importtime lists every module the process imports (on stderr, into its log): checked after the run
    cmd = [sys.executable, "-X", "importtime", str(SPEC / "device.py"), "--server", fed.url, "--federation", fed.fed,
           f"--enrol-secret={fed.secret}", "--index", str(slot), "--state-dir", str(state),
           "--n-samples", str(SPEC_SAMPLES), "--profile", "phone-mid"]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    log = open(fed.root / "devices" / f"spec-{slot:02d}.log", "ab")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=state)


def _run(tmp_path: Path, config: dict[str, Any], timeout_s: float = 90) -> tuple[Federation, Path]:
    """Two agents (slots 0, 1) and the spec device (slot 2) to the federation's end."""
    fed = start_server(tmp_path / "run")
    try:
        fed.create(f"spec{int(time.time() * 1000) % 10**9}", config, deadline_s=60.0, aggregation=EXACT_MEAN)
        for i in range(2):
            fed.start_device(i, "phone-mid", extra=["--training-backend", "torch"])
        spec = _start_spec_device(fed, SPEC_SLOT)
        procs = [*fed.devices, spec]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if fed.info()["state"] == "finished" and all(p.poll() is not None for p in procs):
                break
            for i, p in enumerate(procs):
                assert p.poll() in (None, 0), f"device {i} exited with {p.returncode}: " + _log(fed, i)
            time.sleep(0.3)
        else:
            raise AssertionError("the federation did not finish: " + _log(fed, 2) + _log(fed, 0))
        assert spec.returncode == 0
        return fed, tmp_path / "run" / "devices" / f"spec-{SPEC_SLOT:02d}"
    except BaseException:
        fed.close()
        raise


def _assert_imported_nothing_of_the_repository(fed: Federation) -> None:
    """At run time too: no module of this repository was imported by the spec device's process."""
    lines = (fed.root / "devices" / f"spec-{SPEC_SLOT:02d}.log").read_text().splitlines()
    modules = {line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:") and "|" in line}
    roots = {m.split(".")[0] for m in modules}
    assert {"numpy", "httpx", "paho", "codec"} <= roots  # the listing works
    assert not roots & REPOSITORY, sorted(roots & REPOSITORY)


def _log(fed: Federation, i: int) -> str:
    p = fed.root / "devices" / (f"spec-{i:02d}.log" if i == SPEC_SLOT else f"device-{i:02d}.log")
    return p.read_text()[-3000:] if p.exists() else ""


def _rows(fed: Federation, sql: str) -> list[Any]:
    engine = create_engine(f"sqlite:///{fed.root / 'server' / 'state.db'}")
    with engine.connect() as c:
        rows = list(c.execute(text(sql), {"f": fed.fed}).all())
    engine.dispose()
    return rows


def _blob(fed: Federation, digest: str) -> bytes:
    path = next(p for p in (fed.root / "server").rglob(digest) if p.is_file())
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest
    return data


def test_fedper_round_with_the_spec_device(tmp_path: Path) -> None:
    rounds = 3
    fed, state = _run(tmp_path, {**CONFIG, "algorithm": "fedper", "kp": 2, "rounds": rounds})
    try:
        spec_id = json.loads((state / "enrolment.json").read_text())["device_id"]
        _assert_imported_nothing_of_the_repository(fed)
        updates = _rows(fed, "SELECT round, device, digest, n_samples FROM pfl_updates WHERE federation = :f")
        metrics = _rows(fed, "SELECT round, device FROM pfl_metrics WHERE federation = :f")
    finally:
        fed.close()
    # metrics of round t - 1 during round t, and of round T at the final task: every round once
    assert sorted(m.round for m in metrics if m.device == spec_id) == list(range(1, rounds + 1))
    for t in range(1, rounds + 1):
        mine = [u for u in updates if u.round == t and u.device == spec_id]
        assert len(mine) == 1 and mine[0].n_samples == SPEC_SAMPLES, t  # accepted, counted with its weight
        assert mine[0].digest == hashlib.sha256((state / f"upload-{t}.bin").read_bytes()).hexdigest()
        sent = [u for u in updates if u.round == t]
        assert len(sent) == 3
        # the base it was given for round t + 1 (or its final task): the weighted mean of round t's uploads
        nxt = state / (f"task-{t + 1}.json" if t < rounds else f"task-{t}-final.json")
        published = decode(_blob(fed, json.loads(nxt.read_text())["base"])).tensors
        parts = [(u.n_samples, decode(_blob(fed, u.digest)).tensors) for u in sent]
        assert {k for _, p in parts for k in p} == set(published)  # base parts only, the published base's keys
        total = sum(n for n, _ in parts)
        for k, pub in published.items():
            mean = sum(n * p[k].double().numpy() for n, p in parts) / total
            np.testing.assert_array_max_ulp(pub.numpy(), mean.astype(np.float32), maxulp=1)
        # and the spec device trained on exactly what was published for its round: + delta on every element
        given = decode(_blob(fed, json.loads((state / f"task-{t}.json").read_text())["base"])).tensors
        own = decode((state / f"upload-{t}.bin").read_bytes())
        assert own.round == t and set(own.tensors) == set(given)
        for k in given:
            np.testing.assert_array_equal(own.tensors[k].numpy(), given[k].numpy() + np.float32(0.01), err_msg=k)
    # the whole log: a connect early in the run falls out of _log's tail when a loaded machine logs more after it
    log = (fed.root / "devices" / f"spec-{SPEC_SLOT:02d}.log").read_text()
    assert "mqtt: connected" in log and "mqtt: bell" in log  # its own credentials, its own task topic


def test_dispfl_rounds_with_the_spec_device(tmp_path: Path) -> None:
    rounds = 2
    fed, state = _run(tmp_path, {**CONFIG, "algorithm": "dispfl", "density": 0.5, "topology": "random:2",
                                 "rounds": rounds})
    try:
        enr = json.loads((state / "enrolment.json").read_text())
        _assert_imported_nothing_of_the_repository(fed)
        updates = _rows(fed, "SELECT round, device, digest FROM pfl_updates WHERE federation = :f")
        metrics = _rows(fed, "SELECT round, device FROM pfl_metrics WHERE federation = :f")
        blobs = {u.digest: decode(_blob(fed, u.digest)) for u in updates}
    finally:
        fed.close()
    assert sorted(m.round for m in metrics if m.device == enr["device_id"]) == list(range(1, rounds + 1))
    first_mask: dict[str, np.ndarray] = {}
    for t in range(rounds + 1):
        mine = [u for u in updates if u.round == t and u.device == enr["device_id"]]
        payload = (state / f"upload-{t}.bin").read_bytes()
        assert len(mine) == 1 and mine[0].digest == hashlib.sha256(payload).hexdigest(), t  # accepted
        got, own = decode(payload), np.load(state / f"sent-{t}.npz")
        assert got.round == t and set(got.masks) == set(got.tensors)  # every tensor travels with its mask
        for k, a in got.tensors.items():  # the repository's codec reads exactly what the device meant to send
            np.testing.assert_array_equal(a.numpy(), own[f"w:{k}"])
            np.testing.assert_array_equal(got.masks[k].numpy(), own[f"m:{k}"])
            assert not a.numpy()[~own[f"m:{k}"]].any()
            first_mask.setdefault(k, own[f"m:{k}"])
            np.testing.assert_array_equal(own[f"m:{k}"], first_mask[k])  # it keeps its own mask
    ones = sum(int(m.sum()) for m in first_mask.values())
    assert abs(ones / sum(m.size for m in first_mask.values()) - enr["density"]) < 0.02  # ERK at its density
    # agents with it as an in-neighbour were told its digest and fetched it (their round closed with them)
    for t in range(1, rounds + 1):
        theirs = [u for u in updates if u.round == t and u.device != enr["device_id"]]
        assert len(theirs) == 2, t
    fetched = _fetched(fed)
    for t in range(1, rounds + 1):  # its model of round t - 1 is what in-neighbours average in round t
        spec_digest = next(u.digest for u in updates if u.round == t - 1 and u.device == enr["device_id"])
        assert spec_digest in fetched, f"round {t}: no agent downloaded the spec device's model"
    _check_own_average(state, blobs, rounds)


def _fetched(fed: Federation) -> set[str]:
    """The blobs agents downloaded, from their logs (``-v``: one line per HTTP request)."""
    out = set()
    for i in range(2):
        for line in (fed.root / "devices" / f"device-{i:02d}.log").read_text().splitlines():
            if "GET " in line and "/v1/blobs/" in line and " 200 " in line:
                out.add(line.split("/v1/blobs/")[1][:64])
    return out


def _check_own_average(state: Path, blobs: dict[str, Any], rounds: int) -> None:
    """Recompute its round-t model from what it was sent (protocol.md "DisPFL"): each model counts where the
    mask that travels with it covers a coordinate; then its own mask; then its training, + 0.01 on the mask."""
    for t in range(1, rounds + 1):
        prev = np.load(state / f"sent-{t - 1}.npz")
        mask = {k[2:]: prev[k] for k in prev.files if k.startswith("m:")}
        total = {k: np.where(m, prev[f"w:{k}"], 0).astype(np.float64) for k, m in mask.items()}
        count = {k: m.astype(np.int64) for k, m in mask.items()}
        task = json.loads((state / f"task-{t}.json").read_text())
        assert task["neighbours"], t
        for nb in task["neighbours"]:
            got = blobs[nb["digest"]]
            for k, a in got.tensors.items():
                m = got.masks[k].numpy() if k in got.masks else np.ones(a.shape, dtype=bool)
                total[k] += np.where(m, a.double().numpy(), 0)
                count[k] += m
        now = np.load(state / f"sent-{t}.npz")
        for k, m in mask.items():
            avg = np.where(count[k] > 0, total[k] / np.maximum(count[k], 1), 0)
            want = np.where(m, avg + 0.01, 0)
            np.testing.assert_allclose(now[f"w:{k}"], want, rtol=1e-6, atol=1e-6, err_msg=f"{t} {k}")
