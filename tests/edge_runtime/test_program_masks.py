"""What a DisPFL device that trains through a training program (``OnnxBackend``: the ONNX training program in ONNX
Runtime) shares with the simulator, and what may differ, on real data (Fashion-MNIST): docs/model.md, "What a
device on a program shares with the simulator".

A program computes the simulator's gradients in another float summation order, so its weights differ from eager
PyTorch's by rounding; DisPFL's mask update (``pfl_edge.sparse.prune_regrow``) is discontinuous, so rounding can
flip a prune or regrow choice whose score sits within rounding of the cut (issue 30). The test runs three copies
of the same federation of in-process devices (``Algorithm.device_round``, as ``test_device_round.py`` does) side
by side, round by round:

- T: every device on ``TorchBackend``: the simulator's code path, checked against ``pfl_edge.sim.simulate`` bit
  for bit;
- S ("shadow"): each round, each device's ONNX program fed T's state and T's neighbours: one round of a program
  device from the simulator's inputs, so every difference from T is this round's rounding and its consequences;
- O: every device on the ONNX program, exchanging their own models: a federation of program devices, whose
  differences accumulate over the rounds.

It holds, on every round and device: the same batches and regrowth draw, the same initial masks, the same
number of ones in every mask, the same neighbour graph and step counts (a); weights within a stated bound where
the masks they were trained under agree, and exactly 0 in one run where they do not; and new masks that differ
only where the masks going into the update already differed or where a choice flipped at a near-tie (b). The
near-tie band is derived, not tuned: if the two runs' scores differ by at most ``tol`` on the candidates they share
and ``r`` candidates are not shared, a choice of ``k`` can only flip for a coordinate whose score (the simulator's)
lies between the ``k - r``-th and the ``k + r + 1``-th score, widened by ``2 tol`` (``Flip.band``). The band is
absolute: on this data the flips come at the regrowth cut of ``fc1.1.weight``, late in the run, where the cut
falls among dense gradients of about 1e-12 (numerically zero), far below the gradients' rounding. The check
fails on a flip outside its band (``test_a_flip_far_from_the_cut_is_a_violation``). The mask updates' inputs and
choices are recorded from inside the devices' rounds (``prune_regrow`` and its selections wrapped), not recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

import edge_runtime.program_backends as program_mod
import pfl_edge.algorithms.dispfl as dispfl_mod
import pfl_edge.sparse as sparse_mod
import pfl_edge.train as train_mod
from device_profiles import get_profile
from edge_runtime.data import load_local_data
from edge_runtime.trainer import DeviceTrainer, device_clients
from edge_runtime.training import OnnxBackend, TorchBackend
from export import lower_onnx_training, prepare
from pfl_edge.algorithms import Neighbour, Received, get_algorithm
from pfl_edge.arrays import to_numpy
from pfl_edge.checkpoint import load_checkpoint
from pfl_edge.codec import decode, encode
from pfl_edge.federation import init_state, model_id
from pfl_edge.sim import SimConfig, simulate
from pfl_edge.sparse import prune_regrow

CFG = SimConfig(algorithm="dispfl", dataset="fashion-mnist", partition="pathological:2", clients=3,
                densities=(0.6, 0.8, 0.4), rounds=3, samples_per_client=300, test_per_client=100, local_epochs=1,
                batch_size=32, lr=0.02, workers=1, seed=0)
# one round of the program from the simulator's inputs (S): every weight within TOL_W of eager PyTorch's, every
# regrowth gradient within TOL_G (measured here: 1.2e-7 and 6.7e-7; the program's own check allows far more)
TOL_W = 1e-6
TOL_G = 1e-5
# a federation of program devices (O), after CFG.rounds rounds: weights where the supports agree (measured: 2.7e-6;
# a pre-activation crossing 0 in one run's float32 and not the other's can jump 3e-5, test_training_backends.py)
TOL_RUN = 1e-4
WORLDS = ("T", "S", "O")


# ---------------------------------------------------------------------------------------- the near-tie check
@dataclass(frozen=True)
class MaskUpdate:
    """One ``prune_regrow`` call in a device's round: its inputs (the tensors it updates), the indices it pruned
    and regrew (flat; a tensor it left alone has none) and its output."""

    weights: dict[str, Tensor]
    masks: dict[str, Tensor]
    grads: dict[str, Tensor]
    alpha: float
    pruned: dict[str, Tensor]
    regrown: dict[str, Tensor]
    new: dict[str, Tensor]


def recorded_update(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], alpha: float,
                    grads: Mapping[str, Tensor]) -> MaskUpdate:
    """``prune_regrow(weights, masks, alpha, grads=grads)``, with the choices it makes recorded as it makes them
    (its calls of ``select_smallest`` and ``select_largest``: two per tensor it updates, in key order)."""
    picks: list[Tensor] = []

    def pick(f: Callable[[Tensor, int], Tensor]) -> Callable[[Tensor, int], Tensor]:
        def run(x: Tensor, k: int) -> Tensor:
            out = f(x, k)
            picks.append(out.clone())
            return out
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse_mod, "select_smallest", pick(sparse_mod.select_smallest))
        mp.setattr(sparse_mod, "select_largest", pick(sparse_mod.select_largest))
        new = prune_regrow(weights, masks, alpha, grads=grads)
    pruned, regrown = {}, {}
    for k, m in masks.items():
        nnz, n = int(m.sum()), m.numel()
        if 0 < nnz < n and math.ceil(alpha * nnz) > 0:
            pruned[k], regrown[k] = picks.pop(0), picks.pop(0)
    assert not picks
    return MaskUpdate({k: v.clone() for k, v in weights.items()}, {k: v.clone() for k, v in masks.items()},
                      {k: v.clone() for k, v in grads.items()}, alpha, pruned, regrown,
                      {k: v.clone() for k, v in new.items()})


def _order(scores: Tensor, j: int, *, largest: bool) -> float:
    """The ``j``-th (1-based) of ``scores`` in choice order (largest first, or smallest first); beyond either end,
    the infinity on that side."""
    n = scores.numel()
    if j < 1:
        return math.inf if largest else -math.inf
    if j > n:
        return -math.inf if largest else math.inf
    return float(torch.kthvalue(scores, n - j + 1 if largest else j).values)


@dataclass(frozen=True)
class Flip:
    """A choice two runs made differently, on a coordinate both could choose: pruned in one and kept in the other
    (``step`` "prune", score |w|, the smallest chosen), or regrown in one and not in the other (``regrow``, score
    |g|, the largest chosen). ``score``, ``cut`` (the ``k``-th score), ``inner`` (the ``k - r``-th) and ``outer``
    (the ``k + r + 1``-th) are the reference run's, ``r`` being the candidates the two runs do not share."""

    key: str
    step: str
    index: int
    score: float
    cut: float
    inner: float
    outer: float

    def band(self, tol: float) -> tuple[float, float]:
        """The near-tie band: where a choice can flip when the two runs' scores differ by at most ``tol`` on
        their common candidates. Between ``outer`` and ``inner``, widened by ``2 tol``: a coordinate chosen by
        one run and not the other has a score within ``tol`` of the other run's, and the other run's ``k``-th
        score lies among the reference's ``k - r``-th to ``k + r + 1``-th, within ``tol`` of them."""
        lo, hi = sorted((self.inner, self.outer))
        return lo - 2 * tol, hi + 2 * tol

    def allowed(self, tol: float) -> bool:
        lo, hi = self.band(tol)
        return lo <= self.score <= hi

    @property
    def rel(self) -> float:
        """Distance from the cut, relative to the cut's score."""
        return abs(self.score - self.cut) / self.cut if self.cut else math.inf


