"""Export a device's model: ``prepare`` -> ``lower_onnx`` -> ``package`` -> ``verify``, with a manifest.

ONNX (fixed opset, dynamic batch) is here; ExecuTorch inference and training programs come next (issue 4).
"""

from .stages import (
    ONNX_OPSET,
    ExportError,
    Lowered,
    Packaged,
    Prepared,
    Verified,
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
    "lower_onnx",
    "package",
    "prepare",
    "verify",
]
