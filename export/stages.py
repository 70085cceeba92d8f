"""Export as typed stages: ``prepare`` -> ``lower_*`` -> ``package`` -> ``verify``. Each stage returns its own
type, so they cannot be called out of order."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from device_profiles import Profile
from pfl_edge.checkpoint import ModelSpec, build_model, load_checkpoint
from pfl_edge.errors import ConfigError, PflEdgeError

__all__ = [
    "ONNX_OPSET",
    "ExportError",
    "Lowered",
    "Packaged",
    "Prepared",
    "Verified",
    "lower_executorch",
    "lower_onnx",
    "package",
    "prepare",
    "verify",
]

ONNX_OPSET = 17
MANIFEST = "manifest.json"


class ExportError(PflEdgeError):
    """An artefact could not be produced, or failed its parity check against eager PyTorch."""

    exit_code = 5


@dataclass(frozen=True, eq=False)
class Prepared:
    """A device's model in eval mode, ready to lower."""

    model: nn.Module
    spec: ModelSpec
    profile: Profile
    density: float  # achieved: nonzero fraction of the weight matrices and kernels
    round: int | None
    source: str  # the checkpoint it came from, or "fresh (untrained)"
    tag: str  # in the artefact's name: "client003", "fresh"

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (self.spec.in_channels, self.spec.image_size, self.spec.image_size)


@dataclass(frozen=True, eq=False)
class Lowered:
    prepared: Prepared
    format: str
    program: bytes
    details: dict[str, Any] = field(default_factory=dict)  # opset, operators


@dataclass(frozen=True, eq=False)
class Packaged:
    lowered: Lowered
    path: Path
    entry: dict[str, Any]


@dataclass(frozen=True, eq=False)
class Verified:
    packaged: Packaged
    max_abs_err: float
    max_rel_err: float
    inputs: list[str]
    atol: float
    rtol: float


def prepare(profile: Profile, *, checkpoint: str | Path | None = None, spec: ModelSpec | None = None,
            seed: int = 0) -> Prepared:
    """The model a device of ``profile`` would run: from a checkpoint (the simulator's ``--save-dir`` files),
    or a fresh, untrained model of ``spec`` when there is none."""
    if checkpoint is not None:
        state, spec_ck, extra = load_checkpoint(checkpoint)
        model = build_model(spec_ck)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ExportError(f"{checkpoint} does not hold a complete model (a base alone cannot be exported "
                              f"without personal blocks): {e}") from None
        spec, source = spec_ck, str(checkpoint)
        rnd, client = extra.get("round"), extra.get("client")
        round_ = int(rnd) if isinstance(rnd, int) else None
        tag = f"client{client:03d}" if isinstance(client, int) else Path(checkpoint).stem
    else:
        if spec is None:
            raise ConfigError("prepare needs a checkpoint or a model spec")
        torch.manual_seed(seed)
        model = build_model(spec)
        source, round_, tag = "fresh (untrained)", None, "fresh"
    model.eval()
    # density over weight matrices and kernels: 1-D tensors (biases, norms) are dense by ERK and may be zero
    weights = [p for p in model.parameters() if p.dim() > 1]
    total = sum(p.numel() for p in weights)
    nonzero = sum(int(torch.count_nonzero(p)) for p in weights)
    return Prepared(model, spec, profile, nonzero / total, round_, source, tag)