@dataclass
class Comparison:
    """Two runs' mask updates of one device and round, tensor by tensor."""

    flips: list[Flip] = field(default_factory=list)
    inherited: int = 0  # coordinates where the masks going into the update already differed
    differ: int = 0  # coordinates where the new masks differ
    eps: float = 0.0  # max |w_ref - w_other| where both masks hold the weight (the prune scores' difference)
    delta: float = 0.0  # max |g_ref - g_other| on both runs' regrowth candidates (the regrow scores')

    def violations(self, tol_w: float, tol_g: float) -> list[str]:
        """What breaks the statement at rounding ``tol_w`` (the weights, prune scores) and ``tol_g`` (the
        gradients, regrow scores): scores differing by more, a flip outside its band."""
        tols = {"prune": tol_w, "regrow": tol_g}
        out = [f"{f.step} flip at {f.key}[{f.index}]: score {f.score:.9g} outside {f.band(tols[f.step])} (cut "
               f"{f.cut:.9g})" for f in self.flips if not f.allowed(tols[f.step])]
        if self.eps > tol_w or self.delta > tol_g:
            out.append(f"scores differ beyond rounding: weights by {self.eps:.3g} (> {tol_w:g}?), gradients by "
                       f"{self.delta:.3g} (> {tol_g:g}?)")
        return out

    def describe(self) -> str:
        flips = ", ".join(f"{f.step} {f.key}[{f.index}] score {f.score:.3g} cut {f.cut:.3g}" for f in self.flips)
        return (f"weights off by {self.eps:.3g}, gradients by {self.delta:.3g}; masks going in differ at "
                f"{self.inherited}, new masks at {self.differ}; {len(self.flips)} flips{': ' if flips else ''}{flips}")


