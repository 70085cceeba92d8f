"""A device's share of a dealt federation's data, as the server deals it (``GET /v1/devices/me/share``,
docs/protocol.md "Data shares"): the indices into the data set's train and test splits its slot holds, in the
order it trains on them, and the label map where the partition relabels (``preference``).

Every partition is dealt by ``pfl_edge.federation.deal`` from the federation's seed; a device that runs numpy's
Generator deals its own share (docs/determinism.md §2). ``dirichlet`` and ``dirichlet-client`` draw from numpy's
gamma sampler, which no document defines: a device without numpy asks for its share instead of reproducing it.
The answer is the deal, not the device's word: nothing a device reports about its data is taken from here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .data.partition import Partition

__all__ = ["MAX_SHARE", "DataShare", "data_share"]

MAX_SHARE = 1_000_000  # samples of one split a share may list (a data set's split; Fashion-MNIST's is 60,000)
_ID_RE = r"^[A-Za-z0-9_-]{1,64}$"


class DataShare(BaseModel):
    """One slot's share of the federation's data set: its samples by index and the labels it learns."""

    # an answer: read tolerantly (a field added later is ignored, docs/protocol.md "Versions")
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)

    federation: str = Field(pattern=_ID_RE, description="federation id")
    slot: int = Field(ge=0, description="the device's slot (Enrolment.index) the share is for")
    dataset: str = Field(max_length=256, description="the data set (config dataset): its splits in their stored "
                                                     "order are what the indices index")
    partition: str = Field(max_length=256, description="the config's partition that dealt it")
    num_classes: int = Field(ge=1, le=100_000, description="the labels the model learns are 0 .. num_classes - 1 "
                                                           "(5 for preference, else the data set's classes)")
    train: list[int] = Field(max_length=MAX_SHARE, description="indices into the train split, ascending: the "
                                                               "device's training samples in the order it trains "
                                                               "on them (docs/determinism.md §2-3)")
    test: list[int] = Field(max_length=MAX_SHARE, description="indices into the test split, ascending: its test "
                                                              "samples")
    label_map: list[int] | None = Field(default=None, max_length=100_000, description=(
        "preference: the label a sample of class c gets is label_map[c], for train and test alike; null: the "
        "data set's classes are the labels"))


def data_share(federation: str, dataset: str, partition: str, part: Partition, slot: int) -> DataShare:
    """``part``'s (``pfl_edge.federation.deal_labels``) share of ``slot``."""
    c = part.clients[slot]
    maps: Any = part.label_maps
    return DataShare(federation=federation, slot=slot, dataset=dataset, partition=partition,
                     num_classes=part.num_classes, train=c.train_idx.tolist(), test=c.test_idx.tolist(),
                     label_map=None if maps is None else list(maps[slot]))
