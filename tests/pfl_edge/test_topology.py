import pytest
import torch

from pfl_edge.aggregate import masked_average, neighbourhood_average
from pfl_edge.errors import ConfigError
from pfl_edge.flops import forward_flops
from pfl_edge.models import get_model
from pfl_edge.topology import mixing_matrix, neighbours


def test_random_topology_k_distinct_others_and_seeded_per_round() -> None:
    nb = neighbours("random:3", 10, 1, 0)
    assert all(len(js) == 3 and i not in js and len(set(js)) == 3 for i, js in enumerate(nb))
    assert nb == neighbours("random:3", 10, 1, 0)
    assert nb != neighbours("random:3", 10, 2, 0)


def test_ring_and_full() -> None:
    assert neighbours("ring", 5, 1, 0) == [[1, 4], [0, 2], [1, 3], [2, 4], [0, 3]]
    assert neighbours("full", 3, 1, 0) == [[1, 2], [0, 2], [0, 1]]
    a = mixing_matrix(neighbours("ring", 4, 1, 0))
    assert torch.equal(a.diag(), torch.ones(4)) and a.sum() == 12


@pytest.mark.parametrize("spec", ["random:0", "random:10", "random", "star", "ring:2"])
def test_bad_topologies(spec: str) -> None:
    with pytest.raises(ConfigError):
        neighbours(spec, 10, 1, 0)


def test_masked_average_hand_worked() -> None:
    w1, m1 = {"x": torch.tensor([2.0, 4.0, 0.0, 0.0])}, {"x": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    w2, m2 = {"x": torch.tensor([0.0, 8.0, 6.0, 0.0])}, {"x": torch.tensor([0.0, 1.0, 1.0, 0.0])}
    out = masked_average([w1, w2], [m1, m2])
    assert torch.equal(out["x"], torch.tensor([2.0, 6.0, 6.0, 0.0]))


def test_neighbourhood_average_matches_per_client_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    n = 6
    masks = {"w": (torch.rand(n, 3, 4, generator=g) < 0.5).float()}
    stack = {"w": torch.randn(n, 3, 4, generator=g) * masks["w"], "b": torch.randn(n, 2, generator=g)}
    nb = neighbours("random:2", n, 3, 0)
    out = neighbourhood_average(stack, mixing_matrix(nb), masks)
    for i in range(n):
        group = [i, *nb[i]]
        # float64 reference written out coordinate by coordinate
        for idx in range(12):
            vals = [float(stack["w"][j].flatten()[idx]) for j in group if masks["w"][j].flatten()[idx] > 0]
            ref = sum(vals) / len(vals) if vals else 0.0
            assert float(out["w"][i].flatten()[idx]) == pytest.approx(ref, abs=1e-6)
        ref_b = masked_average([{"b": stack["b"][j]} for j in group], [{} for _ in group])["b"]
        assert torch.allclose(out["b"][i], ref_b, atol=1e-6)


def test_flops_hand_computed_for_the_cnn_and_masks() -> None:
    model = get_model("cnn", num_classes=10, in_channels=1)
    # conv1 5x5 1->32 stride 2: 14x14 outputs; conv2 32->64: 7x7; fc1 3136->128; fc2 128->64; head 64->10
    dense = ((2 * 800 + 32) * 196 + (2 * 51200 + 64) * 49 + 2 * 401408 + 128 + 2 * 8192 + 64 + 2 * 640 + 10)
    assert forward_flops(model, (1, 28, 28)) == dense
    half = torch.zeros(128, 3136)
    half[:64] = 1
    assert forward_flops(model, (1, 28, 28), {"fc1.1.weight": half}) == dense - 2 * 64 * 3136


def test_flops_add_c_out_only_for_convolutions_with_a_bias() -> None:
    """The DisPFL reference's count: (2 nnz(W) + C_out) H_out W_out for a convolution with a bias, 2 nnz(W) H_out
    W_out without one (resnet18-gn's convolutions have none; the cnn's do)."""
    model = get_model("resnet18-gn", num_classes=10, in_channels=3, image_size=32)
    assert "stem.0.bias" not in model.state_dict()
    masks = {k: torch.zeros_like(v) for k, v in model.named_parameters() if v.dim() > 1}
    # with every weight masked off, only the head's bias remains
    assert forward_flops(model, (3, 32, 32), masks) == 10
    cnn = get_model("cnn", num_classes=10, in_channels=1, image_size=28)
    convs = [(m, hw) for m, hw in _conv_positions(cnn, (1, 1, 28, 28))]
    assert convs and all(m.bias is not None for m, _ in convs)
    masks = {k: torch.zeros_like(v) for k, v in cnn.named_parameters() if v.dim() > 1}
    linear_bias = sum(m.out_features for m in cnn.modules() if isinstance(m, torch.nn.Linear))
    assert forward_flops(cnn, (1, 28, 28), masks) == sum(m.out_channels * hw for m, hw in convs) + linear_bias


def _conv_positions(model: torch.nn.Module,
                    shape: tuple[int, ...] = (1, 3, 32, 32)) -> list[tuple[torch.nn.Conv2d, int]]:
    out = []
    hooks = [m.register_forward_hook(lambda m, i, o: out.append((m, o.shape[2] * o.shape[3])))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    model(torch.zeros(*shape))
    for h in hooks:
        h.remove()
    return out


@pytest.mark.parametrize("n,k", [(2, 1), (5, 2), (10, 9), (31, 10), (100, 10), (257, 1)])
def test_random_graph_is_torchs_randperm_draw_without_torch(n: int, k: int) -> None:
    """The graph a device without torch reads (numpy's MT) is the one torch.randperm draws from the round's
    seeded generator, client after client on one generator: the reference is torch itself."""
    from pfl_edge.seeding import generator

    for t in (1, 7):
        gen = generator(11, "topology", t)
        want = []
        for i in range(n):
            others = torch.randperm(n - 1, generator=gen)[:k].tolist()
            want.append(sorted(j + (j >= i) for j in others))
        assert neighbours(f"random:{k}", n, t, 11) == want


@pytest.mark.parametrize("n,k", [(0, 0), (1, 1), (2, 2), (9, 0), (9, 4), (9, 9), (40, 13)])
def test_randperm_head_is_the_permutations_prefix_and_moves_the_generator_alike(n: int, k: int) -> None:
    from pfl_edge.seeding import MT

    a, b = MT(5), MT(5)
    for _ in range(3):  # call after call: the generator must sit where the whole permutation leaves it
        head = a.randperm_head(n, k)
        assert head.tolist() == b.randperm(n)[:k].tolist()
    assert a.rand(4).tolist() == b.rand(4).tolist()
