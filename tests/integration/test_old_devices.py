"""The previous release's devices against the current server (issue 50 item 2): devices in the field are not updated
when the server is, so the Python agent and the JavaScript device of the release pinned in old_release.py, built from
that commit's tree (git archive, outside the working tree), must still finish FedPer and DisPFL.

Each federation runs on a server of this tree with its embedded broker, Fashion-MNIST (the JS device reads no other
data set) in 3 slots, 2 rounds: slot 0 the previous release's agent (``python -m pfl_edge client`` with that tree as
its PYTHONPATH and working directory, this venv's interpreter), slot 1 this tree's agent, slot 2 the previous
release's JS device. The federation finishes and every device exits 0; the old devices enrolled as devices of that
release do (without a device key: none in their state dirs), the server refused and dropped none of their updates
and counted every one of them (3 updates a round), and it accepted their metrics of every round (the metrics
listing has them); their logs hold no error. A failure here means the server broke its contract with deployed
devices: bump the protocol version and keep the old one served (issue 50), do not move the pin past it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fedkit import device_log, ended
from old_release import PREVIOUS_RELEASE, build_js, materialise, why_not_materialisable

from edge_runtime.fleet import Federation, start_server
from pfl_edge.protocol import API_PREFIX

OLD_PY, NEW_PY, OLD_JS = 0, 1, 2
ROUNDS = 2
CONFIG: dict[str, Any] = dict(algorithm="fedper", dataset="fashion-mnist", partition="pathological:2", clients=3,
                              rounds=ROUNDS, samples_per_client=120, local_epochs=1, batch_size=32, lr=0.05, kp=2,
                              clip_norm=10.0, workers=1, seed=5)
DISPFL: dict[str, Any] = {**CONFIG, "algorithm": "dispfl", "density": 0.5, "topology": "full", "kp": 0}


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    why = why_not_materialisable()
    if why is not None:
        pytest.skip(why)
    t0 = time.perf_counter()
    tree = materialise(tmp_path_factory.mktemp("previous-release") / "tree")
    # what Federation.start_device(source=tree) runs imports that tree's packages, not this checkout's (nor the
    # venv's editable install of it)
    where = subprocess.run([sys.executable, "-c", "import edge_runtime, pfl_edge; print(pfl_edge.__file__); "
                            "print(edge_runtime.__file__)"], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                           capture_output=True, text=True, check=True).stdout.split()
    assert all(Path(f).is_relative_to(tree) for f in where), where
    print(f"\nprevious release {PREVIOUS_RELEASE[:12]} materialised in {time.perf_counter() - t0:.1f} s: {tree}")
    return tree


@pytest.fixture(scope="module")
def old_js(old_tree: Path) -> Path:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed")
    t0 = time.perf_counter()
    entry = build_js(old_tree)
    print(f"\nthe previous release's JS device built in {time.perf_counter() - t0:.1f} s")
    return entry


def _start_js(fed: Federation, entry: Path, slot: int) -> None:
    """The JS device in ``slot``, as the previous release's tests/integration/test_js_device.py started it."""
    state = fed.root / "devices" / f"device-{slot:02d}"
    state.mkdir(parents=True, exist_ok=True)
    log = open(fed.root / "devices" / f"device-{slot:02d}.log", "ab")  # noqa: SIM115 (the child owns it)
    cmd = ["node", str(entry), "--server", fed.url, "--federation", fed.fed, "--enrol-secret", fed.secret,
           "--profile", "phone-mid", "--state-dir", str(state), "--partition-id", str(slot), "--threads", "1",
           "--name", f"js-{slot:02d}", "-v"]
    assert slot == len(fed.devices), "start the devices in slot order"
    fed.devices.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"}))


def _run(root: Path, config: dict[str, Any], tree: Path, entry: Path) -> dict[str, Any]:
    """The federation of ``config`` with the old agent, a current agent and the old JS device, to its end; the
    metrics and devices listings."""
    fed = start_server(root)
    try:
        fed.create(f"old{int(time.time() * 1000) % 10**9}", config, deadline_s=600)
        fed.start_device(OLD_PY, "phone-mid", extra=["--training-backend", "torch"], source=tree)
        fed.start_device(NEW_PY, "phone-mid", extra=["--training-backend", "torch"])
        _start_js(fed, entry, OLD_JS)
        t0 = time.monotonic()
        while not ended(fed, root, fed.info()):
            assert time.monotonic() - t0 < 600, (fed.info(), device_log(root, OLD_PY), device_log(root, OLD_JS))
            time.sleep(0.5)
        return {"metrics": fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics"),
                "devices": fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")}
    finally:
        fed.close()


def _check(root: Path, out: dict[str, Any], first: int) -> None:
    """Every device finished with all its updates counted (from round ``first``); the old ones enrolled keyless, and
    their metrics of rounds 1..ROUNDS are in the server's listing; their logs hold no error."""
    rounds = out["metrics"]["rounds"]
    assert [r["round"] for r in rounds if r["round"] >= first] == list(range(first, ROUNDS + 1)), rounds
    for r in rounds:
        if r["round"] >= first:
            assert r["updates"] == 3, r
    by_slot = {d["index"]: d for d in out["devices"]}
    names = {by_slot[OLD_PY]["device_id"]: "old agent", by_slot[NEW_PY]["device_id"]: "current agent",
             by_slot[OLD_JS]["device_id"]: "old JS"}
    for r in rounds:
        accs = {names[d]: m.get("accuracy") for d, m in r["devices"].items() if d in names}
        print(f"round {r['round']}: {r['updates']} updates, accuracy {accs}")
    for slot in (OLD_PY, NEW_PY, OLD_JS):
        d = by_slot[slot]
        assert d["refused"] == 0 and d["dropped"] == 0 and not d["revoked"], d
        assert d["last_round"] == ROUNDS and d["bytes_up"] > 0 and d["bytes_down"] > 0, d
    for slot, kind in ((OLD_PY, "Python agent"), (OLD_JS, "JS device")):
        log = (root / "devices" / f"device-{slot:02d}.log").read_text()
        print(f"--- the previous release's {kind} (slot {slot}), the end of its log:\n{log[-1500:]}")
        # a device of that release makes no key (the current agent and JS device both write device-key.json)
        assert not (root / "devices" / f"device-{slot:02d}" / "device-key.json").exists(), kind
        errors = [line for line in log.splitlines()
                  if " ERROR " in line or "Error" in line or "Traceback" in line or line.startswith("    at ")]
        assert not errors, (kind, errors[:20])
        dev = by_slot[slot]["device_id"]
        for r in rounds:
            if r["round"] >= 1:
                m = r["devices"].get(dev)
                assert m is not None, (kind, r["round"], sorted(r["devices"]))
                assert 0 <= m["accuracy"] <= 1 and m["loss"] >= 0 and m["n_test"] > 0, (kind, m)
        assert sum(1 for r in rounds if r["round"] >= 1 and dev in r["devices"]) == ROUNDS, kind


@pytest.mark.slow
@pytest.mark.needs_fmnist
@pytest.mark.parametrize(("config", "first"), [(CONFIG, 1), (DISPFL, 0)], ids=["fedper", "dispfl"])
def test_previous_release_devices_finish(tmp_path: Path, old_tree: Path, old_js: Path, config: dict[str, Any],
                                         first: int) -> None:
    t0 = time.perf_counter()
    out = _run(tmp_path / "run", config, old_tree, old_js)
    _check(tmp_path / "run", out, first)
    print(f"{config['algorithm']}: the previous release's devices finished against the current server in "
          f"{time.perf_counter() - t0:.0f} s")
