"""int8 ExecuTorch inference: post-training static quantisation for XNNPACK through PT2E, and its check.

``prepare`` -> ``lower_executorch_int8`` (calibrated on real inputs) -> ``package`` -> ``verify_int8``. An int8
program cannot match eager float32 logits to 1e-4, so ``verify_int8`` checks what matters on a device instead:
top-1 accuracy on real labelled data against the float32 model, and how often the two agree.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import torch

from pfl_edge.errors import ConfigError

from .stages import ExportError, Lowered, Packaged, Prepared, _runner, _update_manifest, keep_batch_range

__all__ = [
    "INT8_MAX_ACC_DROP",
    "INT8_MIN_AGREEMENT",
    "INT8_TAG_SUFFIX",
    "lower_executorch_int8",
    "verify_int8",
]

INT8_TAG_SUFFIX = "-int8"
INT8_MAX_ACC_DROP = 0.02  # top-1 accuracy may fall by at most 2 points against the float32 model
INT8_MIN_AGREEMENT = 0.95  # and the int8 program must pick the float32 model's class on >= 95 % of inputs
_CALIBRATION_BATCH = 64


def lower_executorch_int8(prepared: Prepared, calibration: torch.Tensor, *, max_batch: int = 256) -> Lowered:
    """An int8 ExecuTorch program (``.pte``) for XNNPACK: weights int8 per output channel, activations int8
    per tensor with ranges observed on ``calibration`` (real inputs, ``(N, C, H, W)``, normalised as in
    training); batch dynamic from 1 to ``max_batch``.

    The returned ``Lowered`` carries ``prepared`` with ``-int8`` appended to its tag, so that ``package``
    names the file ``{model}-{profile}-{tag}-int8.pte`` and does not overwrite the float32 ``.pte`` (nor its
    manifest entry, which is keyed by file name). The model object is shared, not copied."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    if calibration.dim() != 4 or tuple(calibration.shape[1:]) != prepared.input_shape:
        raise ConfigError(f"calibration inputs must be (N, {', '.join(map(str, prepared.input_shape))}), "
                          f"got {tuple(calibration.shape)}")
    if calibration.shape[0] == 0:
        raise ConfigError("calibration needs at least one input: activation ranges are observed on it")
    # batch 2 in the example, dynamic in both exports: batch 1 would specialise the batch dimension, and a
    # static first export would leave a guard (batch == 2) in the graph that the second export trips on
    example = torch.zeros(2, *prepared.input_shape)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=max_batch)},)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporters' and torchao's deprecation notices
            graph = torch.export.export(prepared.model, (example,), dynamic_shapes=dynamic).module()
            observed = prepare_pt2e(graph, quantizer)
            with torch.no_grad():
                for batch in calibration.float().split(_CALIBRATION_BATCH):
                    observed(batch)
            quantized = convert_pt2e(observed)
            ep = torch.export.export(quantized, (example,), dynamic_shapes=dynamic)
            with keep_batch_range():  # see stages.keep_batch_range: the batch range must stay 1..max_batch
                edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
                program = edge.to_executorch().buffer
    except Exception as e:  # quantisation, export and lowering raise many kinds; say which model and why
        raise ExportError(f"int8 ExecuTorch export of {prepared.spec.model} failed: {e}") from e
    ops = sorted({str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"})
    # until ``package`` names files by variant, a distinct tag keeps the int8 and float32 artefacts apart
    int8_prep = dataclasses.replace(prepared, tag=f"{prepared.tag}{INT8_TAG_SUFFIX}")
    return Lowered(int8_prep, "executorch", program, {
        "backend": "xnnpack",
        "quantization": "int8 static per-channel",
        "calibration_samples": int(calibration.shape[0]),
        "operators": ops,
        "max_batch": max_batch,
    })


def verify_int8(packaged: Packaged, real_x: torch.Tensor, real_y: torch.Tensor, *,
                max_acc_drop: float = INT8_MAX_ACC_DROP, min_agreement: float = INT8_MIN_AGREEMENT) -> dict[str, Any]:
    """Top-1 accuracy of the eager float32 model and of the artefact on real labelled inputs, their top-1
    agreement and the largest logit difference. Raises ``ExportError`` when accuracy falls by more than
    ``max_acc_drop`` (a fraction: 0.02 is two points) or agreement is below ``min_agreement``; otherwise
    records the figures under ``verify`` in the artefact's manifest entry and returns them.

    Use inputs the calibration did not see (a test split): calibrating and checking on the same images
    would flatter the artefact."""
    prep = packaged.lowered.prepared
    if real_x.dim() != 4 or tuple(real_x.shape[1:]) != prep.input_shape:
        raise ConfigError(f"inputs must be (N, {', '.join(map(str, prep.input_shape))}), got {tuple(real_x.shape)}")
    if real_y.shape != (real_x.shape[0],) or real_x.shape[0] == 0:
        raise ConfigError(f"need one label per input and at least one input: {tuple(real_x.shape)} inputs, "
                          f"{tuple(real_y.shape)} labels")
    run = _runner(packaged)
    # within the program's batch range: it was exported for batches 1..max_batch
    chunk = int(packaged.lowered.details.get("max_batch", 256))
    ref_parts, got_parts = [], []
    for xb in real_x.float().split(chunk):
        with torch.no_grad():
            ref_parts.append(prep.model(xb).numpy())
        out = run(xb.numpy())
        if out.shape != ref_parts[-1].shape:
            raise ExportError(f"{packaged.path.name}: output shape {out.shape} != eager {ref_parts[-1].shape}")
        got_parts.append(out)
    ref, got = np.concatenate(ref_parts), np.concatenate(got_parts)
    y = real_y.numpy()
    fp32_acc = float((ref.argmax(1) == y).mean())
    int8_acc = float((got.argmax(1) == y).mean())
    agreement = float((ref.argmax(1) == got.argmax(1)).mean())
    report: dict[str, Any] = {
        "samples": int(y.shape[0]),
        "fp32_accuracy": fp32_acc,
        "int8_accuracy": int8_acc,
        "accuracy_drop": fp32_acc - int8_acc,
        "top1_agreement": agreement,
        "max_abs_logit_err": float(np.abs(got - ref).max()),
        "max_acc_drop": max_acc_drop,
        "min_agreement": min_agreement,
    }
    if fp32_acc - int8_acc > max_acc_drop:
        raise ExportError(f"{packaged.path.name}: top-1 accuracy {int8_acc:.4f} against float32 {fp32_acc:.4f} on "
                          f"{y.shape[0]} real inputs, a drop of {100 * (fp32_acc - int8_acc):.2f} points "
                          f"(at most {100 * max_acc_drop:.2f} allowed)")
    if agreement < min_agreement:
        raise ExportError(f"{packaged.path.name}: agrees with the float32 model on {100 * agreement:.2f} % of "
                          f"{y.shape[0]} real inputs (at least {100 * min_agreement:.2f} % required)")
    report["passed"] = True
    packaged.entry["verify"] = report
    _update_manifest(packaged.path.parent, packaged.entry)
    return report
