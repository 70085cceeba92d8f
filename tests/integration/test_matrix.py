"""The compatibility matrix (issue 47): every registered algorithm, at each setting that changes a device's code path,
on every kind of device, in short federations of real processes that end with the simulator's models.

A row is an algorithm at one setting (its defaults; sampled rounds; secure aggregation; differential privacy with
Poisson draws; each topology of a decentralised algorithm). Every row runs one federation of four device processes
of different kinds side by side on a real server and broker:

- slot 0 ``torch``: the agent training in eager PyTorch;
- slot 1 ``torch-free``: the agent in a process where ``import torch`` and ``import executorch`` fail, as on a board
  whose bundle installed neither: numpy arrays, the server's ONNX training and inference programs, batches, masks
  and graphs drawn by numpy (``seeding.MT``);
- slot 2 ``executorch``: the agent training through the server's ExecuTorch training program;
- slot 3 ``js``: the JavaScript device under Node (onnxruntime-node), for the algorithms it runs (``SUPPORTED`` in
  devices/js/src/device.ts, read from there); where it does not run the row's algorithm, or Node is missing, slot 3
  is a second torch-free device and the cell says why.

Each device's final model must be the simulator's model of its slot (same config and seed) within the tolerance
docs/model.md documents for a device on a program (1e-4). Algorithms registered for the simulator only (Local,
FedAvg-FT, D-PSGD, D-PSGD-FT) are cells too: the server refuses their federations with an error naming the
algorithms devices run. ``test_the_matrix_covers_every_algorithm_and_setting`` fails when an algorithm is
registered, or a setting becomes valid for one, without its row. Results: ``test-artifacts/matrix/<row>.json``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedkit import device_log

from edge_runtime.fleet import Federation, start_server
from pfl_edge.algorithms import algorithm_class, device_algorithms, list_algorithms
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, check_device_config
from pfl_edge.topology import TOPOLOGIES

ROOT = Path(__file__).resolve().parents[2]
JS = ROOT / "devices" / "js"
ARTEFACTS = ROOT / "test-artifacts" / "matrix"
TOLERANCE = 1e-4  # docs/model.md: a device on a program against the simulator, float32 rounding

# small enough to run a row in seconds, Fashion-MNIST because a device without torch cannot draw the synthetic set
BASE: dict[str, Any] = dict(model="cnn", dataset="fashion-mnist", partition="pathological:2", clients=4, rounds=2,
                            samples_per_client=48, test_per_client=32, local_epochs=1, batch_size=16, lr=0.05,
                            workers=1, seed=5)
SECURE = {"secure_aggregation": {"bound": 0.5, "bits": 16}}
PRIVATE = {"participation": 0.5,
           "privacy": {"clip": 0.3, "noise_multiplier": 0.4, "delta": 1e-3, "secret_noise": False}}
SAMPLED = {"participation": 0.5}
# the settings a central algorithm may take, each a different path through a device's round
CENTRAL_SETTINGS: dict[str, dict[str, Any]] = {"defaults": {}, "sampled": SAMPLED, "secure": SECURE,
                                               "private": PRIVATE}
# a decentralised algorithm's: its default graph, and every topology pfl_edge.topology draws
DECENTRAL_SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    **{t.split(":")[0]: {"options": {"topology": t.replace(":K", ":2")}, "densities": (0.3, 0.5, 0.8, 1.0)}
       for t in TOPOLOGIES},
}
ALGORITHM_OPTIONS: dict[str, dict[str, Any]] = {"fedper": {"kp": 2}, "fedper-ft": {"kp": 2}, "fedrep": {"kp": 2},
                                                "ditto": {"options": {"lam": 0.5}}}

KINDS = ("torch", "torch-free", "executorch", "js")
RUNTIMES = {"torch": "torch ", "torch-free": "onnxruntime ", "executorch": "executorch ", "js": "onnxruntime-node "}


@dataclass(frozen=True)
class Row:
    algorithm: str
    setting: str
    config: dict[str, Any] = field(hash=False)

    @property
    def name(self) -> str:
        return f"{self.algorithm}-{self.setting}"


def settings_for(algorithm: str) -> dict[str, dict[str, Any]]:
    decentral = algorithm_class(algorithm).has_masks() or "topology" in _option_names(algorithm)
    return DECENTRAL_SETTINGS if decentral else CENTRAL_SETTINGS


def _option_names(algorithm: str) -> set[str]:
    from dataclasses import fields

    return {f.name for f in fields(algorithm_class(algorithm).Options)}


def _config(algorithm: str, setting: dict[str, Any]) -> dict[str, Any]:
    extra = ALGORITHM_OPTIONS.get(algorithm, {})
    options = {**extra.get("options", {}), **setting.get("options", {})} or None
    return {**BASE, **extra, **setting, "algorithm": algorithm, **({"options": options} if options else {})}


def accepted(config: dict[str, Any]) -> bool:
    """Whether a device federation of ``config`` is valid (the server's own check)."""
    try:
        check_device_config(FederationConfig.from_dict(config))
    except ConfigError:
        return False
    return True


# the rows: every algorithm devices run, at every setting it accepts
ROWS = [Row(a, s, _config(a, cfg)) for a in device_algorithms() for s, cfg in settings_for(a).items()
        if accepted(_config(a, cfg))]
# rows where the running system does not end with the simulator's models today, each with its reason (strict: a
# row that starts to pass fails until it is taken off this list)
KNOWN: dict[str, str] = {}  # FedRep with sampled rounds was here until the simulator bounded updates as the server
SIMULATOR_ONLY = [a for a in list_algorithms() if a not in device_algorithms()]


def js_supported() -> list[str]:
    """The algorithms the JavaScript device runs, read from its source (one definition)."""
    m = re.search(r"const SUPPORTED = \[([^\]]*)\]", (JS / "src" / "device.ts").read_text())
    assert m, "devices/js/src/device.ts no longer lists SUPPORTED"
    return re.findall(r"'([^']+)'", m.group(1))


# ---------------------------------------------------------------------------------------------- fast checks

def test_the_matrix_covers_every_algorithm_and_setting() -> None:
    """Every registered algorithm is a row or a refused cell; every setting any device algorithm accepts is a row
    (so a new algorithm, or a setting made valid for one, fails here until the matrix runs it); every topology is a
    row of every decentralised algorithm; and every row's config is valid."""
    assert set(list_algorithms()) == {r.algorithm for r in ROWS} | set(SIMULATOR_ONLY)
    assert set(SIMULATOR_ONLY) >= {"local", "dpsgd"} and not set(SIMULATOR_ONLY) & set(device_algorithms())
    for a in device_algorithms():
        for s, cfg in {**CENTRAL_SETTINGS, **DECENTRAL_SETTINGS}.items():
            if accepted(_config(a, cfg)):
                assert any(r.algorithm == a and r.setting == s for r in ROWS), (a, s)
    assert {r.setting for r in ROWS if r.algorithm == "dispfl"} == {"defaults", "random", "ring", "full"}
    for a in ("fedavg", "fedper", "ditto", "fedrep"):
        assert {r.setting for r in ROWS if r.algorithm == a} == set(CENTRAL_SETTINGS), a
    assert set(js_supported()) <= set(device_algorithms())
    assert set(KNOWN) <= {r.name for r in ROWS}


@pytest.mark.parametrize("algorithm", SIMULATOR_ONLY)
def test_a_simulator_only_algorithm_is_refused_with_the_device_algorithms_named(algorithm: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_device_config(FederationConfig.from_dict({**BASE, "algorithm": algorithm}))
    assert all(a in str(e.value) for a in device_algorithms()), str(e.value)


# ---------------------------------------------------------------------------------------------- the federations

NO_TORCH = textwrap.dedent("""
    import importlib.abc, sys


    class Absent(importlib.abc.MetaPathFinder):
        # neither torch nor executorch is installed here: importing either (or a submodule) fails
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "executorch", "torchao", "opacus"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, Absent())
    from pfl_edge.cli.parser import main

    code = main(sys.argv[1:])
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "executorch"))
    assert not loaded, loaded
    sys.exit(code)
""")


def _start(fed: Federation, slot: int, kind: str) -> None:
    if kind == "torch":
        fed.start_device(slot, "phone-mid", extra=["--training-backend", "torch"])
    elif kind == "executorch":
        fed.start_device(slot, "phone-mid", extra=["--training-backend", "executorch"])
    elif kind == "torch-free":
        state = fed.root / "devices" / f"device-{slot:02d}"
        state.mkdir(parents=True, exist_ok=True)
        log = open(fed.root / "devices" / f"device-{slot:02d}.log", "ab")  # noqa: SIM115 (the child owns it)
        cmd = [sys.executable, "-c", NO_TORCH, "client", "--server", fed.url, "--federation", fed.fed,
               f"--enrol-secret={fed.secret}", "--profile", "raspberry-pi-4", "--state-dir", str(state),
               "--partition-id", str(slot), "--threads", "1", "--name", f"device-{slot:02d}", "-v"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        fed.devices.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    else:
        from test_js_device import _build, _start_js

        _start_js(fed, _build(), slot)


def _final(root: Path, slot: int, kind: str) -> dict[str, np.ndarray]:
    """What the device in ``slot`` deploys at the end, from its own state dir."""
    d = root / "devices" / f"device-{slot:02d}"
    if kind == "js":
        from pfl_edge.codec import decode

        final = (d / "final.bin").read_bytes()
        n = int.from_bytes(final[:4], "little")
        return {k: np.asarray(v) for k, v in decode(final[4 + n:], arrays="numpy").tensors.items()}
    from safetensors.numpy import load_file

    return dict(load_file(str(d / "final.safetensors")))


def _kinds(row: Row) -> tuple[list[str], str]:
    """The kind of each slot, and why slot 3 is not the JavaScript device where it is not."""
    from test_js_device import _why_not  # node, npm and the device's node_modules, as its own tests need them

    why = _why_not()
    if why is None and row.algorithm not in js_supported():
        why = f"the JavaScript device does not run {row.algorithm} (it runs {', '.join(js_supported())})"
    return ["torch", "torch-free", "executorch", "torch-free" if why else "js"], why or ""


def run_row(row: Row, tmp_path: Path) -> dict[str, Any]:
    """One federation of ``row`` to its end, every device against the simulator; the cell's record."""
    import torch

    from pfl_edge.checkpoint import load_checkpoint
    from pfl_edge.sim import SimConfig, simulate

    kinds, why = _kinds(row)
    root = tmp_path / "run"
    fed = start_server(root)
    t0 = time.monotonic()
    try:
        fed.create(f"m{int(time.time() * 1000) % 10**9}", row.config, deadline_s=600.0)
        for slot, kind in enumerate(kinds):
            _start(fed, slot, kind)
        deadline = time.monotonic() + 900  # generous: the first row of a mode waits for its program exports
        while True:
            info = fed.info()
            codes = [p.poll() for p in fed.devices]
            for slot, code in enumerate(codes):
                assert code in (None, 0), f"{row.name}: {kinds[slot]} device {slot} exited {code}: " + \
                    device_log(root, slot)
            if info["state"] == "finished" and all(c == 0 for c in codes):
                break
            assert time.monotonic() < deadline, f"{row.name} did not finish: {info}\n" + "\n".join(
                f"--- {k} {device_log(root, i)}" for i, k in enumerate(kinds))
            time.sleep(0.5)
        wall = time.monotonic() - t0
        listing = fed.get(f"/v1/federations/{fed.fed}/devices")
    finally:
        fed.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the agents' count: their arithmetic is then the simulator's
    try:
        simulate(SimConfig.from_dict(row.config), save_dir=tmp_path / "sim", progress=False)
    finally:
        torch.set_num_threads(threads)
    cells: dict[str, Any] = {}
    by_slot = {d["index"]: d for d in listing}
    for i, kind in enumerate(kinds):
        # its slot as its enrolment says (where rounds sample, the server gives one)
        slot = json.loads((root / "devices" / f"device-{i:02d}" / "enrolment.json").read_text())["index"]
        ref = {k: v.numpy() for k, v in load_checkpoint(tmp_path / "sim" / f"client_{slot:03d}.safetensors")[0].items()}
        got = _final(root, i, kind)
        assert set(got) == set(ref), (row.name, kind, sorted(set(got) ^ set(ref)))
        diff = max(float(np.abs(got[k].astype(np.float64) - ref[k].astype(np.float64)).max()) for k in ref)
        # it said what it is at enrolment (issue 47 item 4): the runtime it trains with, its language
        said = by_slot[slot]["platform"]
        assert said and said["runtime"].startswith(RUNTIMES[kind]) and said["language"].startswith(
            "node " if kind == "js" else "python "), (kind, said)
        cells[f"{i}:{kind}"] = {"slot": slot, "max_abs_diff": diff, "platform": said}
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], atol=TOLERANCE, rtol=TOLERANCE,
                                       err_msg=f"{row.name}: the {kind} device's {k}")
    log = (root / "devices" / "device-01.log").read_text()
    assert "onnxruntime" in log, log[-2000:]  # the torch-free device trained through the ONNX program
    record = {"row": row.name, "config": row.config, "kinds": kinds, "js_absent_because": why,
              "wall_s": round(wall, 1), "cells": cells}
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    (ARTEFACTS / f"{row.name}.json").write_text(json.dumps(record, indent=1, default=list))
    return record


def _params(rows: list[Row]) -> list[Any]:
    return [pytest.param(r, id=r.name, marks=[pytest.mark.xfail(strict=True, reason=KNOWN[r.name])]
                         if r.name in KNOWN else []) for r in rows]


# two classes, each given whole to one pytest-xdist worker (loadscope): the slow tier runs the halves side by side
FIRST_HALF = ("fedavg", "fedper", "fedper-ft")


@pytest.mark.slow
@pytest.mark.needs_fmnist
class TestFedAvgAndFedPer:
    @pytest.mark.parametrize("row", _params([r for r in ROWS if r.algorithm in FIRST_HALF]))
    def test_row_ends_with_the_simulators_models(self, row: Row, tmp_path: Path) -> None:
        run_row(row, tmp_path)


@pytest.mark.slow
@pytest.mark.needs_fmnist
class TestTheOthers:
    @pytest.mark.parametrize("row", _params([r for r in ROWS if r.algorithm not in FIRST_HALF]))
    def test_row_ends_with_the_simulators_models(self, row: Row, tmp_path: Path) -> None:
        run_row(row, tmp_path)
