import numpy as np
import pytest
import torch

from pfl_edge.algorithms.dispfl import DisPFLSimulation
from pfl_edge.algorithms.simulation import hamming_matrix
from pfl_edge.data import partition
from pfl_edge.seeding import numpy_rng
from pfl_edge.sim import Runner, SimConfig, build_context, simulate
from pfl_edge.topology import neighbours

QUICK = dict(dataset="synthetic", partition="iid", clients=6, rounds=2, samples_per_client=64, local_epochs=1,
             batch_size=16, lr=0.05, topology="random:2", workers=1)


def test_dispfl_keeps_masks_and_density_through_rounds() -> None:
    cfg = SimConfig.from_dict({**QUICK, "algorithm": "dispfl", "densities": (0.2, 0.5, 1.0)})
    ctx, _ = build_context(cfg)
    algo = Runner(ctx)
    sim = algo.sim
    assert isinstance(sim, DisPFLSimulation)
    nnz0 = {k: m.flatten(1).sum(1) for k, m in sim.state.masks.items()}
    masks0 = {k: m.clone() for k, m in sim.state.masks.items()}
    for t in (1, 2):
        before = {k: m.clone() for k, m in sim.state.masks.items()}
        payloads = [sim._payload(i) for i in range(6)]
        st = algo.run_round(t, torch.arange(6))
        trained = algo.deployed()
        for k, m in sim.state.masks.items():
            assert torch.equal(m.flatten(1).sum(1), nnz0[k]), k  # per-tensor nnz preserved
            # masked SGD (momentum, weight decay) kept every weight outside the round's mask at zero ...
            assert torch.all(trained[k][before[k] == 0] == 0), k
            # ... and trained the ones inside it
            assert torch.count_nonzero(trained[k][before[k] == 1]) > 0.9 * before[k].sum(), k
        # what was evaluated is the trained model, kept as trained with the mask it was trained under;
        # prune-and-regrow changed only the mask of the next round
        assert all(torch.equal(trained[k], sim.state.weights[k]) for k in trained)
        assert all(torch.equal(before[k], sim.state.support[k]) for k in before)
        assert any(not torch.equal(before[k], sim.state.masks[k]) for k in before)
        acc, _ = ctx.trainer.evaluate(trained, torch.arange(6))
        assert acc.tolist() == pytest.approx(st.client_acc)
        # one transfer per recipient: client i downloads exactly its neighbours' payloads
        nb = neighbours("random:2", 6, t, cfg.seed)
        assert st.client_bytes_down == [sum(payloads[j] for j in nb[i]) for i in range(6)]
        assert st.client_bytes_up == [payloads[j] * sum(j in n for n in nb) for j in range(6)]
        totals = [u + d for u, d in zip(st.client_bytes_up, st.client_bytes_down, strict=True)]
        assert st.busiest_node_bytes == max(totals)
        assert st.busiest_node_received == max(st.client_bytes_down)
        assert st.client_density[2] == 1.0 and st.client_density[0] == pytest.approx(0.2, abs=1e-3)
    # the density-1.0 client never changes its (all-ones) mask; sparse clients do
    assert all(torch.equal(m[2], masks0[k][2]) for k, m in sim.state.masks.items())
    assert any(not torch.equal(m[0], masks0[k][0]) for k, m in sim.state.masks.items())
    ctx.trainer.close()


def test_dispfl_sends_fewer_bytes_and_flops_than_dpsgd() -> None:
    d = simulate(SimConfig.from_dict({**QUICK, "algorithm": "dispfl", "density": 0.5}), progress=False)
    p = simulate(SimConfig.from_dict({**QUICK, "algorithm": "dpsgd"}), progress=False)
    rd, rp = d["rounds"][-1], p["rounds"][-1]
    assert 0.45 < rd["busiest_node_bytes"] / rp["busiest_node_bytes"] < 0.65  # values + a cheap mask code
    assert rd["flops"] < 0.75 * rp["flops"]
    assert all(0.49 < x < 0.51 for x in rd["client_density"])
    # every client receives exactly its two neighbours' payloads: sum of downloads equals sum of uploads
    assert rd["bytes_up"] == rd["bytes_down"]
    assert "mask" in rd and "mask_analysis" in d
    assert len(d["mask_analysis"]["hamming"]) == 6


def test_dpsgd_on_a_full_graph_with_equal_data_is_fedavg(plain_mean: None) -> None:
    base = {**QUICK, "rounds": 2}
    a = simulate(SimConfig.from_dict({**base, "algorithm": "dpsgd", "topology": "full"}), progress=False)
    b = simulate(SimConfig.from_dict({**base, "algorithm": "fedavg"}), progress=False)
    assert a["rounds"][-1]["client_loss"] == pytest.approx(b["rounds"][-1]["client_loss"], abs=1e-4)


@pytest.mark.parametrize("alg", ["dispfl", "dpsgd", "dpsgd-ft"])
def test_decentral_algorithms_learn(alg: str) -> None:
    # sparse models start slowly on this noisy task (masked initial weights carry less signal)
    r = simulate(SimConfig.from_dict({**QUICK, "algorithm": alg, "rounds": 6, "samples_per_client": 120}),
                 progress=False)
    assert r["final"]["mean_acc"] > 0.3 and r["final"]["mean_acc"] > r["rounds"][0]["mean_acc"]


def test_random_regrowth_runs() -> None:
    r = simulate(SimConfig.from_dict({**QUICK, "algorithm": "dispfl", "options": {"regrow": "random"}}), progress=False)
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
