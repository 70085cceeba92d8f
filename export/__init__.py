"""Export a device's model: ``prepare`` -> ``lower_onnx`` | ``lower_executorch`` -> ``package`` -> ``verify``,
with a manifest. ONNX (fixed opset, dynamic batch) and ExecuTorch inference (XNNPACK) are here; int8 and
on-device training programs come next.
"""

from .stages import (
    ONNX_OPSET,
    ExportError,
    Lowered,
    Packaged,
    Prepared,
    Verified,
    lower_executorch,
    lower_onnx,
    package,
    prepare,
    verify,
)

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
