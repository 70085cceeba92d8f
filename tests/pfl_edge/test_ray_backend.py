"""The simulator's Ray backend (``pfl_edge.sim.ray_backend``) on a two-node Ray cluster started on this machine:
the fork backend's numbers and checkpoints bit for bit, with actors on both nodes; without Ray, the flag says
what to install."""

import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pfl_edge.checkpoint import load_checkpoint
from pfl_edge.cli import main
from pfl_edge.data import get_dataset, partition
from pfl_edge.errors import ConfigError
from pfl_edge.models import get_model
from pfl_edge.seeding import generator, numpy_rng
from pfl_edge.sim import RayTrainer, SimConfig, simulate
from pfl_edge.train import ClientTensors, TrainConfig, dense_gradients, evaluate, stack_states, train

# clients of 100, 100, 79, 100 and 100 training samples (class-wise Dirichlet, capped): unequal sizes, so padded
# rows and short last batches are exercised
QUICK: dict[str, Any] = dict(dataset="synthetic", partition="dirichlet:0.1", clients=5, rounds=2,
                             samples_per_client=100, test_per_client=50, local_epochs=1, lr=0.05, batch_size=32,
                             workers=2)
CASES = {"fedper": {}, "dispfl": {"densities": (0.3, 0.6, 1.0)}}  # dispfl: masks and the gradient regrowth


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """A head and a second node, one CPU each, so that two actors must run on two nodes."""
    with pytest.MonkeyPatch.context() as mp:
        # Ray turns a loopback address into the machine's outward one; this setting (Ray's single-machine mode
        # for macOS and Windows) keeps the nodes, their workers and the driver's connection on 127.0.0.1. The
        # nodes' processes read it from the environment; this one read it when it first imported ray, so the
        # constant is set too.
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # its own folder for sessions, logs, sockets and the current cluster's address, not /tmp/ray (another Ray
        # on this machine keeps its own); short, as a socket's path has a length limit
        temp = tempfile.mkdtemp(prefix="pflray-")
        mp.setenv("RAY_TMPDIR", temp)
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
        c = Cluster()
        try:
            c.add_node(**node, include_dashboard=False)  # the head
            c.add_node(**node)
            yield c
        finally:
            c.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Both runs on one thread per process: the driver (which aggregates), each forked worker, each actor. A
    thread count can change a convolution's summation order, so it is held equal rather than left to the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("alg", sorted(CASES))
def test_ray_equals_fork_bit_for_bit(cluster: Any, one_thread: None, tmp_path: Path, alg: str) -> None:
    cfg = SimConfig(**QUICK, **CASES[alg], algorithm=alg)
    fork = simulate(cfg, save_dir=tmp_path / "fork", progress=False)
    ray = simulate(cfg, save_dir=tmp_path / "ray", progress=False, backend="ray", ray_address=cluster.address)
    assert fork["meta"]["backend"] == "fork" and ray["meta"]["backend"] == "ray"
    assert ray["meta"]["workers"] == 2 and ray["meta"]["ray_nodes"] == 2  # one actor on each node
    assert ray["config"] == fork["config"]
    # every number of every round (accuracies, losses, bytes, masks), compared as floats: equal, not close
    for a, b in zip(fork["rounds"], ray["rounds"], strict=True):
        assert {**a, "wall_s": 0} == {**b, "wall_s": 0}
    assert ray["final"] == fork["final"]
    assert ray.get("mask_analysis") == fork.get("mask_analysis")
    files = sorted(p.name for p in (tmp_path / "fork").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "ray").iterdir()) and len(files) >= 5
    for name in files:
        fa, _, ea = load_checkpoint(tmp_path / "fork" / name)
        fb, _, eb = load_checkpoint(tmp_path / "ray" / name)
        assert ea == eb and fa.keys() == fb.keys()
        for k in fa:
            assert torch.equal(fa[k], fb[k]), (name, k)


def test_rows_in_any_order_come_back_in_that_order(cluster: Any, one_thread: None) -> None:
    """A subset of the clients, out of order and over both actors: each result row is the in-process one."""
    import ray as ray_

    ds = get_dataset("synthetic")
    p = partition("pathological:2", ds.train_y, ds.test_y, 5, 10, numpy_rng(0, "p"), samples_per_client=40)
    tr = ClientTensors.build(ds.train_x, [c.train_idx for c in p.clients], [c.train_y for c in p.clients])
    te = ClientTensors.build(ds.test_x, [c.test_idx for c in p.clients], [c.test_y for c in p.clients])
    model = get_model("cnn", num_classes=10, in_channels=1)
    start = stack_states([model.state_dict()] * 3)
    rows = torch.tensor([4, 0, 2])
    cfg = TrainConfig(epochs=1, batch_size=16, lr=0.05)
    masks = {"head.weight": (torch.rand(3, 10, 64) < 0.5).float()}

    def gens() -> list[torch.Generator]:
        return [generator(0, "x", int(i)) for i in rows]

    ref = train(model, start, tr, rows, cfg, gens(), masks=masks, engine="loop")
    with RayTrainer(model, tr, te, workers=2, address=cluster.address) as trainer:
        assert trainer.bounds == [(0, 2), (2, 5)] and len(set(trainer.node_ids())) == 2
        got = trainer.train(start, rows, cfg, gens(), masks=masks)
        acc, loss = trainer.evaluate(got.stack, rows)
        grads = trainer.dense_gradients(got.stack, rows, 8, gens())
    assert not ray_.is_initialized()  # it joined the cluster, and left it
    for k in ref.stack:
        assert torch.equal(got.stack[k], ref.stack[k]), k
    for a, b in ((got.loss, ref.loss), (got.steps, ref.steps), (got.samples, ref.samples)):
        assert torch.equal(a, b)
    ref_acc, ref_loss = evaluate(model, ref.stack, te, rows)
    assert torch.equal(acc, ref_acc) and torch.equal(loss, ref_loss)
    ref_grads = dense_gradients(model, ref.stack, tr, rows, 8, gens())
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_without_ray_the_flag_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray: ImportError
    hint = "pip install 'pfl-edge[ray]'"
    with pytest.raises(ConfigError, match=re.escape(hint)):
        simulate(SimConfig(**QUICK, algorithm="fedper"), progress=False, backend="ray")
    rc = main(["simulate", "--backend", "ray", "--dataset", "synthetic", "--clients", "2", "--rounds", "1",
               "--out", str(tmp_path / "r.json"), "--no-progress"])
    assert rc == 2 and hint in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_unknown_backend_lists_the_valid_ones() -> None:
    cfg = SimConfig(**QUICK, algorithm="fedper")
    with pytest.raises(ConfigError, match="unknown backend 'dask'; valid backends: fork, ray"):
        simulate(cfg, progress=False, backend="dask")
    with pytest.raises(ConfigError, match="needs the ray backend"):
        simulate(cfg, progress=False, ray_address="127.0.0.1:6379")
