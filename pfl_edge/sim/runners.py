"""The simulator's runner for each algorithm name: the central runner for the server-coordinated algorithms and
the decentralized ones (``sim.decentral``). It sits above both so that neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UnknownNameError
from ..federation import CENTRAL
from .algorithms import CentralPFL, Context, Runner
from .decentral import DisPFLRunner, DPSGDRunner

__all__ = ["ALGORITHM_CLASSES", "make_algorithm"]

ALGORITHM_CLASSES: dict[str, Callable[[Context], Runner]] = {
    **dict.fromkeys(CENTRAL, CentralPFL), "dispfl": DisPFLRunner, "dpsgd": DPSGDRunner, "dpsgd-ft": DPSGDRunner}


def make_algorithm(ctx: Context) -> Runner:
    try:
        cls = ALGORITHM_CLASSES[ctx.cfg.algorithm]
    except KeyError:
        raise UnknownNameError("algorithm", ctx.cfg.algorithm, sorted(ALGORITHM_CLASSES)) from None
    return cls(ctx)
