import pytest
import torch

from pfl_edge.data import get_dataset, partition
from pfl_edge.models import get_model
from pfl_edge.parallel import Trainer, balanced_runs
from pfl_edge.seeding import generator, numpy_rng
from pfl_edge.sim import SimConfig, simulate
from pfl_edge.train import ClientTensors, TrainConfig, evaluate, stack_states, train


def test_balance_covers_every_client_once_and_evens_the_load() -> None:
    sizes = [100, 10, 60, 50, 40, 5]
    shards = balanced_runs(sizes, 2)
    assert [i for a, b in shards for i in range(a, b)] == list(range(6))  # runs, in order, each row once
    assert [sum(sizes[a:b]) for a, b in shards] == [110, 155]  # by hand: 265 / 2 = 132.5, nearest prefix 110
    assert balanced_runs([3], 4) == [(0, 1)]
    assert balanced_runs([1] * 5, 3) == [(0, 2), (2, 3), (3, 5)]  # 5/3 -> prefix 2, 10/3 -> 3
    assert balanced_runs([100, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]  # every run keeps a row


def test_sharded_training_and_evaluation_equal_in_process() -> None:
    ds = get_dataset("synthetic")
    p = partition("pathological:2", ds.train_y, ds.test_y, 5, 10, numpy_rng(0, "p"), samples_per_client=60)
    tr = ClientTensors.build(ds.train_x, [c.train_idx for c in p.clients], [c.train_y for c in p.clients])
    te = ClientTensors.build(ds.test_x, [c.test_idx for c in p.clients], [c.test_y for c in p.clients])
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = stack_states([model.state_dict()] * 5)
    rows = torch.tensor([4, 0, 2])  # a subset, out of order
    cfg = TrainConfig(epochs=1, batch_size=16, lr=0.05)
    masks = {"head.weight": (torch.rand(3, 10, 64) < 0.5).float()}
    ref = train(model, {k: v[:3] for k, v in start.items()}, tr, rows, cfg,
                [generator(0, "x", int(i)) for i in rows], masks=masks, engine="loop")
    with Trainer(model, tr, te, workers=2) as trainer:
        got = trainer.train({k: v[:3] for k, v in start.items()}, rows, cfg,
                            [generator(0, "x", int(i)) for i in rows], masks=masks)
        acc, loss = trainer.evaluate(got.stack, rows)
    for k in ref.stack:
        assert torch.allclose(got.stack[k], ref.stack[k], atol=1e-5), k
    assert torch.equal(got.steps, ref.steps)
    ref_acc, ref_loss = evaluate(model, got.stack, te, rows)
    assert torch.allclose(acc, ref_acc) and torch.allclose(loss, ref_loss, atol=1e-6)


@pytest.mark.parametrize("alg", ["fedper", "fedavg-ft"])
def test_simulation_does_not_depend_on_workers(alg: str) -> None:
    base = dict(algorithm=alg, dataset="synthetic", partition="iid", clients=3, rounds=2, samples_per_client=60,
                local_epochs=1)
    a = simulate(SimConfig(**base, workers=1), progress=False)
    b = simulate(SimConfig(**base, workers=2), progress=False)
    for x, y in zip(a["rounds"], b["rounds"], strict=True):
        assert x["client_loss"] == pytest.approx(y["client_loss"], abs=1e-4)
