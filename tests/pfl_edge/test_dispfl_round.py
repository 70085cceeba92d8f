"""DisPFL's round bookkeeping (docs/algorithms.md): a neighbour's weights are counted with the mask they were trained
under, the receiving client's new mask is applied only after averaging, and a regrown coordinate starts from its
neighbours' average; zeros never enter an average."""

from __future__ import annotations

import torch

from pfl_edge.algorithms import dispfl
from pfl_edge.sparse import prune_regrow
from pfl_edge.topology import mixing_matrix
from pfl_edge.train import stack_states


def test_hand_example_two_clients() -> None:
    # A trained [1, .1, 0, 0] on [1, 1, 0, 0]: prunes coordinate 1 (smallest |w|), regrows coordinate 2.
    # B trained [2, 0, 3, 0] on [1, 0, 1, 0]: prunes coordinate 0, regrows coordinate 0 (largest gradient).
    wa, sa = torch.tensor([1.0, 0.1, 0.0, 0.0]), torch.tensor([1.0, 1.0, 0.0, 0.0])
    wb, sb = torch.tensor([2.0, 0.0, 3.0, 0.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    ma = prune_regrow({"w": wa}, {"w": sa}, 0.5, grads={"w": torch.tensor([0.0, 0.0, 5.0, 1.0])})["w"]
    mb = prune_regrow({"w": wb}, {"w": sb}, 0.5, grads={"w": torch.tensor([9.0, 1.0, 0.0, 2.0])})["w"]
    assert ma.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert mb.tolist() == [1.0, 0.0, 1.0, 0.0]
    start = dispfl.start_models(stack_states([{"w": wa}, {"w": wb}]), stack_states([{"w": sa}, {"w": sb}]),
                                torch.ones(2, 2), stack_states([{"w": ma}, {"w": mb}]))
    expected = torch.tensor([1.5, 0.0, 3.0, 0.0])
    torch.testing.assert_close(start["w"][0], expected, rtol=0, atol=0)
    torch.testing.assert_close(start["w"][1], expected, rtol=0, atol=0)


def test_prune_regrow_leaves_the_trained_weights_alone() -> None:
    w = torch.tensor([1.0, 0.1, 0.0, 0.0])
    before = w.clone()
    m = prune_regrow({"w": w}, {"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}, 0.5,
                     grads={"w": torch.tensor([0.0, 0.0, 5.0, 1.0])})
    assert set(m) == {"w"}  # masks only: the weights stay as trained, with the support they were trained under
    assert torch.equal(w, before)


def test_consensus_is_kept_through_prune_and_regrow() -> None:
    """C clients hold the same trained tensor w* on different masks; each prunes and regrows at alpha 0.5; one
    aggregation: the start equals w* on every coordinate of the new mask that some neighbour's training mask
    covers (and 0 where none does). The old bookkeeping (regrown weights counted as zeros) gave about half."""
    c, n = 8, 400
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(n, generator=g) + 3.0  # away from zero, so any zero counted in would show
    support = (torch.rand(c, n, generator=g) < 0.5).float()
    weights = w_star * support
    masks = torch.stack([prune_regrow({"w": weights[i]}, {"w": support[i]}, 0.5,
                                      gen=torch.Generator().manual_seed(i))["w"] for i in range(c)])
    assert not torch.equal(masks, support)  # the masks really moved
    nbrs = [[(i + 1) % c, (i + 3) % c] for i in range(c)]
    mixing = mixing_matrix(nbrs)
    start = dispfl.start_models({"w": weights}, {"w": support}, mixing, {"w": masks})["w"]
    covered = (mixing @ support) > 0  # some model of the neighbourhood was trained on the coordinate
    keep = covered & (masks > 0)
    assert keep.sum() > 0.3 * c * n
    torch.testing.assert_close(start[keep], w_star.expand(c, n)[keep])
    assert torch.all(start[~keep] == 0)
    regrown = keep & (support == 0)  # new to the client's mask, and taken from its neighbours' average
    assert regrown.any()
    torch.testing.assert_close(start[regrown], w_star.expand(c, n)[regrown])


class _Spy:
    """A trainer that records the start it is given and trains nothing (returns it), with zero gradients for the
    regrowth: what ``round_step`` hands to training is all this test looks at."""

    workers, engine = 1, "loop"

    def __init__(self) -> None:
        self.starts: list[dict[str, torch.Tensor]] = []

    def train(self, stack, rows, cfg, gens, *, trainable=None, masks=None, anchor=None):  # type: ignore[no-untyped-def]
        from pfl_edge.sgd import TrainResult

        self.starts.append({k: v.clone() for k, v in stack.items()})
        n = len(rows)
        return TrainResult({k: v.clone() for k, v in stack.items()}, torch.zeros(n), torch.ones(n, dtype=torch.int64),
                           torch.ones(n, dtype=torch.int64))

    def evaluate(self, stack, rows):  # type: ignore[no-untyped-def]
        return torch.zeros(len(rows)), torch.zeros(len(rows))

    def dense_gradients(self, stack, rows, batch_size, gens):  # type: ignore[no-untyped-def]
        return {k: torch.zeros_like(v) for k, v in stack.items()}


def test_round_step_trains_from_the_support_weighted_neighbourhood_average() -> None:
    """Through ``round_step``'s wiring (where the averaging bug lived): the start client i trains from is, per
    coordinate, sum_j w_j s_j / sum_j s_j over its neighbourhood (0 where no s_j covers it), then times its
    current mask m_i, computed here in float64 with plain loops. The supports s (the masks the weights were trained
    under) differ from the current masks m (moved by the last prune-and-regrow), so averaging over m, or over
    every neighbour, or masking with s, each fails."""
    from pfl_edge.algorithms.base import Clients
    from pfl_edge.federation import FederationConfig
    from pfl_edge.models import get_model

    cfg = FederationConfig(algorithm="dispfl", dataset="synthetic", clients=5, rounds=3, density=0.5)
    model = get_model("cnn", num_classes=10, in_channels=1)
    spy = _Spy()
    cl = Clients(cfg, model, spy, torch.arange(5), torch.full((5,), 48))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    masked = ["conv2.0.weight", "fc1.1.weight", "head.weight"]
    support = {k: (torch.rand(5, *shapes[k], generator=g) < 0.5).float() for k in masked}
    masks = {k: (torch.rand(5, *shapes[k], generator=g) < 0.5).float() for k in masked}
    weights = {k: (torch.randn(5, *s, generator=g) + 2.0) * support[k] if k in support
               else torch.randn(5, *s, generator=g) for k, s in shapes.items()}
    nbrs = [[1, 2], [0], [3, 4], [2], [0, 1, 3]]  # each client's in-neighbours (itself added by the mixing)
    mixing = mixing_matrix(nbrs)
    state = dispfl.SparseClients(weights, support, masks)
    new, _, _, dropped = dispfl.round_step(cl, state, mixing, 1)
    assert dropped == [[]] * 5  # honest models of one scale: nobody is left out
    start = spy.starts[0]
    for i in range(5):
        hood = [j for j in range(5) if mixing[i, j] > 0]
        assert sorted(hood) == sorted({i, *nbrs[i]})
        for k in shapes:
            w64 = [weights[k][j].double() for j in hood]
            if k in support:
                s64 = [support[k][j].double() for j in hood]
                num = sum(w * s for w, s in zip(w64, s64, strict=True))
                den = sum(s64)
                want = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0) * masks[k][i].double()
            else:
                want = sum(w64) / len(hood)
            torch.testing.assert_close(start[k][i].double(), want, rtol=1e-6, atol=1e-6, msg=f"client {i} {k}")
    # what it keeps: the trained weights, on the support they were trained under (the masks it started the round
    # with), and the masks prune-and-regrow gave
    for k in masked:
        assert torch.equal(new.support[k], masks[k]) and torch.equal(new.weights[k], start[k])


def test_the_screen_leaves_out_non_finite_and_oversized_neighbours_only() -> None:
    """``screen``: each row keeps its own column and every neighbour that is finite with a norm at most ``bound``
    times its own; a neighbour of +-20 everywhere (norm ~400x an honest one here), one of 1e30 and one with a NaN
    are left out; an honest one of another scale within the bound stays; bound 0 keeps every finite neighbour (the
    1e30 one too: finite). numpy stacks (a device without torch) give the same."""
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(6, 200, generator=g) * 0.05
    honest[2] *= 3.0  # another honest scale (a denser model): within the bound
    honest[3] = 20.0 * torch.sign(torch.randn(200, generator=g))
    honest[4] = 1e30
    honest[5, 7] = float("nan")
    mixing = torch.ones(6, 6)
    for stack, mix in (({"w": honest}, mixing), ({"w": honest.numpy()}, mixing.numpy())):
        screened, dropped = dispfl.screen(stack, mix, list(range(6)), 10.0)
        assert dropped[0] == dropped[1] == dropped[2] == [3, 4, 5]
        assert dropped[3] == [4, 5]  # its own stays (the bound protects a client from others, not from itself)
        assert [float(x) for x in screened[0]] == [1, 1, 1, 0, 0, 0] and float(screened[3, 3]) == 1
        _, unbounded = dispfl.screen(stack, mix, list(range(6)), 0)
        assert unbounded[0] == [5]
    same, none = dispfl.screen({"w": honest[:3]}, torch.ones(3, 3), [0, 1, 2], 10.0)
    assert none == [[], [], []] and same is not None


def test_the_servers_bound_is_the_neighbour_bound_times_the_median_of_three_or_more() -> None:
    """``DisPFL.upload_norm_bound``, hand-worked: fewer than 3 finite others, no bound (the devices' screens
    alone); else ``neighbour_bound`` times the median (low: one of the norms, never a mean pulled by an outlier),
    non-finite norms ignored; ``neighbour_bound`` 0 turns it off."""
    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.models import get_model
    from pfl_edge.sim import SimConfig

    model = get_model("cnn", num_classes=10, in_channels=1)

    def bound(others: list[float], nb: float = 10.0) -> float | None:
        cfg = SimConfig(algorithm="dispfl", dataset="synthetic", clients=4, options={"neighbour_bound": nb})
        return get_algorithm(cfg, model).upload_norm_bound(others)

    assert bound([]) is None and bound([1.0, 2.0]) is None and bound([1.0, 2.0, float("inf")]) is None
    assert bound([3.0, 1.0, 2.0]) == 20.0
    assert bound([1e30, 1.0, 2.0, 3.0]) == 20.0  # median_low of four: the second smallest, not the outlier's pull
    assert bound([1.0, 1e30, 1e30]) == 1e31  # a majority of outliers is past any median: the screens still apply
    assert bound([3.0, 1.0, 2.0], nb=4.0) == 8.0 and bound([3.0, 1.0, 2.0], nb=0) is None


def test_a_hostile_neighbour_cannot_stop_a_devices_round() -> None:
    """A device's DisPFL round with a neighbour of +-20 (and one of 1e30): it averages without them, trains, and
    reports whom it left out, its model finite; with no bound the +-20 neighbour's start diverges, which is
    DivergedError (the agent sits the round out), never a crash in the mask update."""
    import pytest

    from edge_runtime.data import load_local_data
    from edge_runtime.trainer import DeviceTrainer, device_clients
    from edge_runtime.training import TorchBackend
    from pfl_edge.algorithms import Neighbour, Received, get_algorithm
    from pfl_edge.errors import DivergedError
    from pfl_edge.federation import init_state
    from pfl_edge.sim import SimConfig

    results = []
    for bound in (10.0, 0.0):
        cfg = SimConfig(algorithm="dispfl", dataset="synthetic", partition="pathological:2", clients=3, rounds=2,
                        samples_per_client=48, test_per_client=16, local_epochs=1, batch_size=16, lr=0.05,
                        density=0.5, seed=1, options={"neighbour_bound": bound, "topology": "full"})
        data = load_local_data(cfg, 0)
        dev = device_clients(cfg, DeviceTrainer(data, TorchBackend(data.model)), 0)
        algo = get_algorithm(cfg, data.model, 0)
        state = algo.device_init(dev, init_state(cfg, data.spec), 0.5)
        mine = algo.device_upload(state)
        hostile = {k: torch.where(v != 0, 20.0 * torch.sign(torch.randn_like(v)), v) for k, v in mine.tensors.items()}
        huge = {k: torch.where(v != 0, torch.full_like(v, 1e30), v) for k, v in mine.tensors.items()}
        received = Received(neighbours=[Neighbour(1, hostile, mine.masks), Neighbour(2, huge, mine.masks)])
        try:
            out = algo.device_round(dev, state, received, 1)
        except DivergedError as e:
            results.append(("diverged", str(e)))
            continue
        results.append(("ok", out.dropped))
        assert all(bool(v.isfinite().all()) for v in out.state.values())
    assert results[0] == ("ok", (1, 2))
    assert results[1][0] == "diverged" or results[1] == ("ok", (2,)), results[1]
    with pytest.raises(Exception, match="neighbour_bound"):
        SimConfig(algorithm="dispfl", dataset="synthetic", clients=3, options={"neighbour_bound": 0.5}).check()
