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
    new, _, _ = dispfl.round_step(cl, state, mixing, 1)
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