def _choices(u: MaskUpdate, key: str) -> tuple[Tensor, Tensor, Tensor, int]:
    """The mask going in, the pruned and the regrown coordinates (flat, bool) and how many were swapped; checked
    against the update's output and its count."""
    m = u.masks[key].reshape(-1) > 0
    pruned, regrown = torch.zeros_like(m), torch.zeros_like(m)
    k = 0
    if key in u.pruned:
        k = math.ceil(u.alpha * int(m.sum()))
        pruned[u.pruned[key]], regrown[u.regrown[key]] = True, True
        assert len(u.pruned[key]) == len(u.regrown[key]) == k == int(pruned.sum()) == int(regrown.sum())
        assert not bool((pruned & ~m).any()) and not bool((regrown & m & ~pruned).any())
    assert torch.equal((m & ~pruned) | regrown, u.new[key].reshape(-1) > 0), key
    return m, pruned, regrown, k


def compare_updates(ref: MaskUpdate, other: MaskUpdate) -> Comparison:
    """Where ``other``'s new masks differ from ``ref``'s, say why: a coordinate where the masks going in already
    differed, or a flip of a prune or a regrow choice (with ``ref``'s scores around its cut). Every differing
    coordinate is one of these (asserted): the two runs choose the same number from candidates that differ only
    where the masks going in did or where a prune choice flipped."""
    assert ref.masks.keys() == other.masks.keys() and ref.alpha == other.alpha
    out = Comparison()
    for key in ref.masks:
        m_r, p_r, g_r, k = _choices(ref, key)
        m_o, p_o, g_o, k_o = _choices(other, key)
        assert k == k_o and int(m_r.sum()) == int(m_o.sum()), key  # the same number of ones going in
        new_r, new_o = (m_r & ~p_r) | g_r, (m_o & ~p_o) | g_o
        explained = m_r ^ m_o
        out.inherited += int(explained.sum())
        out.differ += int((new_r ^ new_o).sum())
        if k == 0:
            assert torch.equal(new_r ^ new_o, explained), key
            continue
        w_r, w_o = ref.weights[key].reshape(-1), other.weights[key].reshape(-1)
        both = m_r & m_o
        out.eps = max(out.eps, float((w_r - w_o)[both].abs().max()))
        flip_p = both & (p_r ^ p_o)
        if bool(flip_p.any()):
            r = int((m_r & ~m_o).sum())
            mag = w_r[m_r].abs()
            stats = [_order(mag, j, largest=False) for j in (k, k - r, k + r + 1)]
            out.flips += [Flip(key, "prune", c, float(w_r[c].abs()), *stats)
                          for c in torch.nonzero(flip_p).flatten().tolist()]
        c_r, c_o = ~m_r | p_r, ~m_o | p_o
        common = c_r & c_o
        s_r, s_o = ref.grads[key].reshape(-1).abs(), other.grads[key].reshape(-1).abs()
        out.delta = max(out.delta, float((s_r - s_o)[common].abs().max()))
        flip_g = common & (g_r ^ g_o)
        if bool(flip_g.any()):
            r = int((c_r & ~c_o).sum())
            stats = [_order(s_r[c_r], j, largest=True) for j in (k, k - r, k + r + 1)]
            out.flips += [Flip(key, "regrow", c, float(s_r[c]), *stats)
                          for c in torch.nonzero(flip_g).flatten().tolist()]
        assert not bool(((new_r ^ new_o) & ~(explained | flip_p | flip_g)).any()), key  # nothing else differs
    return out


