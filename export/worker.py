"""The export worker, ``python -m export.worker WORK``: the server's programs are made here, in a process of
their own, so that the server's process imports neither ONNX Runtime nor ExecuTorch (docs/design.md). It reads
``WORK/request.json`` (a list of program keys: ``file``, ``spec``, ``kind``, ``mode``, ``kp``, ``batch_size``;
the server names the file), exports each program into ``WORK/<file>``, checks it against eager PyTorch before it
is ever served, and writes ``WORK/result.json`` (per key: its ``details``, or an ``error``).

The ONNX inference program takes every state-dict tensor as a graph input, by key, after ``input``: a device feeds
its own weights at every run. It is traced from a wrapper whose ``forward(input, *weights)`` puts the given tensors
where the model's parameters were, so no weight is ever an initialiser: the TorchScript exporter both folds
initialisers into constants (GroupNorm's weight, unsqueezed to [C, 1, 1]) and merges equal-valued ones (every
freshly initialised GroupNorm weight is all ones) behind ``Identity`` nodes, and neither can then be fed by name.
(Overriding baked initialisers in onnxruntime is no way out: its optimiser may fold or pre-pack them, which gave
wrong logits.)

The training program's gradients are compared per tensor, scale-aware (``gradient_mismatches``): ExecuTorch's
float32 sums over a GroupNorm group of a large feature map are off by up to ~5e-3 of the tensor's largest gradient
(mobilenet-v1, 1x28x28, batch 16), while a wrong program (a padded sample counted, other weights, wrong elements)
is off by far more."""

from __future__ import annotations

import copy
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from device_profiles import get_profile, list_profiles
from pfl_edge.checkpoint import ModelSpec

from .stages import ONNX_OPSET, ExportError, Lowered, Prepared, package, prepare
from .training import lower_executorch_training, lower_onnx_training

__all__ = ["GRAD_ATOL", "GRAD_MAX_RTOL", "GRAD_RTOL", "LOSS_TOL", "check_onnx", "check_training", "export_one",
           "gradient_mismatches", "main", "onnx_weights_as_inputs", "run_training_program"]

# ExecuTorch's kernels sum in float32 in another (plainer) order than PyTorch's: mobilenet-v1's program at 1x28x28,
# batch 16, is off by up to 5e-3 of a gradient's largest element (dw1's GroupNorm, 12,544 terms a group per
# sample; at batch 32 2.4e-3, and 9e-4 of the norm), where eager float32 is 1e-6 from float64. A program that
# counts a padded sample is off by ~1/batch.
GRAD_RTOL = 1e-2  # of the tensor's norm: ||g - g_ref|| <= GRAD_ATOL + GRAD_RTOL * ||g_ref||
GRAD_MAX_RTOL = 5e-2  # of its largest element: max|g - g_ref| <= GRAD_ATOL + GRAD_MAX_RTOL * max|g_ref|
GRAD_ATOL = 1e-6  # a tensor whose reference gradient is ~0 must be ~0 too
LOSS_TOL = 1e-4  # relative to max(1, |loss|)

_PACKAGE_ONLY = {"format", "path", "bytes", "sha256", "model", "model_spec", "round", "profile", "density", "source",
                 "verify"}


def export_one(key: dict[str, Any], out: Path) -> dict[str, Any]:
    """Export the program ``key`` names into ``out/<key["file"]>``; its details (what a device needs to drive it)."""
    spec = ModelSpec(**key["spec"])
    kind, mode, batch_size = key["kind"], key.get("mode"), key.get("batch_size")
    # a program does not depend on the profile (only on the key); prepare wants one for its file name
    prep = prepare(get_profile(list_profiles()[0]), spec=spec, seed=0)
    if kind == "inference":
        lowered, interface = onnx_weights_as_inputs(prep)
        check_onnx(lowered.program, prep)
        packaged = package(lowered, out / "pkg")
        details = {k: v for k, v in packaged.entry.items() if k not in _PACKAGE_ONLY}
        details.update(interface)
    else:
        if mode is None or batch_size is None:
            raise ValueError(f"training key {key} lacks a mode or batch size")
        lower = lower_onnx_training if key.get("trainer") == "onnxruntime" else lower_executorch_training
        lowered = lower(prep, mode=mode, batch_size=batch_size, kp=key.get("kp") if mode == "personal" else None)
        packaged = package(lowered, out / "pkg")
        check_training(lowered.program, lowered.details, prep)
        details = {k: v for k, v in packaged.entry.items() if k not in _PACKAGE_ONLY}
    os.replace(packaged.path, out / str(key["file"]))
    return details


