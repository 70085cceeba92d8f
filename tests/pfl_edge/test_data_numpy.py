"""A device without PyTorch loads its partition as numpy arrays: the same samples, in the same order, with the
same float32 bits as the torch path (pfl_edge.data.client_arrays against pfl_edge.federation.deal)."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pfl_edge.data import (
    client_arrays,
    get_arrays,
    get_dataset,
    list_partitioners,
    partition,
    partition_arrays,
)
from pfl_edge.data.sources import FASHION_MNIST_DIRS, load_idx, normalise
from pfl_edge.federation import FederationConfig, deal
from pfl_edge.seeding import Stream, numpy_rng

FMNIST_MEAN, FMNIST_STD = [0.2860], [0.3530]
CIFAR_MEAN, CIFAR_STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]


def _torch_normalise(images: np.ndarray, mean: list[float], std: list[float]) -> torch.Tensor:
    """What sources.py computed with torch before the numpy form existed: the reference the arrays are held to."""
    x = torch.from_numpy(np.array(images, copy=True)).to(torch.float32).div_(255.0)
    return (x - torch.tensor(mean).view(1, -1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1)


def _bits_equal(a: np.ndarray, b: np.ndarray | torch.Tensor) -> bool:
    b = b.numpy() if isinstance(b, torch.Tensor) else b
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(np.uint32) if a.dtype == np.float32 else a, b.view(np.uint32) if b.dtype == np.float32 else b)


@pytest.mark.parametrize(("mean", "std"), [(FMNIST_MEAN, FMNIST_STD), (CIFAR_MEAN, CIFAR_STD)])
def test_normalise_is_torchs_bit_for_bit_for_every_pixel_value(mean: list[float], std: list[float]) -> None:
    c = len(mean)
    every = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(1, 1, 16, 16), (3, c, 16, 16))
    got = normalise(every, mean, std)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert _bits_equal(got, _torch_normalise(every, mean, std))
    # the order of operations matters: multiplying by 1/255 instead gives other bits for some values
    recip = (every.astype(np.float32) * np.float32(1 / 255) - np.float32(mean[0])) / np.float32(std[0])
    assert not _bits_equal(recip[:, :1], got[:, :1])


def test_partition_arrays_is_partitions_deal() -> None:
    rng = np.random.default_rng(7)
    ytr, yte = rng.integers(0, 10, 6000), rng.integers(0, 10, 2000)
    specs = {"iid": "iid", "pathological": "pathological:2", "pathological-random": "pathological-random:2",
             "dirichlet": "dirichlet:0.3",
             "dirichlet-client": "dirichlet-client:0.3", "groups": "groups:3", "preference": "preference"}
    assert set(specs) == set(list_partitioners())  # a new partitioner: add it here
    for spec in specs.values():
        a = partition_arrays(spec, ytr, yte, 12, 10, numpy_rng(1, "p"), samples_per_client=400)
        t = partition(spec, torch.from_numpy(ytr), torch.from_numpy(yte), 12, 10, numpy_rng(1, "p"),
                      samples_per_client=400)
        assert (a.num_classes, a.label_maps) == (t.num_classes, t.label_maps)
        for ca, ct in zip(a.clients, t.clients, strict=True):
            for x, y in zip((ca.train_idx, ca.train_y, ca.test_idx, ca.test_y),
                            (ct.train_idx, ct.train_y, ct.test_idx, ct.test_y), strict=True):
                assert x.dtype == np.int64 and _bits_equal(x, y), spec


def test_synthetic_arrays_are_its_tensors() -> None:
    a, ds = get_arrays("synthetic"), get_dataset("synthetic")
    for k in ("train_x", "train_y", "test_x", "test_y"):
        assert np.shares_memory(getattr(a, k), getattr(ds, k).numpy())
    assert (a.num_classes, a.in_channels, a.image_size) == (ds.num_classes, ds.in_channels, ds.image_size)


def test_the_data_package_imports_and_makes_the_synthetic_set_without_torch() -> None:
    """The synthetic data set is made from the documented Mersenne Twister alone (issue 50): a device without
    torch makes the same bits the simulator trains on."""
    code = ("import sys, hashlib; sys.modules['torch'] = None\n"
            "import pfl_edge.data, pfl_edge.data.folder\n"
            "d = pfl_edge.data.get_arrays('synthetic')\n"
            "print(hashlib.sha256(d.train_x.tobytes() + d.test_x.tobytes()).hexdigest())\n"
            "assert sys.modules['torch'] is None and not [m for m in sys.modules if m.startswith('torch.')]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ds = get_dataset("synthetic")  # the simulator's tensors, made where torch is
    want = hashlib.sha256(ds.train_x.numpy().tobytes() + ds.test_x.numpy().tobytes()).hexdigest()
    assert out.stdout.strip() == want


@pytest.mark.needs_fmnist
def test_fashion_mnist_arrays_are_the_tensors_and_torchs_normalisation() -> None:
    a, ds = get_arrays("fashion-mnist"), get_dataset("fashion-mnist")
    for k in ("train_x", "train_y", "test_x", "test_y"):
        assert np.shares_memory(getattr(a, k), getattr(ds, k).numpy())  # one memory: the same bits
    d = FASHION_MNIST_DIRS[0]
    for prefix, x, y in (("train", a.train_x, a.train_y), ("t10k", a.test_x, a.test_y)):
        imgs = load_idx(d / f"{prefix}-images-idx3-ubyte.gz")[:, None]
        assert _bits_equal(x, _torch_normalise(imgs, FMNIST_MEAN, FMNIST_STD))
        assert _bits_equal(y, load_idx(d / f"{prefix}-labels-idx1-ubyte.gz").astype(np.int64))


@pytest.mark.needs_fmnist
@pytest.mark.parametrize(("split", "samples"), [("pathological:2", None), ("dirichlet-client:0.3", None),
                                                ("preference", 500), ("dirichlet:0.5", 300)])
def test_a_clients_arrays_are_the_torch_paths(split: str, samples: int | None) -> None:
    cfg = FederationConfig(algorithm="fedper", dataset="fashion-mnist", partition=split, clients=20, kp=1,
                           samples_per_client=samples, seed=3)
    ds, part, spec = deal(cfg)
    for i in (0, 7, 19):
        got = client_arrays(cfg.dataset, cfg.partition, cfg.clients, i, numpy_rng(cfg.seed, Stream.PARTITION.value),
                            samples_per_client=cfg.samples_per_client, test_per_client=cfg.test_per_client)
        c = part.clients[i]
        assert _bits_equal(got.train_x, ds.train_x[c.train_idx]) and _bits_equal(got.train_y, c.train_y)
        assert _bits_equal(got.test_x, ds.test_x[c.test_idx]) and _bits_equal(got.test_y, c.test_y)
        assert got.n_train > 0 and got.n_test > 0
        assert (got.num_classes, got.in_channels, got.image_size) == (spec.num_classes, spec.in_channels,
                                                                      spec.image_size)
        assert got.label_map == (None if part.label_maps is None else part.label_maps[i])


@pytest.mark.needs_fmnist
def test_a_device_without_torch_loads_the_same_partition() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import hashlib, json\n"
            "import numpy as np\n"
            "from pfl_edge.data import client_arrays\n"
            "c = client_arrays('fashion-mnist', 'dirichlet-client:0.3', 10, 4, np.random.default_rng(11))\n"
            "assert sys.modules['torch'] is None and not [m for m in sys.modules if m.startswith('torch.')]\n"
            "print(json.dumps({k: [str(v.dtype), list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()]\n"
            "                  for k, v in vars(c).items() if isinstance(v, np.ndarray)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    ds = get_dataset("fashion-mnist")
    c = partition("dirichlet-client:0.3", ds.train_y, ds.test_y, 10, 10, np.random.default_rng(11)).clients[4]
    want = {k: [str(t.numpy().dtype), list(t.shape), hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()]
            for k, t in (("train_x", ds.train_x[c.train_idx]), ("train_y", c.train_y),
                         ("test_x", ds.test_x[c.test_idx]), ("test_y", c.test_y))}
    assert json.loads(out.stdout) == want


def test_the_synthetic_set_is_the_one_the_javascript_device_is_held_to() -> None:
    """pfl_edge/data/synthetic.py against the digests devices/js/test/fixtures/synthetic.json pins (the TypeScript
    device's test checks its own copy against the same file): a change to the set is a change of the contract."""
    import hashlib

    from pfl_edge.data.synthetic import make_synthetic, prototypes
    from pfl_edge.seeding import MT

    fixture = json.loads((Path(__file__).resolve().parents[2] / "devices/js/test/fixtures/synthetic.json").read_text())
    train_x, train_y, test_x, test_y = make_synthetic()
    sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()  # noqa: E731
    assert sha(prototypes(MT(fixture["seed"])).astype("<f8")) == fixture["prototypes"]["sha256"]
    for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        assert sha(x.astype("<f4")) == fixture[split]["x_sha256"], split
        assert sha(y.astype("<i4")) == fixture[split]["y_sha256"], split
    # the labels alone, as a coordinator deals from them (the inputs' draws skipped), are the same labels
    from pfl_edge.data import get_labels
    from pfl_edge.data.synthetic import make_synthetic_labels

    only = make_synthetic_labels()
    assert np.array_equal(only[0], train_y) and np.array_equal(only[1], test_y)
    lab = get_labels("synthetic")
    assert np.array_equal(lab.train_y.numpy(), train_y) and np.array_equal(lab.test_y.numpy(), test_y)