# ------------------------------------------------------------------------------------- recording the rounds
@dataclass
class Record:
    """What one device's round drew and decided, recorded from inside it."""

    batches: list[list[np.ndarray]] = field(default_factory=list)  # each training call's batches
    regrow: list[tuple[int, int, bytes]] = field(default_factory=list)  # (n, batch, generator state) per screen
    updates: list[MaskUpdate] = field(default_factory=list)


class Recorder:
    """Wraps the draws and the mask update that a device's round calls, so that each lands in the active record:
    the batch schedule (``epoch_batches``, which both the simulator's loop and ``ProgramBackend`` call), the
    regrowth screen's generator as it is handed over, and ``prune_regrow`` as ``dispfl.update_masks`` calls it."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.active: Record | None = None
        for mod in (train_mod, program_mod):
            mp.setattr(mod, "epoch_batches", self._batches(mod.epoch_batches))
        mp.setattr(train_mod, "dense_gradients", self._torch_screen(train_mod.dense_gradients))
        mp.setattr(program_mod.ProgramBackend, "dense_gradients",
                   self._program_screen(program_mod.ProgramBackend.dense_gradients))
        mp.setattr(dispfl_mod, "prune_regrow", self._update())

    @contextmanager
    def on(self, rec: Record) -> Iterator[Record]:
        self.active = rec
        try:
            yield rec
        finally:
            self.active = None

    def _rec(self) -> Record:
        assert self.active is not None, "a device round outside a record"
        return self.active

    def _batches(self, f: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def run(*a: Any, **kw: Any) -> list[Any]:
            out = f(*a, **kw)
            self._rec().batches.append([to_numpy(b).copy() for b in out])
            return out
        return run

    def _torch_screen(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(model: Any, stack: Any, data: Any, rows: Tensor, batch_size: int, gens: Any) -> Any:
            self._rec().regrow.append((int(data.n[rows[0]]), batch_size, bytes(gens[0].get_state().numpy())))
            return f(model, stack, data, rows, batch_size, gens)
        return run

    def _program_screen(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(backend: Any, x: Any, y: Any, batch_size: int, gen: Any) -> Any:
            self._rec().regrow.append((len(x), batch_size, bytes(gen.get_state().numpy())))
            return f(backend, x, y, batch_size, gen)
        return run

    def _update(self) -> Callable[..., dict[str, Tensor]]:
        def run(weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], alpha: float, *,
                grads: Mapping[str, Tensor] | None = None, gen: Any = None) -> dict[str, Tensor]:
            assert grads is not None and gen is None  # regrow by gradient (CFG's)
            u = recorded_update(weights, masks, alpha, grads)
            self._rec().updates.append(u)
            return dict(u.new)
        return run


@dataclass
class Run:
    """The three federations' rounds: ``rounds[world][t - 1][slot]`` the device's round output, ``records`` what
    it drew and decided; ``init`` each world's initial states; ``sim`` the simulator's result and final models."""

    rounds: dict[str, list[list[Any]]]
    records: dict[str, list[list[Record]]]
    init: dict[str, list[dict[str, Tensor]]]
    neighbours: list[list[list[int]]]
    sim: dict[str, Any]
    want: list[dict[str, Tensor]]
    ones: list[dict[str, int]]


def _wire(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor], spec: Any, t: int) -> Any:
    return decode(encode(dict(tensors), model_id=model_id(spec), round=t, masks=dict(masks)))


def _federate(cfg: SimConfig, tmp: Path, mp: pytest.MonkeyPatch) -> Run:
    sim = simulate(cfg, save_dir=tmp, progress=False)
    want = [load_checkpoint(tmp / f"client_{i:03d}.safetensors")[0] for i in range(cfg.clients)]
    rec = Recorder(mp)  # from here on, every draw and mask update is a device round's
    data = [load_local_data(cfg, i) for i in range(cfg.clients)]
    spec = data[0].spec
    low = lower_onnx_training(prepare(get_profile("phone-low"), spec=spec, seed=0), mode="dispfl",
                              batch_size=cfg.batch_size)
    algos = [get_algorithm(cfg, d.model, cfg.kp) for d in data]
    devs = {"T": [device_clients(cfg, DeviceTrainer(d, TorchBackend(d.model)), i) for i, d in enumerate(data)],
            "O": [device_clients(cfg, DeviceTrainer(d, OnnxBackend.from_lowered(low)), i)
                  for i, d in enumerate(data)]}
    devs["S"] = devs["O"]
    init = init_state(cfg, spec)
    states = {w: [algos[i].device_init(devs[w][i], init, cfg.client_density(i)) for i in range(cfg.clients)]
              for w in ("T", "O")}
    first = {w: [dict(s) for s in states[w]] for w in ("T", "O")}
    first["S"] = first["T"]

    def upload(i: int, state: Mapping[str, Tensor], t: int) -> Any:
        up = algos[i].device_upload(state)
        return _wire(up.tensors, up.masks, spec, t)

    sent = {w: [upload(i, states[w][i], 0) for i in range(cfg.clients)] for w in ("T", "O")}
    rounds: dict[str, list[list[Any]]] = {w: [] for w in WORLDS}
    records: dict[str, list[list[Record]]] = {w: [] for w in WORLDS}
    graphs = []
    for t in range(1, cfg.rounds + 1):
        nbrs = algos[0].neighbours(t)
        assert nbrs is not None and all(a.neighbours(t) == nbrs for a in algos)
        graphs.append(nbrs)
        for w in WORLDS:
            rounds[w].append([])
            records[w].append([])
        for i in range(cfg.clients):
            for w in ("T", "O", "S"):  # S: the program device fed the simulator's state and neighbours
                src = "T" if w == "S" else w
                got = [Neighbour(j, sent[src][j].tensors, sent[src][j].masks) for j in nbrs[i]]
                if w == "S" and t == 1:  # round 1's inputs are O's, bit for bit: O's round is S's
                    assert all(torch.equal(v, states["O"][i][k]) for k, v in states["T"][i].items())
                    assert all(torch.equal(v, sent["O"][j].tensors[k]) for j in nbrs[i]
                               for k, v in sent["T"][j].tensors.items())
                    rounds[w][-1].append(rounds["O"][-1][i])
                    records[w][-1].append(records["O"][-1][i])
                    continue
                with rec.on(Record()) as r:
                    out = algos[i].device_round(devs[w][i], states[src][i], Received(neighbours=got), t)
                rounds[w][-1].append(out)
                records[w][-1].append(r)
        for w in ("T", "O"):
            states[w] = [o.state for o in rounds[w][-1]]
            sent[w] = [upload(i, o.state, t) for i, o in enumerate(rounds[w][-1])]
    return Run(rounds, records, first, graphs, sim, want, [algos[i].mask_ones(cfg.client_density(i)) or {}
                                                          for i in range(cfg.clients)])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with pytest.MonkeyPatch.context() as mp:
        yield _federate(CFG, tmp_path_factory.mktemp("sim"), mp)


def _masks(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def _weights(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in state.items() if ":" not in k}


def _max_where_agree(a: Mapping[str, Tensor], b: Mapping[str, Tensor], sa: Mapping[str, Tensor],
                     sb: Mapping[str, Tensor]) -> float:
    """max |a - b| over the coordinates where the supports ``sa``/``sb`` (the masks the weights were trained
    under) agree; tensors without a support: everywhere."""
    out = 0.0
    for k in a:
        agree = (sa[k] == sb[k]) if k in sa else torch.ones_like(a[k], dtype=torch.bool)
        if bool(agree.any()):
            out = max(out, float((a[k] - b[k])[agree].abs().max()))
    return out


# ------------------------------------------------------------------------------------------------- the tests
@pytest.mark.slow  # the three federations side by side: 10-40 s for the module
@pytest.mark.needs_fmnist
def test_the_torch_devices_are_the_simulator(run: Run) -> None:
    """T is the reference the program devices are held to: the simulator's run, bit for bit."""
    for t, outs in enumerate(run.rounds["T"], start=1):
        for i, out in enumerate(outs):
            assert out.metrics[0].accuracy == pytest.approx(run.sim["rounds"][t - 1]["client_acc"][i], abs=1e-6)
    for i, out in enumerate(run.rounds["T"][-1]):
        assert out.deployed is not None and out.deployed.keys() == run.want[i].keys()
        for k, v in run.want[i].items():
            assert torch.equal(out.deployed[k], v), k