@contextlib.contextmanager
def keep_batch_range() -> Iterator[None]:
    """Lower without narrowing the dynamic batch range. XNNPACK's layout pass re-traces some convolutions on
    fake tensors, and torch's choice of convolution kernel asks "batch >= 16?" of the traced batch when torch
    runs on one thread: answered from the example batch (2), it narrows the range to [2, 15], memory planning
    sizes the input for 15, and larger batches fail at run time. Size-oblivious reasoning avoids part of it;
    the rest goes away with two or more threads while lowering (the program itself is unaffected)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            yield
    finally:
        torch.set_num_threads(threads)


def lower_onnx(prepared: Prepared, *, opset: int = ONNX_OPSET) -> Lowered:
    """ONNX at a fixed opset with a dynamic batch dimension (TorchScript exporter: it needs no onnxscript)."""
    import onnx

    example = torch.zeros(2, *prepared.input_shape)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the exporter's own deprecation notices
                torch.onnx.export(prepared.model, (example,), str(path), dynamo=False, opset_version=opset,
                                  input_names=["input"], output_names=["logits"],
                                  dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
        except Exception as e:  # the exporter raises many kinds; say which model and why
            raise ExportError(f"ONNX export of {prepared.spec.model} failed: {e}") from e
        program = path.read_bytes()
    proto = onnx.load_from_string(program)
    onnx.checker.check_model(proto)
    ops = sorted({n.op_type for n in proto.graph.node})
    return Lowered(prepared, "onnx", program, {"opset": opset, "operators": ops})


def lower_executorch(prepared: Prepared, *, max_batch: int = 256) -> Lowered:
    """An ExecuTorch inference program (``.pte``) delegated to XNNPACK, batch dynamic from 1 to ``max_batch``."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    # batch 2 in the example: an example of batch 1 would specialise the batch dimension to 1
    example = torch.zeros(2, *prepared.input_shape)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(prepared.model, (example,),
                                     dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=max_batch)},))
            with keep_batch_range():
                edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
                program = edge.to_executorch().buffer
    except Exception as e:  # export and lowering raise many kinds; say which model and why
        raise ExportError(f"ExecuTorch export of {prepared.spec.model} failed: {e}") from e
    ops = sorted({str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"})
    return Lowered(prepared, "executorch", program, {"backend": "xnnpack", "max_batch": max_batch,
                                                       "operators": ops})


def package(lowered: Lowered, out_dir: str | Path) -> Packaged:
    """Write the artefact (atomically) and its entry into ``manifest.json`` beside it."""
    prep = lowered.prepared
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    suffix = {"onnx": ".onnx", "executorch": ".pte"}[lowered.format]
    path = d / f"{prep.spec.model}-{prep.profile.name}-{prep.tag}{suffix}"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(lowered.program)
    os.replace(tmp, path)
    entry = {
        "format": lowered.format,
        "path": path.name,
        "bytes": len(lowered.program),
        "sha256": hashlib.sha256(lowered.program).hexdigest(),
        **lowered.details,
        "model": prep.spec.model,
        "model_spec": prep.spec.to_metadata(),
        "round": prep.round,
        "profile": prep.profile.name,
        "density": round(prep.density, 6),
        "source": prep.source,
    }
    _update_manifest(d, entry)
    return Packaged(lowered, path, entry)


def _update_manifest(d: Path, entry: dict[str, Any]) -> None:
    mpath = d / MANIFEST
    entries: list[dict[str, Any]] = []
    if mpath.exists():
        try:
            entries = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise ExportError(f"{mpath} is not valid JSON; move it away first: {e}") from None
        if not isinstance(entries, list):
            raise ExportError(f"{mpath} is not a list of entries")
    entries = [e for e in entries if e.get("path") != entry["path"]] + [entry]
    tmp = mpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, mpath)


def verify(packaged: Packaged, *, real: torch.Tensor | None = None, atol: float = 1e-4,
           rtol: float = 1e-3, seed: int = 0) -> Verified:
    """Outputs of the artefact against eager PyTorch on random inputs (batch 1 and 8) and, when given, real
    ones. Raises ``ExportError`` past the thresholds; records the errors in the manifest entry."""
    prep = packaged.lowered.prepared
    gen = torch.Generator().manual_seed(seed)
    inputs = {"random b1": torch.randn(1, *prep.input_shape, generator=gen),
              "random b8": torch.randn(8, *prep.input_shape, generator=gen)}
    if real is not None:
        inputs["real"] = real
    run = _runner(packaged)
    max_abs, max_rel = 0.0, 0.0
    for name, x in inputs.items():
        with torch.no_grad():
            ref = prep.model(x).numpy()
        got = run(x.numpy())
        if got.shape != ref.shape:
            raise ExportError(f"{packaged.path.name}: output shape {got.shape} != eager {ref.shape} on {name}")
        err = np.abs(got - ref)
        max_abs = max(max_abs, float(err.max()))
        max_rel = max(max_rel, float((err / np.maximum(np.abs(ref), 1e-6)).max()))
        if not np.allclose(got, ref, atol=atol, rtol=rtol):
            raise ExportError(f"{packaged.path.name} differs from eager PyTorch on {name}: max abs error "
                              f"{err.max():.3g} (atol {atol}, rtol {rtol})")
    result = Verified(packaged, max_abs, max_rel, list(inputs), atol, rtol)
    packaged.entry["verify"] = {"max_abs_err": max_abs, "max_rel_err": max_rel, "inputs": list(inputs),
                                "atol": atol, "rtol": rtol, "passed": True}
    _update_manifest(packaged.path.parent, packaged.entry)
    return result


def _runner(packaged: Packaged) -> Any:
    fmt = packaged.lowered.format
    if fmt == "onnx":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = packaged.lowered.prepared.profile.threads
        sess = ort.InferenceSession(str(packaged.path), opts, providers=["CPUExecutionProvider"])
        return lambda x: sess.run(None, {"input": x.astype(np.float32)})[0]
    if fmt == "executorch":
        from executorch.runtime import Runtime

        data = packaged.path.read_bytes()  # the runtime reads from this buffer without owning it: keep it alive
        program = Runtime.get().load_program(data)
        method = program.load_method("forward")

        def run(x: np.ndarray) -> np.ndarray:
            _ = (data, program)  # referenced here so they live as long as the method
            out = method.execute([torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))])[0]
            return np.asarray(out.numpy())

        return run
    raise ExportError(f"no runner for format {fmt!r}")
