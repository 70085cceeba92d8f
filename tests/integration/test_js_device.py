"""The JavaScript device (devices/js, issue 31 stage 2) in real federations beside Python agents: a server with its
embedded broker, 3 slots of Fashion-MNIST (``pathological:2``), 3 rounds, the JS device in slot 2. It enrols with the
secret, logs in to the broker with its own credentials, deals its slot's samples itself (numpy's PCG64 and torch's
MT19937 streams, reimplemented in TypeScript), trains through the server's ONNX training program in
onnxruntime-node with its own SGD, and evaluates with the ONNX inference program.

FedPer: every update of the JS device is accepted (the devices listing: none refused, its last round the last; every
round counts 3 updates), it reports metrics for every round (1..3, the last from its final task), the federation
finishes and every device exits 0, its log holds no error, and what it uploaded is its base part only (its personal
blocks never left it). Then the simulator runs the same config (on one thread, as the agents do): the JS device's
final model equals the simulator's model of its slot to float32 rounding (docs/model.md, "What a device on a program
shares with the simulator"; held to 1e-4, measured 5e-6 for FedPer, 1e-6 for DisPFL, 2e-5 for Ditto), and its final
accuracy is the simulator's within one test sample. The same with the JS device killed (SIGKILL) after its first
update and started again on its state dir: it resumes and ends with the same model. DisPFL: its initial sparse model
and every round's are accepted, each carries its masks (exactly ERK's count of ones), and its deployed model is the
simulator's. Ditto: it sends its copy of the global model and deploys its personal one, the simulator's.
Dirichlet (``dirichlet-client:0.5`` on synthetic data, 2 rounds): a partition the JS device cannot deal, so it takes
its slot's share from the server (``GET /v1/devices/me/share``), reports the simulator's accuracy of its slot in
every round and ends with the simulator's model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedkit import device_log, ended

from edge_runtime.fleet import Federation, start_server
from pfl_edge.protocol import API_PREFIX

JS = Path(__file__).resolve().parents[2] / "devices" / "js"
JS_SLOT = 2
CONFIG: dict[str, Any] = dict(algorithm="fedper", dataset="fashion-mnist", partition="pathological:2", clients=3,
                              rounds=3, samples_per_client=300, local_epochs=1, batch_size=32, lr=0.05, kp=2,
                              clip_norm=10.0, workers=1, seed=5)
# the plain sample-weighted mean (no clipping of update norms), on the server and, for the comparison, in the
# simulator too (_simulate): the arithmetic alone. At the default rule (1x the others' low median since issue 49;
# 3x before clipped nothing here) the Ditto run's JS model was 1.8e-4 off the simulator's at most, past the 1e-4
# tolerance (2e-5 to 3e-5 at the plain mean), as the clipped updates carry the JS device's float32 differences
EXACT_MEAN = {"rule": "mean", "max_update_norm": None, "norm_multiple": None, "max_samples": 1_000_000}
BASE_KEYS = {"conv1.0.weight", "conv1.0.bias", "conv2.0.weight", "conv2.0.bias", "fc1.1.weight", "fc1.1.bias"}


def _why_not() -> str | None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node and npm are not installed"
    if not (JS / "node_modules").is_dir():
        return "devices/js/node_modules is missing (cd devices/js && npm ci)"
    return None


def _build() -> Path:
    """``npm run build`` (tsc) unless dist/ is newer than every source file; the device's entry point."""
    entry = JS / "dist" / "bin" / "device.js"
    sources = [p for d in ("src", "bin") for p in (JS / d).rglob("*.ts")]
    if not entry.exists() or max(p.stat().st_mtime for p in sources) > entry.stat().st_mtime:
        subprocess.run(["npm", "run", "build"], cwd=JS, check=True, capture_output=True, timeout=300)
    return entry


