"""D-PSGD with multi-epoch local training, DisPFL's dense decentralised baseline: every client trains, then
averages its model with its in-neighbours' (equal weights, dense). A client deploys that neighbourhood average,
its consensus model; ``dpsgd-ft`` first fine-tunes it on its own data for ``ft_epochs`` (not kept)."""

from __future__ import annotations

from ..arrays import Array as Tensor
from ..arrays import Stack, broadcast_rows, ones_like, stack_states, unstack
from ..neighbourhood import neighbourhood_average
from ..seeding import Stream
from ..sgd import TrainConfig, TrainResult
from .algorithm import Decentralised, register_algorithm
from .base import Clients
from .options import DecentralFinetuneOptions, FinetuneOptions
from .simulation import SimRound, Simulation, World, traffic

__all__ = ["DPSGD", "DPSGDFT", "DPSGDSimulation", "round_step", "uniform_mean"]


def round_step(cl: Clients, weights: Stack, mixing: Tensor, t: int, *, finetune: TrainConfig | None = None,
               ft_from: str = "neighbourhood") -> tuple[Stack, TrainResult, Stack]:
    """Train, average over each row of ``mixing``; returns the averages, the training result and what each
    client deploys: its average, or (``finetune``: D-PSGD-FT's fine-tuning, not kept) fine-tuned from its
    neighbourhood average, from the uniform mean of every client's trained model (``ft_from = "uniform"``, the
    reference's ``w_global``), or from the mean of every client's average (``"all"``)."""
    res = cl.trainer.train(weights, cl.slots, cl.cfg.train_config(t), cl.gens(Stream.TRAIN, t))
    avg = neighbourhood_average(res.stack, mixing)
    deployed = avg
    if finetune is not None and finetune.epochs:
        start = (avg if ft_from == "neighbourhood" else uniform_mean(res.stack) if ft_from == "uniform"
                 else neighbourhood_average(avg, ones_like(mixing)))  # only the start asked for is computed
        deployed = cl.trainer.train(start, cl.slots, finetune, cl.gens(Stream.FINETUNE, t)).stack
    return avg, res, deployed


def uniform_mean(stack: Stack) -> Stack:
    """Every row's uniform mean, in every row (the reference's ``_avg_aggregate``: sum of w / n, in float32)."""
    n = len(next(iter(stack.values())))
    # an integer buffer (a batch counter) is no weight: row 0's, its type kept
    return {k: broadcast_rows(sum(v[i] * (1 / n) for i in range(n)) if v.is_floating_point() else v[0], n)
            for k, v in stack.items()}


@register_algorithm("dpsgd")
class DPSGD(Decentralised):
    """Registered for the simulator; D-PSGD does not run on devices."""

    def round(self, cl: Clients, weights: Stack, mixing: Tensor, t: int) -> tuple[Stack, TrainResult, Stack]:
        """``round_step`` as this variant deploys (D-PSGD-FT: fine-tuned, on its cadence)."""
        opts = self.options
        if not (self.finetunes_deployed(t) and isinstance(opts, FinetuneOptions)):
            return round_step(cl, weights, mixing, t)
        return round_step(cl, weights, mixing, t, finetune=opts.train_config(self.cfg, t), ft_from=opts.ft_from)

    def simulation(self, world: World) -> Simulation:
        return DPSGDSimulation(self, world)

    def finetunes_deployed(self, t: int) -> bool:
        return self.deploys_finetuned and (not isinstance(self.options, FinetuneOptions)
                                           or self.options.due(t, self.cfg.rounds))

    def train_epochs(self, t: int | None = None) -> int:
        """Epochs over its data a client spends in round ``t`` (for the FLOPs count)."""
        ft = self.finetunes_deployed(t) if t is not None else self.deploys_finetuned
        opts = self.options
        return self.cfg.local_epochs + (opts.epochs(self.cfg) if ft and isinstance(opts, FinetuneOptions) else 0)


@register_algorithm("dpsgd-ft")
class DPSGDFT(DPSGD):
    """D-PSGD whose clients deploy their neighbourhood average fine-tuned on their own data (``FinetuneOptions``:
    every round by default; the reference's: ``ft_every = 100, ft_from = "uniform", ft_recipe = "reference"``)."""

    Options = DecentralFinetuneOptions
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
        # the paper's D-PSGD curve (the reference's global_test_acc): the uniform mean of every client's trained
        # model, on each client's test set; mean_acc stays what each client deploys (its neighbourhood average)
        acc, _ = cl.trainer.evaluate(uniform_mean(res.stack), cl.slots)
        extra: dict[str, object] = {"mean_acc_global": float(acc.mean()), "client_acc_global": acc.tolist()}
        return SimRound(deployed, res.loss, cl.n_train, up, down, busiest, received, flops, [1.0] * len(cl), extra)

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.weights
