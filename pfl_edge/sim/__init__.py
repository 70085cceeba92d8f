"""The in-process simulator."""

from ..federation import ALGORITHMS, SimConfig, load_config_file
from .algorithms import Context, RoundStats, Runner
from .ray_backend import RayTrainer, TrainerLike
from .report import client_table, plot_rounds, write_result
from .simulator import BACKENDS, build_context, sample_participants, simulate

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "Context",
    "RayTrainer",
    "RoundStats",
    "Runner",
    "SimConfig",
    "TrainerLike",
    "build_context",
    "client_table",
    "load_config_file",
    "plot_rounds",
    "sample_participants",
    "simulate",
    "write_result",
]