@pytest.mark.slow  # the three federations side by side: 10-40 s for the module
@pytest.mark.needs_fmnist
def test_what_is_equal(run: Run) -> None:
    """(a): the same draws, the same initial masks, the same number of ones in every mask after every round, the
    same neighbour graph (every device's own), the same steps and metric rounds."""
    assert len(run.neighbours) == CFG.rounds
    for w in ("S", "O"):
        for i in range(CFG.clients):
            for k, v in run.init["T"][i].items():
                assert torch.equal(run.init[w][i][k], v), k  # the initial model and masks (and support)
    for t in range(CFG.rounds):
        for i in range(CFG.clients):
            ref, ref_rec = run.rounds["T"][t][i], run.records["T"][t][i]
            assert len(ref_rec.batches) == 1 and len(ref_rec.regrow) == 1 and len(ref_rec.updates) == 1
            for w in ("S", "O"):
                out, rec = run.rounds[w][t][i], run.records[w][t][i]
                assert len(rec.batches) == 1
                assert all(np.array_equal(a, b) for a, b in zip(rec.batches[0], ref_rec.batches[0], strict=True))
                assert rec.regrow == ref_rec.regrow  # the screen's batch: the same generator, at the same state
                assert out.steps == ref.steps == len(ref_rec.batches[0])
                assert [m.round for m in out.metrics] == [m.round for m in ref.metrics] == [t + 1]
                for world_out in (out, ref):
                    for k, n in run.ones[i].items():
                        for prefix in ("mask:", "support:"):
                            assert int(world_out.state[prefix + k].sum()) == n, (w, t, i, prefix, k)
                assert set(ref_rec.updates[0].masks) == set(rec.updates[0].masks)


