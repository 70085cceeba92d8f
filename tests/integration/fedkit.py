"""What the integration tests of device processes share: a small federation's config, a device's log and final
model from its state dir, and the check that every device ends with the simulator's model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pfl_edge.checkpoint import load_checkpoint
from pfl_edge.sim import SimConfig, simulate

__all__ = ["BASE", "assert_simulator_models", "device_log", "ended", "final_model"]

BASE: dict[str, Any] = dict(dataset="synthetic", partition="pathological:2", rounds=2, samples_per_client=48,
                            test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=5)


def device_log(root: Path, i: int) -> str:
    p = root / "devices" / f"device-{i:02d}.log"
    return p.read_text()[-3000:] if p.exists() else ""


def ended(fed: Any, root: Path, info: dict[str, Any]) -> bool:
    """True once the federation ``info`` describes has finished and every device process of ``fed`` (an
    ``edge_runtime.fleet.Federation``) has exited; fails at once if a device exited with an error."""
    if info["state"] == "finished" and all(p.poll() is not None for p in fed.devices):
        return True
    for i, p in enumerate(fed.devices):
        code = p.poll()
        assert code in (None, 0), f"device {i} exited with {code}: " + device_log(root, i)
    return False


def final_model(root: Path, i: int) -> dict[str, torch.Tensor]:
    """What device i deploys at the end, from its own state dir."""
    from safetensors.torch import load_file

    return dict(load_file(str(root / "devices" / f"device-{i:02d}" / "final.safetensors")))


def assert_simulator_models(cfg: SimConfig, tmp_path: Path) -> None:
    """Every device of the run in ``tmp_path/run`` ends with the model the simulator deploys for its client (its
    slot, as its enrolment says: where rounds sample, the server draws it)."""
    import json

    simulate(cfg, save_dir=tmp_path / "sim", progress=False)
    for i in range(cfg.clients):
        slot = json.loads((tmp_path / "run" / "devices" / f"device-{i:02d}" / "enrolment.json").read_text())["index"]
        a = final_model(tmp_path / "run", i)
        b = load_checkpoint(tmp_path / "sim" / f"client_{slot:03d}.safetensors")[0]
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=5e-5, rtol=1e-4, msg=k)
