"""The in-process simulator."""

from ..federation import ALGORITHMS, SimConfig, load_config_file
from .algorithms import Algorithm, CentralPFL, Context, RoundStats
from .ray_backend import RayTrainer, TrainerLike
from .report import client_table, plot_rounds, write_result
from .runners import RUNNERS, make_algorithm
from .simulator import BACKENDS, build_context, sample_participants, simulate

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "RUNNERS",
    "Algorithm",
    "CentralPFL",
    "Context",
    "RayTrainer",
    "RoundStats",
    "SimConfig",
    "TrainerLike",
    "build_context",
    "client_table",
    "load_config_file",
    "make_algorithm",
    "plot_rounds",
    "sample_participants",
    "simulate",
    "write_result",
]
