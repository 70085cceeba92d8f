"""DisPFL (Dai et al., ICML 2022; docs/algorithms.md): personal sparse masks, no central aggregation.

A client keeps three things: ``weights``, exactly as its last training left them (zero off ``support``);
``support``, the mask they were trained under (it travels with them: a neighbour counts each weight with the
support it came with); and ``masks``, its current mask after prune-and-regrow (its own, never sent). A round,
for client i, from the round's snapshot:

1. start = (sum_j w_j) / (sum_j s_j) coordinate-wise over i and its in-neighbours j, then ``⊙ m_i``: zeros never
   enter an average, and a regrown coordinate starts from its neighbours' average;
2. train with masked SGD under m_i (the mask re-applied after every step);
3. evaluate the trained model (what the client deploys this round);
4. prune ``ceil(alpha_t · nnz)`` weights per tensor and regrow as many: the new mask for the next round; the
   trained weights and m_i become (weights, support).

A neighbour's model enters step 1 only if it is finite and its L2 norm is at most ``neighbour_bound`` times the
client's own (``DisPFLOptions``; ``screen``): one hostile or broken neighbour (values of +-20, 1e30, NaN) is left
out of that client's average for the round, instead of pushing its training to NaN. Honest DisPFL models of one
federation share an initialisation and a learning rate, so their norms stay within a small factor of each other
(density changes a norm by at most its square root): the default bound, 10, never drops an honest neighbour in the
runs of BENCHMARKS.md, so the simulator's results are unchanged by it. Training that still ends in NaN/Inf raises
``DivergedError`` before the mask update (which cannot rank NaN scores).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..arrays import Array as Tensor
from ..arrays import Stack, as_bool, as_float, copy, ones, ones_like, stack_states, to_numpy, unstack
from ..config_bounds import Range, check_fields, meta
from ..errors import DivergedError
from ..neighbourhood import neighbourhood_average
from ..seeding import Stream
from ..sgd import TrainResult
from ..sparse import density_of, erk_densities, init_masks, mask_ones, prune_rate, prune_regrow
from .algorithm import Decentralised, DeviceRound, register_algorithm
from .base import Clients, Metrics, Received, Upload, one_row
from .options import DecentralOptions
from .simulation import SimRound, Simulation, World, hamming_matrix, label_cosine, mask_summary, traffic

if TYPE_CHECKING:
    from ..federation import FederationConfig

__all__ = [
    "DisPFL",
    "DisPFLOptions",
    "DisPFLSimulation",
    "SparseClients",
    "init_clients",
    "screen",
    "sent_masks",
    "start_models",
    "update_masks",
]

_SUPPORT = "support:"  # prefixes of a device's state dict: its weights, their support, its current mask
_MASK = "mask:"


@dataclass(frozen=True, eq=False)
class SparseClients:
    """Clients' DisPFL state, stacked by row."""

    weights: Stack
    support: Stack
    masks: Stack

    def row(self, i: int) -> SparseClients:
        return SparseClients(*(one_row(unstack(s, i)) for s in (self.weights, self.support, self.masks)))


def init_clients(cl: Clients, init: Mapping[str, Tensor], densities: Sequence[float]) -> SparseClients:
    """Each client's mask at its own density (ERK; drawn from its slot's stream) and its sparse initial model,
    which counts as trained under that mask."""
    shapes = cl.shapes
    by_density: dict[float, dict[str, float]] = {}
    masks = []
    for slot, d in zip(cl.slots.tolist(), densities, strict=True):
        dens = by_density.setdefault(d, erk_densities(shapes, d))
        masks.append(init_masks(shapes, dens, cl.stream(Stream.MASK, slot)))
    m = stack_states(masks)
    w = {k: v * m[k] if k in m else v for k, v in stack_states([dict(init)] * len(cl)).items()}
    return SparseClients(w, m, {k: copy(v) for k, v in m.items()})


def start_models(weights: Stack, support: Stack, mixing: Tensor, masks: Stack) -> Stack:
    """Row i of ``mixing`` picks the models that client i averages (itself included): per coordinate the sum
    of their weights over the number of supports covering it (0 where none does), then ``⊙`` its mask ``masks``
    row i. ``weights``/``support`` have one row per column of ``mixing``, ``masks`` one per row."""
    avg = neighbourhood_average(weights, mixing, support)
    return {k: v * masks[k] if k in masks else v for k, v in avg.items()}


def train_round(cl: Clients, start: Stack, masks: Stack, t: int) -> TrainResult:
    return cl.trainer.train(start, cl.slots, cl.cfg.train_config(t), cl.gens(Stream.TRAIN, t), masks=masks)