def _start_js(fed: Federation, entry: Path, slot: int) -> subprocess.Popen[bytes]:
    """``node dist/bin/device.js ...`` for ``slot``, logging to devices/device-NN.log like the agents; it takes slot
    ``slot``'s place in ``fed.devices`` (a restart replaces the process it had)."""
    state = fed.root / "devices" / f"device-{slot:02d}"
    state.mkdir(parents=True, exist_ok=True)
    log = open(fed.root / "devices" / f"device-{slot:02d}.log", "ab")  # noqa: SIM115 (the child owns it)
    cmd = ["node", str(entry), "--server", fed.url, "--federation", fed.fed, "--enrol-secret", fed.secret,
           "--profile", "phone-mid", "--state-dir", str(state), "--partition-id", str(slot), "--threads", "1",
           "--name", f"js-{slot:02d}", "-v"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if slot < len(fed.devices):
        fed.devices[slot] = proc
    else:
        assert slot == len(fed.devices), "start the devices in slot order"
        fed.devices.append(proc)
    return proc


def _ledger(root: Path) -> list[dict[str, Any]]:
    p = root / "devices" / f"device-{JS_SLOT:02d}" / "ledger.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line] if p.exists() else []


def _run(tmp_path: Path, config: dict[str, Any], *, kill_after: int | None = None) -> dict[str, Any]:
    """A federation of ``config`` with the JS device in slot ``JS_SLOT`` and agents (torch, one thread) in the
    others, run to its end; ``kill_after``: SIGKILL the JS device once the server accepted its update of that round,
    and start it again on its state dir. Returns the metrics, the devices listing and the JS device's log."""
    entry = _build()
    root = tmp_path / "run"
    fed = start_server(root)
    killed = False
    try:
        fed.create(f"js{int(time.time() * 1000) % 10**9}", config, deadline_s=600, aggregation=EXACT_MEAN)
        for i in range(config["clients"]):
            if i == JS_SLOT:
                _start_js(fed, entry, i)
            else:
                fed.start_device(i, "phone-mid", extra=["--training-backend", "torch"])
        t0 = time.monotonic()
        while not ended(fed, root, fed.info()):
            assert time.monotonic() - t0 < 600, (fed.info(), device_log(root, JS_SLOT))
            if kill_after is not None and not killed and any(u["round"] == kill_after for u in _ledger(root)):
                fed.devices[JS_SLOT].send_signal(signal.SIGKILL)
                fed.devices[JS_SLOT].wait()
                killed = True
                _start_js(fed, entry, JS_SLOT)
            time.sleep(0.05 if kill_after is not None and not killed else 1.0)
        assert kill_after is None or killed
        out = {"metrics": fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics"),
               "devices": fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices"), "root": root}
    finally:
        fed.close()
    out["log"] = (root / "devices" / f"device-{JS_SLOT:02d}.log").read_text()
    print(out["log"][-3000:])
    errors = [line for line in out["log"].splitlines() if " ERROR " in line or "Error" in line or "    at " in line]
    assert not errors, errors[:20]  # no error logged, no exception, no stack trace
    return out


def _simulate(config: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The simulator's run of ``config`` on one thread (the agents' count: their models are then the simulator's bit
    for bit) at the federation's rule, the plain mean (``EXACT_MEAN``), and its model of the JS device's slot."""
    import torch

    import pfl_edge.aggregate as aggregate
    from pfl_edge.aggregate import AggregationRule
    from pfl_edge.checkpoint import load_checkpoint
    from pfl_edge.sim import SimConfig, simulate

    threads, rule = torch.get_num_threads(), aggregate.DEFAULT_RULE
    torch.set_num_threads(1)
    aggregate.DEFAULT_RULE = AggregationRule(norm_multiple=None)  # EXACT_MEAN's rule; CentralSimulation reads it
    try:
        sim = simulate(SimConfig.from_dict(config), save_dir=tmp_path / "sim", progress=False)
    finally:
        torch.set_num_threads(threads)
        aggregate.DEFAULT_RULE = rule
    ref = load_checkpoint(tmp_path / "sim" / f"client_{JS_SLOT:03d}.safetensors")[0]
    return sim, {k: v.numpy() for k, v in ref.items()}


def _final_model(root: Path) -> dict[str, np.ndarray]:
    """What the JS device deploys at the end (its state dir's final.bin: u32 meta length, meta, a codec payload)."""
    from pfl_edge.codec import decode

    final = (root / "devices" / f"device-{JS_SLOT:02d}" / "final.bin").read_bytes()
    n = int.from_bytes(final[:4], "little")
    return {k: np.asarray(v) for k, v in decode(final[4 + n:], arrays="numpy").tensors.items()}


def _compare(out: dict[str, Any], sim: dict[str, Any], ref: dict[str, np.ndarray], *, tol: float = 1e-4) -> None:
    mine = _final_model(out["root"])
    assert set(mine) == set(ref)
    diffs = {k: float(np.abs(mine[k] - ref[k]).max()) for k in ref}
    print(f"the JS device's final model against the simulator's slot {JS_SLOT}: max |diff| per tensor {diffs}")
    for k in ref:
        np.testing.assert_allclose(mine[k], ref[k], atol=tol, rtol=tol, err_msg=k)
    js_id = next(d["device_id"] for d in out["devices"] if d["index"] == JS_SLOT)
    m = [r for r in out["metrics"]["rounds"] if r["round"] >= 1][-1]["devices"][js_id]
    acc_sim = sim["rounds"][-1]["client_acc"][JS_SLOT]
    print(f"final accuracy: JS {m['accuracy']:.4f}, simulator {acc_sim:.4f} ({m['n_test']} test samples)")
    assert abs(m["accuracy"] - acc_sim) <= 1.0 / m["n_test"] + 1e-9, (m["accuracy"], acc_sim)


def _check_rounds(out: dict[str, Any], first: int, last: int = 3) -> str:
    """The JS device: nothing refused, its update counted in every round from ``first`` to ``last``, its metrics in
    every training round; returns its id."""
    js = next(d for d in out["devices"] if d["index"] == JS_SLOT)
    assert js["refused"] == 0 and js["dropped"] == 0 and not js["revoked"], js
    assert js["last_round"] == last and js["bytes_up"] > 0 and js["bytes_down"] > 0, js
    rounds = out["metrics"]["rounds"]
    assert [r["round"] for r in rounds if r["round"] >= first] == list(range(first, last + 1)), rounds
    for r in rounds:
        if r["round"] >= first:
            assert r["updates"] == 3, r
        if r["round"] >= 1:
            m = r["devices"][js["device_id"]]  # its metrics of every round (FedPer: the last from its final task)
            assert 0 <= m["accuracy"] <= 1 and m["loss"] >= 0 and m["n_test"] > 0, m
    return str(js["device_id"])


def _skip_without_node() -> None:
    why = _why_not()
    if why is not None:
        pytest.skip(why)


@pytest.mark.slow  # about a minute: a server, two Python agents and the JS device, three rounds
@pytest.mark.needs_fmnist
def test_js_device_trains_in_a_fedper_federation(tmp_path: Path) -> None:
    _skip_without_node()
    from pfl_edge.codec import decode

    out = _run(tmp_path, CONFIG)
    _check_rounds(out, 1)
    # its uploads, as the server stored them: base parts only (its personal blocks never left it)
    sent = _ledger(out["root"])
    assert [u["round"] for u in sent] == [1, 2, 3] and all(u["n_samples"] == 300 for u in sent), sent
    for u in sent:
        got = decode((out["root"] / "server" / "blobs" / u["digest"][:2] / u["digest"]).read_bytes(), arrays="numpy")
        assert set(got.tensors) == BASE_KEYS and not got.masks and got.round == u["round"], sorted(got.tensors)
    _compare(out, *_simulate(CONFIG, tmp_path))


@pytest.mark.slow  # about a minute
@pytest.mark.needs_fmnist
def test_js_device_aggregates_securely_beside_python_agents(tmp_path: Path) -> None:
    """SecAgg+ (docs/secagg.md) with the JS device among the three: its keys, sealed shares and unmask shares (Web
    Crypto) work with the Python agents' and the server's; every update it stored on the server is a masked input
    of its round, and it ends with the simulator's model as in the plain federation."""
    _skip_without_node()
    from pfl_edge.secagg import decode_masked
    from server.fedmodel import fed_model

    config = {**CONFIG, "secure_aggregation": {"bound": 0.5, "bits": 16}}
    out = _run(tmp_path, config)
    _check_rounds(out, 1)
    sent = _ledger(out["root"])
    size = fed_model(config).secure_size()
    assert [u["round"] for u in sent] == [1, 2, 3], sent
    for u in sent:
        blob = (out["root"] / "server" / "blobs" / u["digest"][:2] / u["digest"]).read_bytes()
        assert decode_masked(blob, size)[0] == u["round"]
    # quantizing is a step function: a device's update within float32 rounding of the simulator's can round a
    # coordinate to the next level (2 x 0.5 / 65535 / 3 survivors = 5.1e-6 in the mean; seen in round 1, on the
    # Python agents as on this device), and three rounds of training carry such flips to about 2e-4
    _compare(out, *_simulate(config, tmp_path), tol=1e-3)


@pytest.mark.slow
@pytest.mark.needs_fmnist
def test_js_device_killed_mid_federation_resumes_from_its_state_dir(tmp_path: Path) -> None:
    _skip_without_node()
    out = _run(tmp_path, CONFIG, kill_after=1)
    assert out["log"].count("connected to the broker") >= 2, "it ran twice"
    _check_rounds(out, 1)
    assert [u["round"] for u in _ledger(out["root"])] == [1, 2, 3]  # each round's update sent once
    _compare(out, *_simulate(CONFIG, tmp_path))


DISPFL: dict[str, Any] = {**CONFIG, "algorithm": "dispfl", "density": 0.5, "topology": "full", "kp": 0}


@pytest.mark.slow
@pytest.mark.needs_fmnist
def test_js_device_trains_in_a_dispfl_federation(tmp_path: Path) -> None:
    _skip_without_node()
    from pfl_edge.codec import decode
    from pfl_edge.sparse import erk_densities, mask_ones

    out = _run(tmp_path, DISPFL)
    _check_rounds(out, 0)
    sent = _ledger(out["root"])
    assert [u["round"] for u in sent] == [0, 1, 2, 3], sent
    shapes = {"conv1.0.weight": (32, 1, 5, 5), "conv1.0.bias": (32,), "conv2.0.weight": (64, 32, 5, 5),
              "conv2.0.bias": (64,), "fc1.1.weight": (128, 3136), "fc1.1.bias": (128,), "fc2.0.weight": (64, 128),
              "fc2.0.bias": (64,), "head.weight": (10, 64), "head.bias": (10,)}
    ones = mask_ones(shapes, erk_densities(shapes, 0.5))
    for u in sent:  # its sparse models: every tensor, masked where ERK keeps fewer than all, exactly ERK's count
        got = decode((out["root"] / "server" / "blobs" / u["digest"][:2] / u["digest"]).read_bytes(), arrays="numpy")
        assert set(got.tensors) == set(shapes) and got.round == u["round"]
        for k, n in ones.items():
            if n < int(np.prod(shapes[k])):
                assert int(np.asarray(got.masks[k]).sum()) == n, (u["round"], k)
            else:
                assert k not in got.masks, k
    _compare(out, *_simulate(DISPFL, tmp_path))


DITTO: dict[str, Any] = {**CONFIG, "algorithm": "ditto", "kp": 0, "options": {"lam": 0.1}}


@pytest.mark.slow
@pytest.mark.needs_fmnist
def test_js_device_trains_in_a_ditto_federation(tmp_path: Path) -> None:
    """Ditto: the JS device sends its copy of the global model (every tensor) and deploys its personal model,
    trained towards the global one it received (``lam``) from its own stream: the simulator's to rounding."""
    _skip_without_node()
    from pfl_edge.codec import decode

    out = _run(tmp_path, DITTO)
    _check_rounds(out, 1)
    sent = _ledger(out["root"])
    assert [u["round"] for u in sent] == [1, 2, 3], sent
    for u in sent:
        got = decode((out["root"] / "server" / "blobs" / u["digest"][:2] / u["digest"]).read_bytes(), arrays="numpy")
        assert len(got.tensors) == 10 and not got.masks, sorted(got.tensors)
    _compare(out, *_simulate(DITTO, tmp_path))


# a partition the JS device cannot deal (numpy's gamma draws): it takes its slot's share from the server
# (GET /v1/devices/me/share); the Python agents deal it themselves. Synthetic data: no files needed
DIRICHLET: dict[str, Any] = {**CONFIG, "dataset": "synthetic", "partition": "dirichlet-client:0.5", "rounds": 2,
                             "samples_per_client": 48, "test_per_client": 32, "batch_size": 16}


@pytest.mark.slow  # about 40 s (20 of them the server exporting the programs)
def test_js_device_trains_on_the_servers_share_of_a_dirichlet_partition(tmp_path: Path) -> None:
    """``dirichlet-client:0.5``: the JS device asks the server for its share, trains on exactly the samples the
    simulator deals its slot (its model the simulator's to float32 rounding), and reports in every round the
    simulator's accuracy of its slot within one test sample."""
    _skip_without_node()
    out = _run(tmp_path, DIRICHLET)
    assert "asking the server for slot 2's share" in out["log"], out["log"][-3000:]
    js_id = _check_rounds(out, 1, last=DIRICHLET["rounds"])
    assert [u["round"] for u in _ledger(out["root"])] == [1, 2]
    sim, ref = _simulate(DIRICHLET, tmp_path)
    for r in out["metrics"]["rounds"]:
        if r["round"] >= 1:
            m = r["devices"][js_id]
            acc_sim = sim["rounds"][r["round"] - 1]["client_acc"][JS_SLOT]
            loss_sim = sim["rounds"][r["round"] - 1]["client_loss"][JS_SLOT]
            print(f"round {r['round']}: JS accuracy {m['accuracy']:.4f} loss {m['loss']:.6f}, simulator {acc_sim:.4f} "
                  f"{loss_sim:.6f} ({m['n_test']} test samples)")
            assert abs(m["accuracy"] - acc_sim) <= 1.0 / m["n_test"] + 1e-9, (r["round"], m["accuracy"], acc_sim)
            # its model is the simulator's to 1e-4 (_compare; measured 1.5e-8 here), its test loss within 1e-3 of it
            assert m["loss"] == pytest.approx(loss_sim, rel=1e-3), (r["round"], m["loss"], loss_sim)
    _compare(out, sim, ref)
