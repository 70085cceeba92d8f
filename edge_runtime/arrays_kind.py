"""What differs between a device with torch and one without: what it holds its models as, where its model's
skeleton and evaluation come from, and where its initial model comes from. The round itself does not differ
(``pfl_edge.algorithms`` over ``pfl_edge.arrays``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pfl_edge.errors import ConfigError
from pfl_edge.protocol import Enrolment

from .data import ArrayData, LocalData
from .programs import ProgramSource
from .tasks import Downloads
from .trainer import OnnxEvaluator

if TYPE_CHECKING:
    from pfl_edge.federation import FederationConfig

__all__ = ["Kind", "array_kind", "initial_model", "open_model"]

Kind = Literal["torch", "numpy"]


def array_kind(asked: str = "auto") -> Kind:
    """What a device holds its models as: ``asked``, or (auto) torch where it is installed, else numpy."""
    if asked in ("torch", "numpy"):
        return asked  # type: ignore[return-value]
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def open_model(data: LocalData | ArrayData, programs: ProgramSource, threads: int,
               max_bytes: int) -> tuple[Any, Callable[..., tuple[float, float]] | None]:
    """The device's model (the ``nn.Module``, or without torch the card's skeleton, checked: within ``max_bytes``,
    the ONNX program's weights its tensors) and how it evaluates (None: eager PyTorch; without torch the server's
    ONNX program)."""
    if isinstance(data, LocalData):
        return data.model, None
    from pfl_edge.skeleton import ModelSkeleton

    skeleton = ModelSkeleton.from_card(programs.card, max_bytes=max_bytes)
    program, details = programs.inference()
    if list(details.get("weights", [])) != list(skeleton.state_dict()):
        raise ConfigError("the server's ONNX program does not take its model card's tensors as weights")
    return skeleton, OnnxEvaluator(program, details, data.arrays.test_x, data.arrays.test_y, threads=threads)


def initial_model(kind: Kind, fed: FederationConfig, data: LocalData | ArrayData, downloads: Downloads,
                  enr: Enrolment) -> dict[str, Any]:
    """The federation's initial model: the server's (FedPer: its base; the personal blocks start from the
    federation's seeded initial model, built here: they never travel). A device without torch cannot build the
    model and takes the whole initial model (its personal blocks are not personal yet) from the server."""
    if kind == "numpy":
        if enr.init_model is None:
            raise ConfigError("this server does not offer the whole initial model (Enrolment.init_model), which a "
                              "device without torch needs: upgrade the server or install torch")
        return downloads.model(enr.init_model)
    from pfl_edge.federation import init_state

    return {**init_state(fed, data.spec), **downloads.model(enr.init_digest)}