def update_masks(cl: Clients, trained: Stack, masks: Stack, t: int) -> Stack:
    """Prune-and-regrow after round ``t`` (1-based; alpha at t - 1, so the first update prunes at alpha0 and the
    last is not a no-op, as the reference counts rounds from 0). Tensors a client's density leaves dense keep
    their all-ones mask."""
    cfg, opts = cl.cfg, DisPFL.options_for(cl.cfg)
    alpha = prune_rate(opts.alpha0, t - 1, cfg.rounds)
    grads = (cl.trainer.dense_gradients(trained, cl.slots, cfg.batch_size, cl.gens(Stream.REGROW, t))
             if opts.regrow == "gradient" else None)
    out = {k: copy(m) for k, m in masks.items()}
    for i, slot in enumerate(cl.slots.tolist()):
        mine = {k: m[i] for k, m in masks.items() if not bool(m[i].all())}
        new = prune_regrow({k: trained[k][i] for k in mine}, mine, alpha,
                           grads=None if grads is None else {k: grads[k][i] for k in mine},
                           gen=cl.stream(Stream.REGROW_RANDOM, t, slot) if grads is None else None)
        for k, m in new.items():
            out[k][i] = m
    return out


def sent_masks(support: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The masks that travel with a client's weights: its support, for the tensors it holds sparse (a tensor its
    density leaves dense goes without one)."""
    return {k: as_bool(m) for k, m in support.items() if not bool(m.all())}


@dataclass(frozen=True)
class DisPFLOptions(DecentralOptions):
    """The mask schedule (``alpha0``, ``regrow``), ``DecentralOptions``'s ``topology`` and the neighbours' screen
    (``neighbour_bound``); each key's meaning: its field's ``doc``. A non-finite neighbour is always left out.
    Before these were options, ``alpha0``, ``regrow`` and ``topology`` were flat keys of the federation config; a
    config that has them there is read as if they were here (``FederationConfig.from_dict``)."""

    alpha0: float = field(default=0.5, metadata=meta(
        "the first mask update's prune rate, cosine-annealed over the rounds (the paper's 0.5)", Range(0, 1)))
    regrow: Literal["gradient", "random"] = field(default="gradient", metadata=meta(
        "how pruned weights regrow: the largest dense-gradient magnitudes (the paper's) or at random (the "
        "released scripts')"))
    neighbour_bound: float = field(default=10.0, metadata=meta(
        "a neighbour is left out of a client's average for the round where its model's L2 norm exceeds this many "
        "times the client's own (0: no bound)", Range(1, 1e6, off=True)))

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self)


def _norms(weights: Stack) -> list[float]:
    """Each row's L2 norm over every tensor, summed in float64 (a row at a time: no float64 copy of the whole
    stack, which a simulator of many clients would pay every round); inf for a row holding NaN or Inf."""
    first = next(iter(weights.values()))
    sq = np.zeros(int(first.shape[0]), np.float64)
    for v in weights.values():
        a = to_numpy(v).reshape(int(v.shape[0]), -1)
        with np.errstate(over="ignore", invalid="ignore"):
            for i in range(a.shape[0]):
                row = a[i].astype(np.float64)
                sq[i] += float(np.dot(row, row))
    return [math.sqrt(x) if math.isfinite(x) else math.inf for x in sq.tolist()]


def _finite_rows(weights: Stack) -> list[bool]:
    """Whether each row holds only finite values (what the mask update needs), without any norm."""
    first = next(iter(weights.values()))
    ok = np.ones(int(first.shape[0]), bool)
    for v in weights.values():
        ok &= np.isfinite(to_numpy(v).reshape(int(v.shape[0]), -1)).all(axis=1)
    return ok.tolist()


def screen(weights: Stack, mixing: Tensor, own: Sequence[int], bound: float) -> tuple[Tensor, list[list[int]]]:
    """``mixing`` without the neighbours each client leaves out this round (``DisPFLOptions``): row i keeps column
    ``own[i]`` (its own model) and every column j whose model is finite with a norm at most ``bound`` times its
    own's. Returns the screened mixing and, per row, the columns left out (usually none: then ``mixing`` itself)."""
    norms = _norms(weights)
    m = to_numpy(mixing)
    dropped: list[list[int]] = []
    for i in range(m.shape[0]):
        limit = bound * norms[own[i]] if bound > 0 else math.inf
        dropped.append([j for j in np.flatnonzero(m[i]).tolist()
                        if j != own[i] and not (math.isfinite(norms[j]) and norms[j] <= limit)])
    if not any(dropped):
        return mixing, dropped
    out = copy(mixing)
    for i, cols in enumerate(dropped):
        for j in cols:
            out[i, j] = 0
    return out, dropped


