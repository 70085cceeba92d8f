"""D-PSGD with multi-epoch local training, DisPFL's dense decentralised baseline: every client trains, then
averages its model with its in-neighbours' (equal weights, dense). A client deploys that neighbourhood average,
its consensus model; ``dpsgd-ft`` first fine-tunes it on its own data for ``ft_epochs`` (not kept)."""

from __future__ import annotations

from ..arrays import Array as Tensor
from ..arrays import Stack
from ..neighbourhood import neighbourhood_average
from ..seeding import Stream
from ..sgd import TrainResult
from .algorithm import Decentralised, register_algorithm
from .base import Clients

__all__ = ["DPSGD", "DPSGDFT", "round_step"]


def round_step(cl: Clients, weights: Stack, mixing: Tensor, t: int, *,
               finetuned: bool = False) -> tuple[Stack, TrainResult, Stack]:
    """Train, average over each row of ``mixing``; returns the averages, the training result and what each
    client deploys (``finetuned``: D-PSGD-FT's, the average fine-tuned for ``ft_epochs``, not kept)."""
    res = cl.trainer.train(weights, cl.slots, cl.cfg.train_config(t), cl.gens(Stream.TRAIN, t))
    avg = neighbourhood_average(res.stack, mixing)
    deployed = avg
    if finetuned and cl.cfg.ft_epochs:
        deployed = cl.trainer.train(avg, cl.slots, cl.cfg.train_config(t, cl.cfg.ft_epochs),
                                    cl.gens(Stream.FINETUNE, t)).stack
    return avg, res, deployed


@register_algorithm("dpsgd")
class DPSGD(Decentralised):
    """Registered for the simulator; D-PSGD does not run on devices."""

    def round(self, cl: Clients, weights: Stack, mixing: Tensor, t: int) -> tuple[Stack, TrainResult, Stack]:
        """``round_step`` as this variant deploys (D-PSGD-FT: fine-tuned)."""
        return round_step(cl, weights, mixing, t, finetuned=self.deploys_finetuned)

    def train_epochs(self) -> int:
        """Epochs over its data a client spends in a round (for the FLOPs count)."""
        return self.cfg.local_epochs + (self.cfg.ft_epochs if self.deploys_finetuned else 0)


@register_algorithm("dpsgd-ft")
class DPSGDFT(DPSGD):
    """D-PSGD whose clients deploy their neighbourhood average fine-tuned on their own data."""

    deploys_finetuned = True