@pytest.mark.slow  # the three federations side by side: 10-40 s for the module
@pytest.mark.needs_fmnist
def test_one_round_of_a_program_from_the_simulators_inputs(run: Run) -> None:
    """(b), one round: S against T from the same start, so the masks the weights were trained under are the
    same. Every weight within TOL_W, every regrowth gradient within TOL_G; a new mask differs from the simulator's
    only by flips whose simulator's score lies in its near-tie band at the round's own score differences (within
    ``2 eps`` of the prune cut, ``2 delta`` of the regrow cut); and the mask updates are real."""
    flips: list[Flip] = []
    worst = 0.0
    changed = 0
    for t in range(CFG.rounds):
        for i in range(CFG.clients):
            ref, out = run.rounds["T"][t][i], run.rounds["S"][t][i]
            u_ref, u_out = run.records["T"][t][i].updates[0], run.records["S"][t][i].updates[0]
            sup = _masks(ref.state, "support:")
            assert sup.keys() == _masks(out.state, "support:").keys()
            assert all(torch.equal(v, out.state["support:" + k]) for k, v in sup.items())
            worst = max(worst, _max_where_agree(_weights(ref.state), _weights(out.state), {}, {}))
            cmp = compare_updates(u_ref, u_out)
            assert cmp.inherited == 0
            assert not cmp.violations(TOL_W, TOL_G), cmp.violations(TOL_W, TOL_G)
            assert not cmp.violations(cmp.eps, cmp.delta), cmp.violations(cmp.eps, cmp.delta)
            flips += cmp.flips
            changed += sum(int((u_ref.new[k] != u_ref.masks[k]).sum()) for k in u_ref.masks)
            print(f"S round {t + 1} slot {i}: {cmp.describe()}")
    print(f"S: weights off by at most {worst:.3g}; {len(flips)} flipped choices of {changed} coordinates the "
          "updates moved")
    assert worst <= TOL_W
    assert changed > 1000  # the mask updates moved coordinates: the comparison is not of idle masks