def round_step(cl: Clients, state: SparseClients, mixing: Tensor, t: int, received: SparseClients | None = None,
               own: Sequence[int] | None = None) -> tuple[SparseClients, TrainResult, Stack, list[list[int]]]:
    """One DisPFL round for the clients of ``cl``: returns their new state, the training result, the model each
    deploys (the trained one) and, per client, the columns of ``mixing`` it left out (``screen``). ``received``:
    the models that ``mixing``'s columns refer to (default: the clients' own, every client's neighbours being
    among them, as in the simulator); ``own``: the column of each client's own model (default: its row)."""
    pool = state if received is None else received
    opts: DisPFLOptions = DisPFL.options_for(cl.cfg)
    mixing, dropped = screen(pool.weights, mixing, list(range(len(cl))) if own is None else own,
                             opts.neighbour_bound)
    start = start_models(pool.weights, pool.support, mixing, state.masks)
    res = train_round(cl, start, state.masks, t)
    bad = [i for i, ok in enumerate(_finite_rows(res.stack)) if not ok]
    if bad:  # the mask update cannot rank NaN scores, and nothing of this round is usable
        raise DivergedError(f"DisPFL round {t}: training diverged (NaN/Inf) for slot(s) "
                            f"{[int(cl.slots[i]) for i in bad]}; lower the learning rate, or see who it averaged")
    new_masks = update_masks(cl, res.stack, state.masks, t)
    return SparseClients(res.stack, state.masks, new_masks), res, res.stack, dropped


@register_algorithm("dispfl")
class DisPFL(Decentralised):
    Options = DisPFLOptions
    on_devices = True
    sparse_masks = True
    clips_unmasked = True  # as the reference does: the whole gradient is clipped, then masked
    sends_initial_model = True
    program_mode = "dispfl"

    @classmethod
    def mask_schedule(cls, cfg: FederationConfig) -> dict[str, Any] | None:
        opts = cls.options_for(cfg)
        return {"alpha0": opts.alpha0, "rounds": cfg.rounds, "regrow": opts.regrow}

    def simulation(self, world: World) -> Simulation:
        return DisPFLSimulation(self, world)

    # ------------------------------------------------------------------------------------------ device
    def device_init(self, dev: Clients, init: Mapping[str, Tensor], density: float) -> dict[str, Tensor]:
        return pack(init_clients(dev, init, [density]))

    def device_upload(self, state: Mapping[str, Tensor]) -> Upload:
        """Its weights as last trained, on the mask they were trained under (the support travels, as in the
        paper); tensors its density leaves dense go without a mask."""
        st = unpack(state)
        return Upload(unstack(st.weights, 0), sent_masks(unstack(st.support, 0)))

    def describe_upload(self, kp: int, density: float) -> str:
        return f"its sparse model (density {density:g})"

    def upload_norm_bound(self, others: Sequence[float]) -> float | None:
        """``neighbour_bound`` times the median (low) of the norms of the round's other uploads the server holds,
        once there are ``MIN_UPDATES`` of them: the server refuses a model every honest neighbour's screen would
        leave out (the screen bounds relative to its own norm, which honest models share within a small factor);
        fewer than that, the devices' screens alone apply."""
        from ..aggregate import MIN_UPDATES  # the server's side: it has torch

        bound = self.options.neighbour_bound
        finite = [n for n in others if math.isfinite(n)]
        if bound == 0 or len(finite) < MIN_UPDATES:
            return None
        return bound * statistics.median_low(finite)

    def mask_ones(self, density: float) -> dict[str, int] | None:
        """``int(density_l * numel)`` per parameter tensor, as ``init_masks`` draws them (ERK), which
        prune-and-regrow keeps."""
        shapes = {k: tuple(v.shape) for k, v in self.model.named_parameters()}
        return mask_ones(shapes, erk_densities(shapes, density))

    def device_round(self, dev: Clients, state: Mapping[str, Tensor], received: Received, t: int, *,
                     prev: int = 0, late: bool = False, final: bool = False) -> DeviceRound:
        """Average its own model with its neighbours' (in slot order, through the simulator's own
        ``neighbourhood_average``, so the device computes the very same numbers), train, evaluate, prune and
        regrow; send the trained weights on the mask they were trained under."""
        own = unpack(state)
        me = int(dev.slots[0])
        rows = sorted([(me, unstack(own.weights, 0), unstack(own.support, 0))]
                      + [(n.slot, dict(n.tensors), _support(n.tensors, n.masks, own.support))
                         for n in received.neighbours if n.slot != me], key=lambda r: r[0])
        pool = SparseClients(stack_states([r[1] for r in rows]), stack_states([r[2] for r in rows]), {})
        like = next(iter(pool.weights.values()))
        mine = [next(c for c, r in enumerate(rows) if r[0] == me)]
        new, res, trained, dropped = round_step(dev, own, ones((1, len(rows)), like), t, received=pool, own=mine)
        acc, loss = dev.trainer.evaluate(trained, dev.slots)
        state_out = pack(new)
        return DeviceRound(state_out, self.device_upload(state_out),
                           [Metrics(t, float(acc[0]), float(loss[0]))], deployed=unstack(new.weights, 0),
                           train_loss=float(res.loss[0]), steps=int(res.steps[0]),
                           dropped=tuple(rows[c][0] for c in dropped[0]))


