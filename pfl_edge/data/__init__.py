"""Data sets and partitions. Add a data set with ``@register_dataset``, a split with ``@register_partitioner``."""

from . import sources as _sources  # noqa: F401  (registers the built-in data sets)
from .partition import (
    ClientData,
    Partition,
    PartitionerFn,
    list_partitioners,
    partition,
    register_partitioner,
)
from .registry import (
    Dataset,
    DatasetLoader,
    Labels,
    LabelsLoader,
    get_dataset,
    get_labels,
    list_datasets,
    register_dataset,
)

__all__ = [
    "ClientData",
    "Dataset",
    "DatasetLoader",
    "Labels",
    "LabelsLoader",
    "Partition",
    "PartitionerFn",
    "get_dataset",
    "get_labels",
    "list_datasets",
    "list_partitioners",
    "partition",
    "register_dataset",
    "register_partitioner",
]