@pytest.mark.slow  # the three federations side by side: 10-40 s for the module
@pytest.mark.needs_fmnist
def test_a_federation_of_program_devices(run: Run) -> None:
    """(b), over the run: O (program devices exchanging their own models) against T. Where the masks the weights
    were trained under agree, weights within TOL_RUN; where they differ, one of the two weights is 0 (the other
    its whole value); a new mask differs from the simulator's only where the masks going in differed or by a flip
    inside its near-tie band at the update's own score differences (which grow once masks differ)."""
    flips = 0
    for t in range(CFG.rounds):
        for i in range(CFG.clients):
            ref, out = run.rounds["T"][t][i], run.rounds["O"][t][i]
            u_ref, u_out = run.records["T"][t][i].updates[0], run.records["O"][t][i].updates[0]
            sup_r, sup_o = _masks(ref.state, "support:"), _masks(out.state, "support:")
            w_r, w_o = _weights(ref.state), _weights(out.state)
            diff = _max_where_agree(w_r, w_o, sup_r, sup_o)
            off = 0
            for k in sup_r:
                apart = sup_r[k] != sup_o[k]
                off += int(apart.sum())
                assert bool(((w_r[k] == 0) | (w_o[k] == 0))[apart].all()), k  # off one mask: exactly 0 there
            cmp = compare_updates(u_ref, u_out)
            assert not cmp.violations(cmp.eps, cmp.delta), cmp.violations(cmp.eps, cmp.delta)
            assert cmp.eps <= TOL_RUN and cmp.delta <= TOL_RUN
            flips += len(cmp.flips)
            print(f"O round {t + 1} slot {i}: supports differ at {off}, weights where they agree off by {diff:.3g}; "
                  f"mask update: {cmp.describe()}")
            assert diff <= TOL_RUN
    for i, out in enumerate(run.rounds["O"][-1]):
        assert out.deployed is not None
        far = max(float((out.deployed[k] - v).abs().max()) for k, v in run.want[i].items())
        print(f"O slot {i}: deployed model off the simulator's by {far:.3g}")
    print(f"O: {flips} flipped choices")


# ------------------------------------------------------------------------------ the check itself, on a toy
def _toy(w: list[float], m: list[int], g: list[float], alpha: float) -> MaskUpdate:
    return recorded_update({"w": torch.tensor(w)}, {"w": torch.tensor(m, dtype=torch.float32)}, alpha,
                           {"w": torch.tensor(g)})


TOY_W = [0.9, 0.3, 0.0, 0.1000001, 0.7, 0.0, 0.1, 0.5, 0.0, 0.2]  # a near-tie at the prune cut: 0.1 vs 0.1000001
TOY_M = [1, 1, 0, 1, 1, 0, 1, 1, 0, 1]
TOY_G = [0.0, 0.0, 0.3, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0]  # the pruned weights' gradients lose to the zeros'
TOY_ALPHA = 0.1  # 7 ones: prune ceil(0.7) = 1, regrow 1
TOY_TOL = 2e-7  # the toy's "rounding": 1e-7 each way, in float32


def test_a_near_tie_flips_and_is_allowed() -> None:
    """Two scores 1e-7 apart at the prune cut, moved 1e-7 in opposite directions (as rounding can): the choice
    flips, and the check classifies the flip as a near-tie."""
    ref = _toy(TOY_W, TOY_M, TOY_G, TOY_ALPHA)  # prunes 0.1 (index 6), regrows index 2
    w = list(TOY_W)
    w[3], w[6] = w[3] - 1e-7, w[6] + 1e-7
    other = _toy(w, TOY_M, TOY_G, TOY_ALPHA)  # prunes index 3 instead
    assert not torch.equal(ref.new["w"], other.new["w"])
    cmp = compare_updates(ref, other)
    assert [(f.step, f.index) for f in cmp.flips] == [("prune", 3), ("prune", 6)] and cmp.differ == 2
    assert all(f.rel < 2e-6 for f in cmp.flips) and not cmp.violations(TOY_TOL, TOY_TOL)


def test_a_flip_far_from_the_cut_is_a_violation() -> None:
    """A weight far from the cut that another run got wrong (0.9 read as 0.05): its prune flips, far outside
    the band at rounding; the check fails it."""
    ref = _toy(TOY_W, TOY_M, TOY_G, TOY_ALPHA)
    w = list(TOY_W)
    w[0] = 0.05
    cmp = compare_updates(ref, _toy(w, TOY_M, TOY_G, TOY_ALPHA))
    assert [(f.index, f.allowed(TOY_TOL)) for f in cmp.flips] == [(0, False), (6, True)]
    assert len(cmp.violations(TOY_TOL, TOY_TOL)) == 2  # the flip, and the weights' difference beyond rounding