def _support(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor],
             keys: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A received model's support for each masked tensor (``keys``): its mask, or all ones for one sent dense."""
    return {k: as_float(masks[k], tensors[k]) if k in masks else ones_like(tensors[k]) for k in keys}


def pack(st: SparseClients) -> dict[str, Tensor]:
    """One device's state (row 0) as one flat dict, as it is stored."""
    out = dict(unstack(st.weights, 0))
    out.update({_SUPPORT + k: v for k, v in unstack(st.support, 0).items()})
    out.update({_MASK + k: v for k, v in unstack(st.masks, 0).items()})
    return out


def unpack(state: Mapping[str, Tensor]) -> SparseClients:
    w = {k: v for k, v in state.items() if not k.startswith((_SUPPORT, _MASK))}
    s = {k.removeprefix(_SUPPORT): v for k, v in state.items() if k.startswith(_SUPPORT)}
    m = {k.removeprefix(_MASK): v for k, v in state.items() if k.startswith(_MASK)}
    return SparseClients(one_row(w), one_row(s), one_row(m))


class DisPFLSimulation(Simulation):
    """Every client's DisPFL round at once (``round_step`` over every row): each round's graph as a sparse
    mixing matrix, one ``neighbourhood_average`` for all clients. Bytes: each client's sparse model (weights and
    mask, as the codec sends them) once per out-neighbour; FLOPs: 3 sparse forwards per sample per epoch under
    the mask it trains with, and the gradient regrowth's one dense batch."""

    def __init__(self, algo: DisPFL, world: World) -> None:
        from ..flops import layer_sizes

        super().__init__(algo, world)
        cl, cfg = world.clients, algo.cfg
        self.state = init_clients(cl, world.init, [cfg.client_density(i) for i in range(len(cl))])
        self.sizes = layer_sizes(algo.model, world.input_shape)
        self._deployed: Stack | None = None

    def _payload(self, i: int) -> int:
        from ..accounting import payload_bytes

        return payload_bytes(unstack(self.state.weights, i), sent_masks(unstack(self.state.support, i)))

    def round(self, t: int, participants: Tensor) -> SimRound:
        from ..flops import forward_flops
        from ..topology import mixing_matrix

        w, cfg, cl = self.world, self.algo.cfg, self.world.clients
        nbrs = self.algo.neighbours(t) or []
        up, down, busiest, received = traffic([self._payload(i) for i in range(len(cl))], nbrs)
        masks = self.state.masks  # what each client trains under this round
        summary = mask_summary(masks, w.label_counts)
        self.state, res, trained, _ = round_step(cl, self.state, mixing_matrix(nbrs), t)
        flops = [cfg.local_epochs * int(cl.n_train[i]) * 3
                 * forward_flops(self.algo.model, w.input_shape, {k: m[i] for k, m in masks.items()}, self.sizes)
                 for i in range(len(cl))]
        if self.algo.options.regrow == "gradient":  # the dense-gradient screen: one batch, 3 dense forwards per sample
            flops = [f + min(cfg.batch_size, int(n)) * 3 * w.dense_flops for f, n in zip(flops, cl.n_train,
                                                                                        strict=True)]
        self._deployed = trained  # a client deploys its trained sparse model, as the reference evaluates it
        return SimRound(trained, res.loss, cl.n_train, up, down, busiest, received, flops,
                        [density_of(unstack(masks, i), {k: m.shape[1:] for k, m in masks.items()})
                         for i in range(len(cl))], {"mask": summary})

    def deployed(self) -> Stack:
        return self._deployed if self._deployed is not None else self.state.weights

    def analysis(self) -> dict[str, object]:
        """Pairwise mask Hamming distances beside the cosine similarity of label distributions."""
        return {"hamming": hamming_matrix(self.state.masks).tolist(),
                "label_cosine": label_cosine(self.world.label_counts.float()).tolist()}
