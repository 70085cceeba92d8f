"""Each algorithm's round, defined once as pure functions over ``dict[str, Tensor]`` stacks: what a client does
with what it received, and what the coordinator plans and aggregates. The simulator runs them over every
client's row, a device over its one row, the server calls plan and aggregate."""

from . import central, dispfl, ditto, dpsgd, fedrep
from .algorithm import (
    Algorithm,
    Decentralised,
    DeviceRound,
    algorithm_class,
    device_algorithms,
    get_algorithm,
    list_algorithms,
    register_algorithm,
    sample_participants,
)
from .base import Clients, Metrics, Neighbour, Participation, Received, Trainer, Upload, one_row
from .options import FinetuneOptions, NoOptions

__all__ = [
    "Algorithm",
    "Clients",
    "Decentralised",
    "DeviceRound",
    "FinetuneOptions",
    "Metrics",
    "Neighbour",
    "NoOptions",
    "Participation",
    "Received",
    "Trainer",
    "Upload",
    "algorithm_class",
    "central",
    "device_algorithms",
    "dispfl",
    "ditto",
    "dpsgd",
    "fedrep",
    "get_algorithm",
    "list_algorithms",
    "one_row",
    "register_algorithm",
    "sample_participants",
]
