"""What a device agent without PyTorch needs imports without it: the federation's config and its rules, the model
spec and id, the model card's classes, the protocol, the device profiles, the algorithms, the codec, the data and
SGD. Checked in a fresh process where ``import torch`` fails as it does where torch is not installed."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import importlib.abc
    import sys


    class NoTorch(importlib.abc.MetaPathFinder):
        # torch is not installed: ``import torch`` (or any torch.*) is a ModuleNotFoundError
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, NoTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]

    import device_profiles
    import pfl_edge.algorithms
    import pfl_edge.arrays
    import pfl_edge.checkpoint
    import pfl_edge.codec
    import pfl_edge.data
    import pfl_edge.errors
    import pfl_edge.federation
    import pfl_edge.modelcard
    import pfl_edge.modelgraph
    import pfl_edge.protocol
    import pfl_edge.secret_file
    import pfl_edge.sgd
    from pfl_edge.federation import FederationConfig, model_id, model_spec

    cfg = FederationConfig.from_dict({"algorithm": "fedper", "model": "cnn", "dataset": "fashion-mnist",
                                      "clients": 4, "kp": 1, "lr": 0.05, "seed": 7})
    tc = cfg.train_config(1)
    assert (tc.lr, tc.batch_size) == (0.05, 32), tc
    assert model_id(model_spec(cfg, 10, 1, 28)) == "cnn/10/1x28/deep0"
    assert pfl_edge.checkpoint.ModelSpec.from_metadata(model_spec(cfg, 10, 1, 28).to_metadata()).kp == 0
    pfl_edge.federation.check_device_config(cfg)
    assert pfl_edge.federation.device_capacity(cfg, 0) == (1.0, 1)  # FedPer keeps no mask
    assert device_profiles.get_profile("phone-high").name == "phone-high"
    assert pfl_edge.modelcard.ModelCard.model_json_schema()["title"] == "ModelCard"
    assert pfl_edge.modelcard.training_info(cfg).lr == 0.05
    pfl_edge.modelcard.dataset_normalisation("fashion-mnist", 1)
    pfl_edge.modelcard.own_images_normalisation()
    pfl_edge.modelgraph.Layer(name="l", type="relu", inputs=["input"], output_shape=[4])
    pfl_edge.protocol.Enrolment.model_json_schema()
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "safetensors.torch")))
    assert "torch" not in sys.modules, loaded
    assert not loaded, loaded
    print("torch-free")
""")


def test_the_device_side_imports_without_torch() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("torch-free")


TRAIN = textwrap.dedent("""
    import importlib.abc, json, sys


    class Absent(importlib.abc.MetaPathFinder):
        # neither torch nor executorch is installed: importing either (or any submodule) fails
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "executorch", "executorch_numpy_runtime"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, Absent())
    import numpy as np

    import edge_runtime.agent  # the whole device: its module-level chain
    from edge_runtime.training import OnnxBackend, device_backend, get_training_backend
    from pfl_edge.seeding import MT
    from pfl_edge.sgd import TrainConfig

    assert device_backend("numpy", None, "torch") == "onnxruntime"
    assert get_training_backend("onnxruntime") is OnnxBackend
    program, details = open(sys.argv[1], "rb").read(), json.loads(open(sys.argv[2]).read())
    backend = OnnxBackend(program, details, threads=1)
    rng = np.random.default_rng(0)
    start = {k: (0.05 * rng.standard_normal(v)).astype(np.float32) for k, v in details["shapes"].items()}
    backend.load(start)
    x = rng.standard_normal((20, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 20)
    last = details["keys"][-2]
    mask = {last: (rng.random(details["shapes"][last]) < 0.5).astype(np.float32)}
    stats = backend.train(x, y, TrainConfig(epochs=1, batch_size=8, lr=0.05, clip_norm=1.0), MT(3), mask=mask)
    state = backend.state()
    assert stats.steps == 3 and np.isfinite(stats.loss), stats
    assert all(isinstance(v, np.ndarray) for v in state.values())
    assert not state[last][mask[last] == 0].any() and not np.array_equal(state[last], start[last])
    grads = backend.dense_gradients(x, y, 8, MT(4))
    assert (grads[last][mask[last] == 0] != 0).any()  # the regrowth screen: unmasked gradients
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "executorch"))
    assert not loaded, loaded
    print("trained without torch")
""")


def test_a_device_trains_with_the_onnx_program_without_torch_or_executorch(tmp_path: Path) -> None:
    """The agent's import chain and an OnnxBackend round (masked SGD steps, the regrowth gradient) in a process
    where neither torch nor executorch can be imported: numpy and onnxruntime alone."""
    from device_profiles import get_profile
    from export import lower_onnx_training, prepare
    from pfl_edge.checkpoint import ModelSpec

    low = lower_onnx_training(prepare(get_profile("raspberry-pi-4"), spec=ModelSpec("cnn", 10, 1, 28), seed=0),
                              mode="dispfl", batch_size=8)
    (tmp_path / "train.onnx").write_bytes(low.program)
    (tmp_path / "details.json").write_text(json.dumps(low.details))
    r = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path / "train.onnx"), str(tmp_path / "details.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("trained without torch")


DEAL = textwrap.dedent("""
    import hashlib, json, sys
    sys.modules["torch"] = None  # as where torch is not installed
    import numpy as np
    from pfl_edge.federation import FederationConfig, deal_arrays, model_id, model_spec

    cfg = FederationConfig.from_dict(json.loads(sys.argv[1]))
    out = {}
    for i in (0, 3):
        a = deal_arrays(cfg, i)
        out[i] = {"model_id": model_id(model_spec(cfg, a.num_classes, a.in_channels, a.image_size)),
                  **{k: hashlib.sha256(np.ascontiguousarray(getattr(a, k)).tobytes()).hexdigest()
                     for k in ("train_x", "train_y", "test_x", "test_y")}}
    assert sys.modules["torch"] is None and not [m for m in sys.modules if m.startswith("torch.")]
    print(json.dumps(out))
""")


@pytest.mark.needs_fmnist
def test_deal_arrays_is_a_clients_share_of_deal_without_torch() -> None:
    """``deal_arrays`` (no torch) gives client i the very samples ``deal`` (torch) gives it, and its fields the
    model spec and id."""
    import torch

    from pfl_edge.federation import FederationConfig, deal, model_id

    config = {"algorithm": "fedper", "dataset": "fashion-mnist", "partition": "pathological:2", "clients": 4,
              "kp": 1, "samples_per_client": 200, "test_per_client": 50, "seed": 5}
    r = subprocess.run([sys.executable, "-c", DEAL, json.dumps(config)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    got = {int(k): v for k, v in json.loads(r.stdout).items()}

    def digest(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()

    ds, part, spec = deal(FederationConfig.from_dict(config))
    for i, want in got.items():
        c = part.clients[i]
        assert want == {"model_id": model_id(spec), "train_x": digest(ds.train_x[c.train_idx]),
                        "train_y": digest(c.train_y), "test_x": digest(ds.test_x[c.test_idx]),
                        "test_y": digest(c.test_y)}
