"""The check a device bundle's install.sh runs once its packages are in place: ``python -m edge_runtime.bundle_check
BUNDLE``. The bundle's requirements are installed without their declared dependencies (only what a device imports:
edge_runtime.bundle_files), so a package missing from them would otherwise show at the first round. This imports
what ``pfl-edge client`` imports, trains one step on the card's model (torch, or the program on numpy arrays
for a device without torch), and loads and runs every bundled
program whose runtime the device has: the inference program once, the ExecuTorch training program (its first
run). It prints one line per check; exit status 0 when all pass, 1 with the missing module or the
failure said otherwise."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

__all__ = ["check_bundle", "main"]


def _imports(torch_free: bool, own_images: bool = True) -> str:
    """What a device process imports, beyond the agent's module-level chain: HTTP's transport (httpcore, h11,
    certifi, anyio: imported when a client is made), MQTT control, a user's own images (not without torch)."""
    import httpx
    import paho.mqtt.client  # noqa: F401

    from . import agent  # noqa: F401  (its whole module-level chain: numpy, safetensors, pydantic, ...)

    httpx.Client().close()
    if torch_free:
        from .arrays_kind import array_kind

        if array_kind() != "numpy":
            raise RuntimeError("this bundle is for a device without torch, but torch is importable here")
        if not own_images:
            return f"imports (agent, httpx {httpx.__version__}, paho-mqtt; no torch)"
        import PIL.Image

        return f"imports (agent, httpx {httpx.__version__}, paho-mqtt, pillow {PIL.__version__}; no torch)"
    import PIL.Image

    return f"imports (agent, httpx {httpx.__version__}, paho-mqtt, pillow {PIL.__version__})"


def _program_backend(path: Path) -> Any:
    """The bundled training program in its runtime's backend (ONNX Runtime for .onnx, else ExecuTorch)."""
    from .training import ExecuTorchBackend, OnnxBackend

    return (OnnxBackend if path.suffix == ".onnx" else ExecuTorchBackend).from_file(path)


def _program_step(path: Path, card: Any) -> str:
    """Two SGD steps of the bundled training program on numpy arrays (ONNX Runtime, or the
    executorch-numpy-runtime), as a device without torch trains: the program's gradients, then pfl_edge.sgd's
    step."""
    import numpy as np

    from pfl_edge.seeding import MT
    from pfl_edge.sgd import TrainConfig

    backend = _program_backend(path)
    rng = np.random.default_rng(0)
    backend.load({k: (0.05 * rng.standard_normal(s)).astype(np.float32) for k, s in backend.details["shapes"].items()})
    x = rng.standard_normal((4, *card.input.shape)).astype(np.float32)
    y = rng.integers(0, card.num_classes, 4)
    stats = backend.train(x, y, TrainConfig(batch_size=2, lr=0.01, clip_norm=1.0, weight_decay=1e-4), MT(0))
    if stats.steps != 2 or not math.isfinite(stats.loss):
        raise RuntimeError(f"program step: {stats}")
    return f"program training step ({card.model}, numpy: loss {stats.loss:.3f})"


def _torch_step(card: Any) -> str:
    """One SGD step of the card's model through the agent's torch backend: torch.optim imports torch._dynamo and
    with it more than ``import torch`` does."""
    import torch

    from pfl_edge.checkpoint import ModelSpec, build_model
    from pfl_edge.train import TrainConfig

    from .training import TorchBackend

    c, h = card.input.shape[0], card.input.shape[1]
    backend = TorchBackend(build_model(ModelSpec(card.model, card.num_classes, c, h)))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, *card.input.shape, generator=gen), torch.randint(0, card.num_classes, (4,), generator=gen)
    stats = backend.train(x, y, TrainConfig(batch_size=2, lr=0.01, clip_norm=1.0, weight_decay=1e-4), gen)
    if stats.steps != 2 or not math.isfinite(stats.loss):  # it ran, but not as the agent's training does
        raise RuntimeError(f"torch step: {stats}")
    return f"torch training step ({card.model}: loss {stats.loss:.3f})"


def _inference(path: Path, card: Any) -> str:
    """The ONNX inference program run once in ONNX Runtime: every input (the sample, and the weights where the
    program takes them as inputs) zeros of its shape, a symbolic dimension (the batch) 1."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
             for i in sess.get_inputs()}
    out = np.asarray(sess.run(None, feeds)[0])
    if out.shape != (1, card.num_classes) or not np.isfinite(out).all():
        raise RuntimeError(f"{path.name}: onnxruntime answered {out.shape}, not 1 x {card.num_classes} finite logits")
    return f"inference {path.name} (onnxruntime {ort.__version__}: 1 x {card.num_classes} logits)"


def _training(path: Path) -> str:
    backend = _program_backend(path)  # loads the program and runs it once
    return f"training {path.name} ({backend.name}: {len(backend.trainable)} trainable tensors)"


def check_bundle(bundle: Path) -> list[str]:
    """Every check of the bundle at ``bundle``, in order; the first failure raises."""
    from device_profiles import get_profile
    from pfl_edge.modelcard import ModelCard

    where = bundle / "device.json"  # read after the imports' check (its folder may not hold one yet)
    device = json.loads(where.read_text()) if where.exists() else {}
    torch_free = device.get("arrays") == "numpy"
    done = [_imports(torch_free, bool(device.get("own_images", True)))]
    card = ModelCard.model_validate_json((bundle / device["model_card"]).read_bytes())
    profile = get_profile(device["profile"])
    if torch_free:
        done.append(_program_step(bundle / device["training_program"], card))
    else:
        done.append(_torch_step(card))
    for p in card.programs:  # the requirements hold onnxruntime when the profile infers with it (or has no torch)
        if p.kind == "inference" and p.runtime == "onnxruntime" and (torch_free or profile.inference_runtime
                                                                     == "onnxruntime"):
            done.append(_inference(bundle / "model" / "programs" / p.file, card))
    if device.get("training_program"):
        done.append(_training(bundle / device["training_program"]))
    return done


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m edge_runtime.bundle_check BUNDLE_FOLDER", file=sys.stderr)
        return 2
    try:
        for line in check_bundle(Path(args[0])):
            print(f"ok: {line}")
    except ModuleNotFoundError as e:
        top = (e.name or "?").split(".")[0]
        print(f"bundle check: module {top!r} is missing: requirements.txt lacks the package that provides it "
              f"({e})", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"bundle check failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
