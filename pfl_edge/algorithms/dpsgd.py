"""D-PSGD with multi-epoch local training, DisPFL's dense decentralised baseline: every client trains, then
averages its model with its in-neighbours' (equal weights, dense). A client deploys that neighbourhood average,
its consensus model; ``dpsgd-ft`` first fine-tunes it on its own data for ``ft_epochs`` (not kept)."""

from __future__ import annotations

from ..arrays import Array as Tensor
from ..arrays import Stack, ones_like, stack_states, unstack
from ..neighbourhood import neighbourhood_average
from ..seeding import Stream
from ..sgd import TrainResult
from .algorithm import Decentralised, register_algorithm
from .base import Clients
from .options import FinetuneOptions
from .simulation import SimRound, Simulation, World, traffic

__all__ = ["DPSGD", "DPSGDFT", "DPSGDSimulation", "round_step"]


def round_step(cl: Clients, weights: Stack, mixing: Tensor, t: int, *, finetuned: bool = False,
               from_all: bool = False) -> tuple[Stack, TrainResult, Stack]:
    """Train, average over each row of ``mixing``; returns the averages, the training result and what each
    client deploys (``finetuned``: D-PSGD-FT's, the average fine-tuned for ``ft_epochs``, not kept; ``from_all``:
    every client fine-tunes the average of all clients' models instead of its neighbourhood's)."""
    res = cl.trainer.train(weights, cl.slots, cl.cfg.train_config(t), cl.gens(Stream.TRAIN, t))
    avg = neighbourhood_average(res.stack, mixing)
    deployed = avg
    if finetuned and cl.cfg.ft_epochs:
        start = neighbourhood_average(avg, ones_like(mixing)) if from_all else avg
        deployed = cl.trainer.train(start, cl.slots, cl.cfg.train_config(t, cl.cfg.ft_epochs),
                                    cl.gens(Stream.FINETUNE, t)).stack
    return avg, res, deployed


@register_algorithm("dpsgd")
class DPSGD(Decentralised):
    """Registered for the simulator; D-PSGD does not run on devices."""

    def round(self, cl: Clients, weights: Stack, mixing: Tensor, t: int) -> tuple[Stack, TrainResult, Stack]:
        """``round_step`` as this variant deploys (D-PSGD-FT: fine-tuned, on its cadence)."""
        opts = self.options
        from_all = isinstance(opts, FinetuneOptions) and opts.ft_from == "all"
        return round_step(cl, weights, mixing, t, finetuned=self.finetunes_deployed(t), from_all=from_all)

    def simulation(self, world: World) -> Simulation:
        return DPSGDSimulation(self, world)

    def finetunes_deployed(self, t: int) -> bool:
        return self.deploys_finetuned and (not isinstance(self.options, FinetuneOptions)
                                           or self.options.due(t, self.cfg.rounds))

    def train_epochs(self, t: int | None = None) -> int:
        """Epochs over its data a client spends in round ``t`` (for the FLOPs count)."""
        ft = self.finetunes_deployed(t) if t is not None else self.deploys_finetuned
        return self.cfg.local_epochs + (self.cfg.ft_epochs if ft else 0)


@register_algorithm("dpsgd-ft")
class DPSGDFT(DPSGD):
    """D-PSGD whose clients deploy their neighbourhood average fine-tuned on their own data (``FinetuneOptions``:
    every round by default; the reference's: ``ft_every = 100, ft_from = "all"``)."""

    Options = FinetuneOptions
    deploys_finetuned = True


class DPSGDSimulation(Simulation):
    """Every client's D-PSGD(-FT) round at once. Bytes: each client's dense trained model once per
    out-neighbour; FLOPs: 3 forwards per sample per epoch trained or fine-tuned."""

    def __init__(self, algo: DPSGD, world: World) -> None:
        super().__init__(algo, world)
        self.dpsgd = algo
        self.weights: Stack = stack_states([dict(world.init)] * len(world.clients))
        self._deployed: Stack | None = None

    def round(self, t: int, participants: Tensor) -> SimRound:
        from ..accounting import payload_bytes
        from ..topology import mixing_matrix

        cl = self.world.clients
        nbrs = self.algo.neighbours(t) or []
        self.weights, res, deployed = self.dpsgd.round(cl, self.weights, mixing_matrix(nbrs), t)
        up, down, busiest, received = traffic([payload_bytes(unstack(res.stack, i)) for i in range(len(cl))], nbrs)
        self._deployed = deployed
        flops = (3 * self.world.dense_flops * self.dpsgd.train_epochs(t) * cl.n_train).tolist()
        return SimRound(deployed, res.loss, cl.n_train, up, down, busiest, received, flops, [1.0] * len(cl))

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.weights
