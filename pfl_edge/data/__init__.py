"""Data sets and partitions. Add a data set with ``@register_dataset``, a split with ``@register_partitioner``.

Imports without PyTorch: a device without it gets its share of a data set read from files as numpy arrays with
``client_arrays`` (the same samples, order and float32 bits as the torch path: ``get_dataset`` and ``partition``
are the numpy ``get_arrays`` and ``partition_arrays`` as tensors)."""

from . import sources as _sources  # noqa: F401  (registers the built-in data sets)
from .client import ClientArrays, client_arrays
from .partition import (
    ClientData,
    ClientIndices,
    Partition,
    PartitionArrays,
    PartitionerFn,
    list_partitioners,
    partition,
    partition_arrays,
    register_partitioner,
)
from .registry import (
    Dataset,
    DatasetArrays,
    DatasetLoader,
    InputShape,
    Labels,
    LabelsLoader,
    get_arrays,
    get_dataset,
    get_labels,
    get_shape,
    list_datasets,
    register_dataset,
)

__all__ = [
    "ClientArrays",
    "ClientData",
    "ClientIndices",
    "Dataset",
    "DatasetArrays",
    "DatasetLoader",
    "InputShape",
    "Labels",
    "LabelsLoader",
    "Partition",
    "PartitionArrays",
    "PartitionerFn",
    "client_arrays",
    "get_arrays",
    "get_dataset",
    "get_labels",
    "get_shape",
    "list_datasets",
    "list_partitioners",
    "partition",
    "partition_arrays",
    "register_dataset",
    "register_partitioner",
]
