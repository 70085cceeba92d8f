import numpy as np
import pytest
import torch

from pfl_edge.data import partition
from pfl_edge.seeding import numpy_rng
from pfl_edge.sim import SimConfig, build_context, simulate
from pfl_edge.sim.decentral import DisPFL, hamming_matrix

QUICK = dict(dataset="synthetic", partition="iid", clients=6, rounds=2, samples_per_client=64, local_epochs=1,
             batch_size=16, lr=0.05, topology="random:2", workers=1)


def test_dispfl_keeps_masks_and_density_through_rounds() -> None:
    cfg = SimConfig(**{**QUICK, "algorithm": "dispfl", "densities": (0.2, 0.5, 1.0)})
    ctx, _ = build_context(cfg)
    algo = DisPFL(ctx)
    nnz0 = {k: m.flatten(1).sum(1) for k, m in algo.masks.items()}
    masks0 = {k: m.clone() for k, m in algo.masks.items()}
    for t in (1, 2):
        st = algo.run_round(t, torch.arange(6))
        for k, m in algo.masks.items():
            assert torch.equal(m.flatten(1).sum(1), nnz0[k]), k  # per-tensor nnz preserved
            assert torch.all(algo.weights[k][m == 0] == 0), k  # pruned weights are zero
        assert st.client_density[2] == 1.0 and st.client_density[0] == pytest.approx(0.2, abs=1e-3)
    # the density-1.0 client never changes its (all-ones) mask; sparse clients do
    assert all(torch.equal(m[2], masks0[k][2]) for k, m in algo.masks.items())
    assert any(not torch.equal(m[0], masks0[k][0]) for k, m in algo.masks.items())
    ctx.trainer.close()


def test_dispfl_sends_fewer_bytes_and_flops_than_dpsgd() -> None:
    d = simulate(SimConfig(**{**QUICK, "algorithm": "dispfl", "density": 0.5}), progress=False)
    p = simulate(SimConfig(**{**QUICK, "algorithm": "dpsgd"}), progress=False)
    rd, rp = d["rounds"][-1], p["rounds"][-1]
    assert 0.45 < rd["busiest_node_bytes"] / rp["busiest_node_bytes"] < 0.65  # values + a cheap mask code
    assert rd["flops"] < 0.75 * rp["flops"]
    assert all(0.49 < x < 0.51 for x in rd["client_density"])
    # every client receives exactly its two neighbours' payloads: sum of downloads equals sum of uploads
    assert rd["bytes_up"] == rd["bytes_down"]
    assert "mask" in rd and "mask_analysis" in d
    assert len(d["mask_analysis"]["hamming"]) == 6


def test_dpsgd_on_a_full_graph_with_equal_data_is_fedavg() -> None:
    base = {**QUICK, "rounds": 2}
    a = simulate(SimConfig(**{**base, "algorithm": "dpsgd", "topology": "full"}), progress=False)
    b = simulate(SimConfig(**{**base, "algorithm": "fedavg"}), progress=False)
    assert a["rounds"][-1]["client_loss"] == pytest.approx(b["rounds"][-1]["client_loss"], abs=1e-4)


@pytest.mark.parametrize("alg", ["dispfl", "dpsgd", "dpsgd-ft"])
def test_decentral_algorithms_learn(alg: str) -> None:
    # sparse models start slowly on this noisy task (masked initial weights carry less signal)
    r = simulate(SimConfig(**{**QUICK, "algorithm": alg, "rounds": 6, "samples_per_client": 120}), progress=False)
    assert r["final"]["mean_acc"] > 0.3 and r["final"]["mean_acc"] > r["rounds"][0]["mean_acc"]


def test_random_regrowth_runs() -> None:
    r = simulate(SimConfig(**{**QUICK, "algorithm": "dispfl", "regrow": "random"}), progress=False)
    assert len(r["rounds"]) == 2


def test_groups_partition_and_hamming() -> None:
    y = torch.from_numpy(np.random.default_rng(0).integers(0, 10, 4000)).long()
    p = partition("groups:4", y, y[:1000], 20, 10, numpy_rng(0, "p"))
    classes = [frozenset(torch.unique(c.train_y).tolist()) for c in p.clients]
    for i in range(20):
        for j in range(20):
            assert (classes[i] == classes[j]) == (i % 4 == j % 4)
    m = {"w": torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])}
    assert torch.allclose(hamming_matrix(m), torch.tensor([[0, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0]]))