class _WeightsAsInputs(nn.Module):
    """``forward(input, *weights)``: the model run with the given tensors in place of its own, in state-dict
    order (a private copy of the model: the tensors are assigned into its parameter and buffer slots, which is
    what the tracer records as uses of the inputs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.net = copy.deepcopy(model)
        self.slots: list[tuple[dict[str, Any], str]] = []
        for key in model.state_dict():
            owner, _, name = key.rpartition(".")
            mod = self.net.get_submodule(owner)
            self.slots.append((mod._parameters if name in mod._parameters else mod._buffers, name))

    def forward(self, x: Tensor, *weights: Tensor) -> Tensor:
        for (slots, name), w in zip(self.slots, weights, strict=True):
            slots[name] = w
        out: Tensor = self.net(x)
        return out


def onnx_weights_as_inputs(prep: Prepared) -> tuple[Any, dict[str, Any]]:
    """The ONNX program (a ``Lowered``, at ``ONNX_OPSET``, batch dynamic) whose inputs are ``input`` then every
    state-dict tensor by key, with no initialiser of the model's; its inputs and outputs, described."""
    import onnx

    state = prep.model.state_dict()
    keys = list(state)
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporter's own deprecation notices
            torch.onnx.export(_WeightsAsInputs(prep.model), (torch.zeros(2, *prep.input_shape), *state.values()),
                              buf,  # type: ignore[arg-type]  # a file object is documented
                              dynamo=False, opset_version=ONNX_OPSET, input_names=["input", *keys],
                              output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    except Exception as e:  # the exporter raises many kinds; say which model and why
        raise ExportError(f"ONNX export of {prep.spec.model} failed: {e}") from e
    proto = onnx.load_from_string(buf.getvalue())
    onnx.checker.check_model(proto)
    names = [i.name for i in proto.graph.input]
    if names != ["input", *keys]:  # an input the tracer dropped (unused) or renamed: a device could not feed it
        odd = [(n, k) for n, k in zip(names, ["input", *keys], strict=False) if n != k]
        raise ExportError(f"the ONNX program's inputs are not input + the state dict's keys: {len(names)} inputs for "
                          f"{len(keys) + 1}, first differences (got, wanted) {odd[:3]}")
    baked = sorted(i.name for i in proto.graph.initializer if i.name in state)
    if baked:
        raise ExportError(f"the ONNX program bakes {baked} in")
    ops = sorted({n.op_type for n in proto.graph.node})
    lowered = Lowered(prep, "onnx", buf.getvalue(), {"opset": ONNX_OPSET, "operators": ops})
    dtype = {torch.float32: "f32", torch.int64: "i64"}
    inputs = [{"name": "input", "dtype": "f32", "shape": ["batch", *prep.input_shape]},
              *({"name": k, "dtype": dtype[v.dtype], "shape": list(v.shape)} for k, v in state.items())]
    return lowered, {"kind": "inference", "inputs": inputs, "weights": keys,
                     "outputs": [{"name": "logits", "dtype": "f32", "shape": ["batch", "num_classes"]}]}


def check_onnx(program: bytes, prep: Prepared) -> None:
    """The program against eager PyTorch, fed the model's own weights and then random ones (a weight the program
    ignored, or baked in, shows there), at batch 3 and 1."""
    import numpy as np
    import onnxruntime as ort

    gen = torch.Generator().manual_seed(0)
    model = copy.deepcopy(prep.model).eval()
    own = {k: v.detach().clone() for k, v in model.state_dict().items()}
    other = {k: (torch.randn(v.shape, generator=gen) * 0.1 + v).to(v.dtype) if v.is_floating_point() else v
             for k, v in own.items()}
    sess = ort.InferenceSession(program, providers=["CPUExecutionProvider"])
    for state in (own, other):
        model.load_state_dict(state)
        for n in (3, 1):
            x = torch.randn(n, *prep.input_shape, generator=gen)
            got = sess.run(["logits"], {"input": x.numpy(), **{k: v.numpy() for k, v in state.items()}})[0]
            with torch.no_grad():
                ref = model(x).numpy()
            err = float(np.abs(got - ref).max())
            if not err <= 1e-4 + 1e-3 * float(np.abs(ref).max()):
                raise ValueError(f"the ONNX program with weights as inputs differs from eager PyTorch by {err:.3g} "
                                 f"(logits up to {float(np.abs(ref).max()):.3g})")


def gradient_mismatches(got: dict[str, Tensor], ref: dict[str, Tensor | None], *, rtol: float = GRAD_RTOL,
                        max_rtol: float = GRAD_MAX_RTOL, atol: float = GRAD_ATOL) -> list[str]:
    """The tensors whose gradient is not the reference's, by name and how far off: per tensor, the difference's
    norm over ``atol + rtol * |g_ref|`` (an error spread over the tensor) or its largest element over
    ``atol + max_rtol * max|g_ref|`` (a few wrong elements), or names or shapes that differ. Empty if they match."""
    bad = [f"{k}: no such gradient" for k in sorted(set(ref) - set(got))]
    for k in sorted(got):
        g, r = got[k], ref.get(k)
        if r is None or g.shape != r.shape:
            bad.append(f"{k}: {'no reference' if r is None else f'shape {list(g.shape)}, not {list(r.shape)}'}")
            continue
        d = (g - r).double()
        err, norm = float(d.norm()), float(r.double().norm())
        worst, scale = float(d.abs().max()), float(r.abs().max())
        if not (err <= atol + rtol * norm and worst <= atol + max_rtol * scale):  # NaN fails too
            bad.append(f"{k}: off by {err / max(norm, 1e-30):.2g} of its norm, {worst / max(scale, 1e-30):.2g} "
                       f"of its largest element ({scale:.3g})")
    return bad


def run_training_program(program: bytes, details: dict[str, Any], args: list[Tensor]) -> list[Tensor]:
    """One call of a training program (either runtime's: ``details["runtime"]``, ExecuTorch where absent) on
    ``args`` (x, y, weight, *params): its outputs (loss, *grads)."""
    import numpy as np

    if details.get("runtime") == "onnxruntime":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(program, opts, providers=["CPUExecutionProvider"])
        out = sess.run(list(details["outputs"]), {n: a.detach().numpy()
                                                  for n, a in zip(details["inputs"], args, strict=True)})
        return [torch.from_numpy(np.asarray(o)) for o in out]
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    module = _load_for_executorch_from_buffer(program)
    return list(module.forward(tuple(a.detach().contiguous() for a in args)))


def check_training(program: bytes, details: dict[str, Any], prep: Prepared) -> None:
    """The training program's loss and gradients on a random, partly padded batch against autograd's (the full
    check, with SGD steps, is edge_runtime.verify_training; the server does not import the device runtime)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    b, n = int(details["batch_size"]), max(1, int(details["batch_size"]) - 1)  # n real samples, padded to b
    x, y = torch.randn(b, *prep.input_shape, generator=gen), torch.randint(0, prep.spec.num_classes, (b,),
                                                                           generator=gen)
    w = torch.cat([torch.ones(n), torch.zeros(b - n)])
    params = dict(prep.model.named_parameters())
    out = run_training_program(program, details, [x, y, w, *(params[k] for k in details["keys"])])
    loss = float(out[0])
    grads = dict(zip(details["trainable"], out[1:], strict=True))
    prep.model.zero_grad()
    ref_t = F.cross_entropy(prep.model(x[:n]), y[:n])
    ref_t.backward()
    ref = float(ref_t.detach())
    loss_ok = abs(loss - ref) <= LOSS_TOL * max(1.0, abs(ref))
    if sorted(grads) != sorted(details["trainable"]) or not loss_ok:
        raise ValueError(f"the training program's loss {loss} or gradients {sorted(grads)} are not eager "
                         f"PyTorch's ({ref}, {sorted(details['trainable'])})")
    bad = gradient_mismatches(grads, {k: params[k].grad for k in grads})
    prep.model.zero_grad()
    if bad:
        raise ValueError(f"the training program's gradients differ from eager PyTorch's: {'; '.join(bad[:5])}")


def main(work: Path) -> int:
    """Export every key of ``work/request.json``; one failed export does not take the others with it."""
    keys = json.loads((work / "request.json").read_text())
    results: list[dict[str, Any]] = []
    for key in keys:
        try:
            results.append({"file": key["file"], "details": export_one(key, work)})
        except Exception as e:  # reported per key: the server marks that program failed and serves the rest
            results.append({"file": key["file"], "error": f"{type(e).__name__}: {e}"})
    (work / "result.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
