"""The model card's training section (``ModelCard.training``): local SGD exactly as pfl_edge.train runs it, the
learning-rate schedule, DisPFL's mask schedule and the algorithms' own phases (Ditto's personal model, FedRep's
head), built from a federation's config. Split from pfl_edge.modelcard, which re-exports every name here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .algorithms import Algorithm, algorithm_class
from .algorithms.ditto import DittoOptions
from .algorithms.fedrep import FedRepOptions
from .federation import FederationConfig

__all__ = ["CARD_MODEL_CONFIG", "DittoTraining", "FedRepTraining", "LrSchedule", "MaskSchedule", "TrainingInfo",
           "training_info"]

# read tolerantly: a field a later release adds is ignored by a device of this one (additive fields only carry what
# a device may ignore; a change it must act on gets a new format or protocol version). Unknown *values* of the
# enumerated fields (format, dtype, layer types, ...) are still refused: a device cannot run what it does not know.
CARD_MODEL_CONFIG = ConfigDict(extra="ignore", frozen=True)
_FROZEN = CARD_MODEL_CONFIG

class LrSchedule(BaseModel):
    """The learning rate of round ``t``: ``lr_t = lr * lr_decay ** (t - 1)``."""

    model_config = _FROZEN

    formula: str = Field(description="\"lr * lr_decay ** (t - 1)\", ** the power")
    lr: float = Field(description="round 1's learning rate")
    lr_decay: float = Field(description="factor per round (1: constant across rounds); constant within a round")
    round_index: str = Field(description="what t is: the round, from 1; round 0 (a late joiner's first fine-tuning) "
                                         "uses round 1's lr")


class MaskSchedule(BaseModel):
    """DisPFL's prune-and-regrow, after a round's training (``pfl_edge.algorithms.dispfl.update_masks``,
    ``pfl_edge.sparse.prune_rate`` and ``prune_regrow``; docs/model.md "DisPFL's mask schedule")."""

    model_config = _FROZEN

    alpha0: float = Field(description="the first update's prune rate")
    rounds: int = Field(description="T, the annealing's length: the federation's rounds")
    anneal: Literal["cosine"] = Field(
        default="cosine",
        description="alpha_t = alpha0 / 2 * (1 + cos(pi * (t - 1) / T)) after round t (t from 1): round 1 prunes at "
                    "alpha0")
    prune: Literal["magnitude"] = Field(
        default="magnitude",
        description="per masked tensor, the ceil(alpha_t * nnz) active weights of smallest |w| (the trained weights; "
                    "ties at the cut go to the lower flat index) leave the mask")
    regrow: Literal["gradient", "random"] = Field(
        description="gradient: as many zeros of the pruned mask with the largest |g| join it, g the dense (unmasked) "
                    "gradient at the trained masked weights; random: as many, uniformly at random")
    regrow_batch: str = Field(
        default="one batch: the first batch_size samples of a fresh permutation of the device's data, drawn from the "
                "federation's seeded 'regrow' stream of round t (docs/algorithms.md)",
        description="the batch the regrowth gradient is computed on")
    regrow_just_pruned: bool = Field(default=True, description="whether a weight pruned in this update may regrow in "
                                                               "it (yes: it competes with every other zero)")
    dense_tensors: str = Field(default="a tensor the device's density leaves dense (ERK) keeps its all-ones mask and "
                                       "is neither pruned nor regrown", description="which tensors are left alone")


class DittoTraining(BaseModel):
    """Ditto's personal model (docs/determinism.md, "Ditto on a device"): each round, after or before the global
    model's ``local_epochs``, ``personal_epochs`` of the same SGD on the personal model ``v`` from the ``personal``
    stream, with ``lam * (v - w_t)`` added to each gradient (``w_t``: the model the round's task named)."""

    model_config = _FROZEN

    lam: float = Field(description="the proximal term's weight (config options.lam, default 0.1; 0: none)")
    personal_epochs: int = Field(description="epochs of the personal model per round (config "
                                             "options.personal_epochs, default local_epochs)")


class FedRepTraining(BaseModel):
    """FedRep's two phases (docs/algorithms.md, "FedRep"): each round, from the base it received, the head (the
    personal blocks) alone for ``head_epochs``, the base frozen, batches from the ``personal`` stream; then the base
    alone for ``local_epochs``, the head frozen, batches from ``train``. Both at round t's lr and the same SGD."""

    model_config = _FROZEN

    head_epochs: int = Field(description="epochs of the head alone per round, before the base's local_epochs "
                                         "(config options.head_epochs, default 10; 0: the head keeps its values)")


class TrainingInfo(BaseModel):
    """Local SGD exactly as pfl_edge.train runs it (``torch.optim.SGD`` semantics, docs/model.md "Training"): per
    step, clip and mask the gradient (order: ``clip_unmasked``), ``g = g + weight_decay * w``, momentum
    ``buf = momentum * buf + g`` (``buf = g`` on a round's first step), ``w = w - lr_t * buf``."""

    model_config = _FROZEN

    optimiser: Literal["sgd"] = Field(
        default="sgd", description="stochastic gradient descent, torch.optim.SGD semantics")
    lr: float = Field(description="round 1's learning rate (lr_schedule gives round t's)")
    lr_schedule: LrSchedule = Field(description="the learning rate of each round")
    momentum: float = Field(description="buf = momentum * buf + g (buf = g on the first step); w = w - lr_t * buf")
    dampening: float = Field(default=0.0, description="always 0: momentum adds the whole gradient")
    nesterov: bool = Field(default=False, description="always false: plain momentum")
    weight_decay: float = Field(description="added to the gradient, g = g + weight_decay * w, after clipping and "
                                            "masking, before momentum")
    clip_norm: float | None = Field(description="null: no clipping; else every gradient is multiplied by min(1, "
                                                "clip_norm / (N + 1e-6)), N the total L2 norm over the gradients of "
                                                "the trained tensors")
    clip_unmasked: bool = Field(description="true: clip the whole gradient, then mask it (DisPFL); false: mask, then "
                                            "clip")
    batch_size: int = Field(description="B: samples per step; each epoch a fresh permutation, its last batch partial")
    local_epochs: int = Field(description="epochs of whole-model training per round")
    ft_epochs: int = Field(description="FedPer-FT: epochs on the personal blocks alone (base frozen) before the "
                                       "whole-model epochs; 0 otherwise")
    loss: Literal["cross_entropy"] = Field(
        default="cross_entropy", description="mean over the batch's real samples of logsumexp(logits) - logits[label]")
    momentum_reset: Literal["every_round"] = Field(
        default="every_round", description="the momentum buffers start empty at the first step of every training "
                                           "phase: each round's, and each of its phases (FedPer-FT's and a late "
                                           "joiner's fine-tuning, FedRep's head and base, Ditto's two models); the "
                                           "name is version 1's")
    mask_schedule: MaskSchedule | None = Field(
        default=None, description="DisPFL: how the device's mask changes after each round; null for the others")
    ditto: DittoTraining | None = Field(
        default=None, description="Ditto: how its personal model trains (lam, personal_epochs); null for the others")
    fedrep: FedRepTraining | None = Field(
        default=None, description="FedRep: its head's epochs before the base's (protocol 2; absent for a device of "
                                  "version 1, which reads config options.head_epochs); null for the others")


def training_info(cfg: FederationConfig) -> TrainingInfo:
    """FederationConfig.train_config's SGD, its lr_at schedule and the epochs of a round."""
    tc = cfg.train_config(1)
    algo = algorithm_class(cfg.algorithm)
    schedule = algo.mask_schedule(cfg)
    return TrainingInfo(
        lr=tc.lr, lr_schedule=LrSchedule(formula="lr * lr_decay ** (t - 1)", lr=cfg.lr, lr_decay=cfg.lr_decay,
                                          round_index="t: the round, from 1; round 0 (a late joiner's first "
                                                      "fine-tuning) uses round 1's lr"),
        momentum=tc.momentum, weight_decay=tc.weight_decay, clip_norm=tc.clip_norm, clip_unmasked=tc.clip_unmasked,
        batch_size=tc.batch_size, local_epochs=cfg.local_epochs,
        ft_epochs=algo.finetune_epochs(cfg), mask_schedule=None if schedule is None else MaskSchedule(**schedule),
        ditto=_ditto(cfg, algo), fedrep=_fedrep(cfg, algo))


def _ditto(cfg: FederationConfig, algo: type[Algorithm]) -> DittoTraining | None:
    """Ditto's options, resolved (its personal epochs default to local_epochs); None for the others."""
    if not issubclass(algo.Options, DittoOptions):  # the algorithm's own options say it keeps a personal model
        return None
    opts = algo.options_for(cfg)
    epochs = opts.personal_epochs
    return DittoTraining(lam=opts.lam, personal_epochs=cfg.local_epochs if epochs is None else epochs)


def _fedrep(cfg: FederationConfig, algo: type[Algorithm]) -> FedRepTraining | None:
    if not issubclass(algo.Options, FedRepOptions):
        return None
    opts: FedRepOptions = algo.options_for(cfg)
    return FedRepTraining(head_epochs=opts.head_epochs)
