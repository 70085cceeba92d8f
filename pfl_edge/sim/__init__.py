"""The in-process simulator."""

from ..federation import ALGORITHMS, SimConfig, load_config_file
from .algorithms import Algorithm, CentralPFL, Context, RoundStats
from .report import client_table, plot_rounds, write_result
from .runners import RUNNERS, make_algorithm
from .simulator import build_context, sample_participants, simulate

__all__ = [
    "ALGORITHMS",
    "RUNNERS",
    "Algorithm",
    "CentralPFL",
    "Context",
    "RoundStats",
    "SimConfig",
    "build_context",
    "client_table",
    "load_config_file",
    "make_algorithm",
    "plot_rounds",
    "sample_participants",
    "simulate",
    "write_result",
]
