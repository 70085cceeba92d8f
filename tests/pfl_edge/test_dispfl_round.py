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
