"""A server averages a shared part; the rest stays on each client: FedAvg (everything shared), FedPer (the last
K_P blocks personal, Arivazhagan et al. 2019), their -FT variants, and purely local training (nothing shared).

A round, for client i: take the new base under its own personal blocks (FedPer-FT: then train the personal
blocks alone for ``ft_epochs``, base frozen); evaluate what it deploys (FedAvg-FT: a copy fine-tuned on its
data); train every block for ``local_epochs``; send the base. The server averages the bases weighted by
training samples, per tensor over the clients that sent it (clients of different K_P send different parts).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..arrays import Array as Tensor
from ..arrays import Stack, broadcast_rows, unstack
from ..errors import DivergedError, InternalError
from ..privacy import device_noise, private_mean, privatize, round_noise
from ..sgd import TrainConfig, TrainResult
from .algorithm import Algorithm, DeviceRound, register_algorithm
from .base import Clients, Metrics, Received, Upload, one_row
from .central_parts import (
    aggregate_bases,
    all_finite,
    deploy,
    personal_finetune,
    train_round,
    upload,
    with_base,
)
from .options import FinetuneOptions
from .simulation import SimRound, Simulation, World

if TYPE_CHECKING:
    from ..aggregate import AggregationRule, PartialAverage


#: clients trained per call in a simulated round (what is held of trained models at once; a cnn client: 1.8 MB)
TRAIN_CHUNK = 128

__all__ = [
    "TRAIN_CHUNK",
    "Central",
    "CentralSimulation",
    "FedAvg",
    "FedAvgFT",
    "FedPer",
    "FedPerFT",
    "Local",
    "aggregate_bases",
    "all_finite",
    "deploy",
    "personal_finetune",
    "train_round",
    "upload",
    "with_base",
]

log = logging.getLogger(__name__)


class Central(Algorithm):
    """The server-coordinated algorithms: clients train every block, send their base (the blocks below K_P) and
    take the server's sample-weighted average of the bases back; the personal blocks never leave a client.

    A round is composed once, from the methods below, for the simulator (over every client's row) and for a
    device (its one row): ``receive`` the base, evaluate what it ``deploy``s, train (``local_round``), send
    (``device_upload``). An algorithm of this family that keeps more per client (Ditto: a second, personal
    model) says so in ``init_clients``, ``local_round`` and ``deployed_view``."""

    final_evaluation = True
    private = True

    def partial_sum(self) -> PartialAverage | None:
        from ..aggregate import PartialAverage  # the coordinator's side (torch); a device never aggregates

        # the private mean re-clips every update itself: a replica's sum would hide them from it
        private = self.cfg.privacy is not None or self.cfg.secure_aggregation is not None
        return PartialAverage() if self.split.base and not private else None

    def aggregate(self, prev: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]], *,
                  rule: AggregationRule | None = None, history: Sequence[float] = (),
                  bounds: Sequence[float | None] | None = None, norms: Sequence[float] | None = None,
                  start: PartialAverage | None = None, summed: Sequence[tuple[np.ndarray, int]] | None = None,
                  noise: np.random.Generator | None = None, t: int = 0,
                  ids: Sequence[int] | None = None) -> dict[str, Tensor] | None:
        """The round's new base, composed here for the simulator and the server alike: under secure aggregation
        the mean of round ``t``'s unmasked sum (``pfl_edge.secagg.aggregate.secure_mean``: the simulator runs
        the protocol over ``updates``, whose slots are ``ids``; a server gives the sums it unmasked, ``summed`` =
        (sum, survivors) per group, checked there before anything is released, SumOutOfRange where none passes);
        under differential
        privacy the private mean (``pfl_edge.privacy.private_mean``, which bounds every update itself); under a
        robust ``rule`` that rule (it bounds the updates itself); else the sample-weighted mean of the bases
        (``aggregate_bases``), each update first held to its norm bound (the update-bound stage,
        ``pfl_edge.aggregate.bounded``): ``bounds`` as given (one per update, in order: a server that has merged
        replicas' partial sums passes the rest with their bounds), or ``rule.bounds`` of the updates' ``norms``
        (computed here where not given) and ``history``. No ``rule`` and no ``bounds``: the plain mean."""
        if not self.split.base:
            return None
        if self.cfg.secure_aggregation is not None:
            from ..secagg.aggregate import apply_sum, secure_mean  # the coordinator's side (cryptography)

            if summed is not None:
                return {**prev, **apply_sum(self.cfg, {k: prev[k] for k in self.split.base}, summed)}
            return secure_mean(self.cfg, prev, updates, t, ids)
        if self.cfg.privacy is not None:
            if start is not None:
                raise InternalError("partial sums under differential privacy: the private mean takes every update")
            return private_mean(self.cfg, prev, updates, noise)
        if rule is not None and rule.rule != "mean":
            from ..aggregate import robust_aggregate  # the coordinator's side (torch)

            if start is not None:
                raise InternalError(f"partial sums under the {rule.rule!r} rule: only the mean merges")
            return robust_aggregate(prev, list(updates), rule, history)
        if bounds is not None or (rule is not None and rule.bounds_updates):
            from ..aggregate import bounded  # the coordinator's side (torch)

            updates = bounded(prev, updates, rule, history=history, bounds=bounds, norms=norms)
        return aggregate_bases(prev, updates, start)

    def simulation(self, world: World) -> Simulation:
        return CentralSimulation(self, world)

    def device_programs(self) -> tuple[str, ...]:
        # -FT's fine-tuning phase has a program of its own (the personal blocks alone, the base as an input)
        return (self.program_mode, "personal") if self.finetunes_personal and self.split.personal else (
            self.program_mode,)

    def init_clients(self, cl: Clients, init: Mapping[str, Tensor]) -> Stack:
        """Every client's state before round 1, stacked, from the federation's initial model (one model seen in
        every row until a client's own part is copied out of it)."""
        return {k: broadcast_rows(v, len(cl)) for k, v in init.items()}

    def local_round(self, cl: Clients, state: Stack, t: int) -> TrainResult:
        """The clients' training of round ``t`` from ``state`` (the base received): local SGD over every block."""
        return train_round(cl, state, t)

    def deployed_view(self, state: Stack) -> Stack:
        """The model in a client's state that it deploys (its whole state here), before any fine-tuning."""
        return state

    def deploy(self, cl: Clients, state: Stack, t: int) -> Stack:
        """What the clients deploy after round ``t`` (and are evaluated on)."""
        return deploy(cl, self.deployed_view(state), t, finetune=self.finetune_config(t))

    def finetune_config(self, t: int) -> TrainConfig | None:
        """The fine-tuning of what the clients deploy after round ``t`` (FedAvg-FT, on its cadence and by its
        recipe, ``FinetuneOptions``); None where it is deployed as is."""
        if not self.finetunes_deployed(t):
            return None
        opts = self.options
        return opts.train_config(self.cfg, t) if isinstance(opts, FinetuneOptions) else self.cfg.train_config(
            t, self.cfg.ft_epochs)

    def finetunes_deployed(self, t: int) -> bool:
        """Does what the clients deploy after round ``t`` get fine-tuned (FedAvg-FT, on its cadence)?"""
        return self.deploys_finetuned and (not isinstance(self.options, FinetuneOptions)
                                           or self.options.due(t, self.cfg.rounds))

    def train_epochs(self, participated: bool, t: int | None = None) -> int:
        """Epochs over its data a client spends in round ``t`` (for the FLOPs count): its local training if it
        took part, plus fine-tuning where the algorithm fine-tunes (in every round, or ``t``'s on its cadence)."""
        cfg, opts = self.cfg, self.options
        personal = set(self.split.personal)
        if self.finetunes_deployed(t) if t is not None else self.deploys_finetuned:
            ft = opts.epochs(cfg) if isinstance(opts, FinetuneOptions) else cfg.ft_epochs
        else:
            ft = cfg.ft_epochs if self.finetunes_personal and any(
                k in personal for k, _ in self.model.named_parameters()) else 0
        return (cfg.local_epochs if participated else 0) + ft

    def receive(self, cl: Clients, state: Stack, base: Mapping[str, Tensor] | None, t: int, *,
                finetune: bool | None = None) -> Stack:
        """Clients take the base of round ``t`` (FedPer-FT, or ``finetune``: and adapt their personal blocks)."""
        out = with_base(state, base, self.split)
        if self.finetunes_personal if finetune is None else finetune:
            out = personal_finetune(cl, out, self.split, t)
        return out

    # ------------------------------------------------------------------------------------------ device
    def device_init(self, dev: Clients, init: Mapping[str, Tensor], density: float) -> dict[str, Tensor]:
        return unstack(self.init_clients(dev, init), 0)

    def device_upload(self, state: Mapping[str, Tensor]) -> Upload:
        return Upload(upload(state, self.split))

    def sent(self, base: Mapping[str, Tensor], trained: Mapping[str, Tensor], t: int, slot: int, *,
             seeded: bool = False) -> dict[str, Tensor]:
        """What the client ``slot`` sends in round ``t`` of its model ``trained`` from ``base``: its base part,
        under differential privacy clipped (and in the distributed mode noised: ``pfl_edge.privacy.privatize``;
        ``seeded``: the noise from the seed, the simulator's)."""
        up = upload(trained, self.split)
        if self.cfg.privacy is None:
            return up
        return privatize(self.cfg, base, up, device_noise(self.cfg, t, slot, seeded=seeded))

    def device_round(self, dev: Clients, state: Mapping[str, Tensor], received: Received, t: int, *,
                     prev: int = 0, late: bool = False, final: bool = False) -> DeviceRound:
        """Take the base of the last round (a late joiner adapts its fresh head to it, as FedPer-FT would),
        report the metrics of the round it last trained in, then (unless ``final``) train round ``t`` and send
        the base."""
        ft = self.finetunes_personal or (late and prev == 0 and bool(self.split.personal))
        synced = self.receive(dev, one_row(state), received.base, prev, finetune=ft)
        metrics = []
        deployed = self.deploy(dev, synced, prev) if prev >= 1 or final else None
        if deployed is not None and prev >= 1:
            acc, loss = dev.trainer.evaluate(deployed, dev.slots)
            metrics.append(Metrics(prev, float(acc[0]), float(loss[0])))
        if final:
            return DeviceRound(unstack(synced, 0), None, metrics,
                               deployed=None if deployed is None else unstack(deployed, 0))
        res = self.local_round(dev, synced, t)
        new = unstack(res.stack, 0)
        sent = self.sent(upload(unstack(synced, 0), self.split), new, t, int(dev.slots[0]))
        # what it deploys is its state (saved anyway) until the final step puts it on the last base
        return DeviceRound(new, Upload(sent), metrics, train_loss=float(res.loss[0]), steps=int(res.steps[0]))


class CentralSimulation(Simulation):
    """Every client of a server-coordinated algorithm: the drawn clients train (``local_round``) from the base
    under their own blocks and send it (``upload``), the base is averaged (``aggregate``), every client takes it
    (``receive``; FedPer-FT adapts, drawn or not) and deploys (``deploy``): the pieces of a device's round, over
    every row (a device runs them from the receiving end: it takes the last base before it trains). Bytes: the
    base each way per drawn client; FLOPs: 3 forwards per sample per epoch trained or fine-tuned."""

    def __init__(self, algo: Central, world: World) -> None:
        super().__init__(algo, world)
        self.central = algo
        self.clients: Stack = algo.init_clients(world.clients, world.init)
        self.base: dict[str, Tensor] | None = upload(world.init, algo.split) if algo.split.base else None
        self._deployed: Stack | None = None
        self._norms: list[float] = []  # the last round's update norms: a small round's bound takes them too
        self.clients = algo.receive(world.clients, self.clients, self.base, 0)  # FedPer-FT adapts at once

    def _trained(self, t: int, participants: Tensor, losses: list[tuple[Tensor, Tensor]]
                 ) -> Iterator[tuple[dict[str, Tensor], float]]:
        """The participants' uploads in slot order, trained TRAIN_CHUNK clients at a time as the average asks for
        them: a round of many small clients never holds every trained model at once, and the average, taken in
        the same order, is the same to the bit."""
        from ..train import index_stack

        algo, everyone = self.central, self.world.clients
        shared = set(algo.split.base) if self.base is not None else set()
        for rows in participants.split(TRAIN_CHUNK):
            part = everyone.subset(rows)
            res = algo.local_round(part, with_base(index_stack(self.clients, rows), self.base, algo.split), t)
            for k, v in res.stack.items():
                if k not in shared:  # the trained base goes to the average; every client takes the new one
                    self.clients[k][rows] = v
            losses.append((res.loss, part.n_train))
            for j, n in enumerate(part.n_train):
                yield algo.sent(self.base or {}, unstack(res.stack, j), t, int(part.slots[j]), seeded=True), float(n)

    def _bounded(self, t: int, participants: Tensor, losses: list[tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        """Round ``t``'s base as a server at its default aggregation makes it (``DEFAULT_RULE``: each update held
        to ``DEFAULT_NORM_MULTIPLE`` (1) x the low median of the round's other updates' norms, the last round's too
        in a round of fewer than 3; then the sample-weighted mean, in slot order), so that the simulator and a
        federation of devices publish the same bases. Memory stays one chunk's: the first pass trains and averages
        the updates as they come, keeping only their norms; where the bounds then hold any update back, the round
        is trained again from the same start (the same streams and chunks: the same numbers) and averaged held to
        them. At a multiple of 1 nearly every round clips (each update above the others' low median), so such a
        round trains twice (the cost: BENCHMARKS.md, "Issue 49")."""
        from ..aggregate import DEFAULT_RULE, update_norm

        algo, base = self.central, self.base
        if base is None:
            raise InternalError("a bounded round needs a base")
        shared = set(algo.split.base)
        before = {k: v[participants] for k, v in self.clients.items() if k not in shared}  # copies of their rows
        norms: list[float] = []

        def measured() -> Iterator[tuple[dict[str, Tensor], float]]:
            for up, w in self._trained(t, participants, losses):
                norms.append(update_norm(base, up))
                yield up, w

        new = algo.aggregate(base, measured(), t=t)
        history, self._norms = self._norms, norms
        bounds = DEFAULT_RULE.bounds(norms, history)
        if any(b is not None and n > b for n, b in zip(norms, bounds, strict=True)):
            for k, v in before.items():  # the round again, from the same start, held to the bounds
                self.clients[k][participants] = v
            losses.clear()
            new = algo.aggregate(base, self._trained(t, participants, losses), bounds=bounds, norms=norms, t=t)
        if new is None:
            raise InternalError("a central algorithm with a base aggregated nothing")
        return new

    def _secure_or_private(self, t: int, participants: Tensor,
                           uploads: Iterable[tuple[Mapping[str, Tensor], float]]) -> dict[str, Tensor] | None:
        """The private or secure round's base; a secure round whose every group's sum fails its check publishes
        nothing (the base stays), as a server's does."""
        if self.base is None:
            raise InternalError("a round's private or secure mean without a base")
        algo = self.central
        if algo.cfg.secure_aggregation is None:
            return algo.aggregate(self.base, uploads, noise=round_noise(algo.cfg, t), t=t)
        from ..secagg.aggregate import SumOutOfRange  # the coordinator's side (cryptography)

        try:
            return algo.aggregate(self.base, uploads, t=t, ids=participants.tolist())
        except SumOutOfRange as e:
            log.error("round %d: the unmasked sum is refused (%s); the base stays the round's start", t, e)
            return self.base

    def round(self, t: int, participants: Tensor) -> SimRound:
        import torch

        from ..accounting import payload_bytes

        algo, everyone = self.central, self.world.clients
        losses: list[tuple[Tensor, Tensor]] = []
        base_bytes = payload_bytes(self.base) if self.base else 0
        if self.base is not None and algo.cfg.privacy is None and algo.cfg.secure_aggregation is None:
            self.base = self._bounded(t, participants, losses)
        else:  # the private and the secure mean bound every update themselves; no base (local): nothing to mean
            uploads = self._trained(t, participants, losses)
            if self.base is not None:
                self.base = self._secure_or_private(t, participants, uploads)
            for _ in uploads:  # nothing shared (local): train all the same
                pass
        if self.base is not None and not all_finite(self.base):
            raise DivergedError(f"round {t}: the shared base holds NaN/Inf (a client's training diverged"
                                + ("; under differential privacy the noise, z clip / (q N) per coordinate, may "
                                   "be too large for this model: more clients, or a larger epsilon)"
                                   if algo.cfg.privacy is not None else ": a smaller learning rate)"))
        n = len(everyone)
        up, down = [0] * n, [0] * n
        for i in participants.tolist():
            up[i] = down[i] = base_bytes
        self.clients = algo.receive(everyone, self.clients, self.base, t)
        self._deployed = algo.deploy(everyone, self.clients, t)
        took_part = set(participants.tolist())
        epochs = torch.tensor([algo.train_epochs(i in took_part, t) for i in range(n)])
        flops = (3 * self.world.dense_flops * epochs * everyone.n_train).tolist()
        if not losses:  # a round that drew nobody (Poisson sampling, under differential privacy)
            losses.append((torch.zeros(0), torch.zeros(0, dtype=torch.int64)))
        return SimRound(self._deployed, torch.cat([a for a, _ in losses]), torch.cat([b for _, b in losses]), up,
                        down, sum(up) + sum(down), sum(up), flops, [1.0] * n)

    def deployed(self) -> Stack:
        if self._deployed is not None:
            return self._deployed
        return self.central.deployed_view(with_base(self.clients, self.base, self.central.split))

    def shared(self) -> dict[str, Tensor] | None:
        return dict(self.base) if self.base else None


@register_algorithm("local")
class Local(Central):
    """Every block personal: clients train alone (nothing is sent)."""

    linear_base = True
    keeps = "all"
    private = False  # nothing is shared


@register_algorithm("fedavg")
class FedAvg(Central):
    """One global model: nothing personal."""

    on_devices = True
    keeps = "none"


@register_algorithm("fedavg-ft")
class FedAvgFT(FedAvg):
    """FedAvg, each client deploying the global model fine-tuned on its own data (simulator only); when:
    ``FinetuneOptions.ft_every`` (every round by default; the reference's: ``ft_every = 0``, the last round)."""

    Options = FinetuneOptions
    on_devices = False
    deploys_finetuned = True


@register_algorithm("fedper")
class FedPer(Central):
    """The base (blocks below K_P) averaged by the server, the K_P personal blocks kept on the client."""

    on_devices = True
    linear_base = True


@register_algorithm("fedper-ft")
class FedPerFT(FedPer):
    """FedPer whose clients adapt their personal blocks to each new base for ``ft_epochs``."""

    finetunes_personal = True
