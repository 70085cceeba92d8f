"""Export a device's model: ``prepare`` -> ``lower_onnx`` | ``lower_executorch`` -> ``package`` -> ``verify``,
with a manifest. ONNX (fixed opset, dynamic batch), ONNX training programs (``lower_onnx_training``: the forward
and backward graph, run by ONNX Runtime), ExecuTorch inference (XNNPACK; float32, and static int8 with
``lower_executorch_int8`` -> ``verify_int8`` on real images), and ExecuTorch training programs
(``lower_executorch_training`` -> ``package``; ``edge_runtime.verify_training`` checks it against eager PyTorch).
"""

from .matmul_conv import MatmulConv2d, matmul_convs
from .quantize import INT8_MAX_ACC_DROP, INT8_MIN_AGREEMENT, INT8_TAG_SUFFIX, lower_executorch_int8, verify_int8
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
from .training import (
    CONVOLUTIONS,
    ONNX_TRAINING_OPSET,
    TRAINING_MODES,
    JointGraph,
    joint_graph,
    lower_executorch_training,
    lower_onnx_training,
)

__all__ = [
    "CONVOLUTIONS",
    "INT8_MAX_ACC_DROP",
    "INT8_MIN_AGREEMENT",
    "INT8_TAG_SUFFIX",
    "ONNX_OPSET",
    "ONNX_TRAINING_OPSET",
    "TRAINING_MODES",
    "ExportError",
    "JointGraph",
    "Lowered",
    "MatmulConv2d",
    "Packaged",
    "Prepared",
    "Verified",
    "joint_graph",
    "lower_executorch",
    "lower_executorch_int8",
    "lower_executorch_training",
    "lower_onnx",
    "lower_onnx_training",
    "matmul_convs",
    "package",
    "prepare",
    "verify",
    "verify_int8",
]
