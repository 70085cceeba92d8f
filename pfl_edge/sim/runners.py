"""The simulator's runner for each algorithm: the central runner for the server-coordinated algorithms and the
decentralized ones (``sim.decentral``), chosen by the algorithm's class (no name is compared). It sits above
both runner modules so that neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

from ..algorithms import Algorithm, algorithm_class
from ..algorithms.central import Central
from ..algorithms.dispfl import DisPFL
from ..algorithms.dpsgd import DPSGD
from ..errors import ConfigError
from .algorithms import CentralPFL, Context, Runner
from .decentral import DisPFLRunner, DPSGDRunner

__all__ = ["RUNNERS", "make_algorithm", "runner_for"]

# an algorithm's family (its class or a base of it) -> the runner that drives it over every client's row
RUNNERS: dict[type[Algorithm], Callable[[Context], Runner]] = {
    Central: CentralPFL, DisPFL: DisPFLRunner, DPSGD: DPSGDRunner}


def runner_for(cls: type[Algorithm]) -> Callable[[Context], Runner]:
    for base in cls.__mro__:
        if base in RUNNERS:
            return RUNNERS[base]
    raise ConfigError(f"algorithm {cls.name!r} has no simulator runner; register its family in RUNNERS")


def make_algorithm(ctx: Context) -> Runner:
    return runner_for(algorithm_class(ctx.cfg.algorithm))(ctx)
