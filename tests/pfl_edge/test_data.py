import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from pfl_edge.data import get_dataset, get_labels, list_datasets, list_partitioners, partition
from pfl_edge.errors import ConfigError, DataError, UnknownNameError
from pfl_edge.federation import FederationConfig, deal, deal_labels
from pfl_edge.seeding import numpy_rng


def _labels(n: int, classes: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, classes, n)).long()


TRAIN, TEST = _labels(6000), _labels(2000, seed=1)


def _all_disjoint(parts: list[torch.Tensor]) -> bool:
    cat = torch.cat(parts)
    return len(cat) == len(torch.unique(cat))


@pytest.mark.parametrize("spec", ["iid", "pathological:2", "pathological:4", "dirichlet:0.3", "preference"])
def test_no_sample_used_twice(spec: str) -> None:
    p = partition(spec, TRAIN, TEST, 20, 10, numpy_rng(0, "p"))
    assert _all_disjoint([c.train_idx for c in p.clients])
    assert _all_disjoint([c.test_idx for c in p.clients])
    assert all(c.n_train > 0 for c in p.clients)


@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_pathological_gives_exactly_k_classes_evenly(k: int) -> None:
    p = partition(f"pathological:{k}", TRAIN, TEST, 10, 10, numpy_rng(3, "p"))
    for c in p.clients:
        assert len(torch.unique(c.train_y)) == k
        assert set(torch.unique(c.test_y).tolist()) <= set(torch.unique(c.train_y).tolist())
    # every class is held by n*k/C clients, and with all clients the whole train split is used
    held = torch.zeros(10)
    for c in p.clients:
        held[torch.unique(c.train_y)] += 1
    assert torch.all(held == k)
    assert sum(c.n_train for c in p.clients) == len(TRAIN)


def test_test_set_follows_train_distribution() -> None:
    p = partition("dirichlet:0.5", TRAIN, TEST, 5, 10, numpy_rng(0, "p"), test_per_client=200)
    for c in p.clients:
        tr = torch.bincount(c.train_y, minlength=10).double()
        te = torch.bincount(c.test_y, minlength=10).double()
        assert te.sum() <= 200
        # within rounding and the cap that keeps test samples unique
        assert torch.allclose(te / te.sum(), tr / tr.sum(), atol=0.03)


def test_test_per_client_default_is_ceil_test_over_clients() -> None:
    p = partition("iid", TRAIN, TEST, 7, 10, numpy_rng(0, "p"))
    sizes = [int(c.test_idx.numel()) for c in p.clients]
    assert max(sizes) <= -(-2000 // 7) and min(sizes) >= 250


def test_dirichlet_is_skewed_and_alpha_matters() -> None:
    def skew(alpha: float) -> float:
        p = partition(f"dirichlet:{alpha}", TRAIN, TEST, 10, 10, numpy_rng(0, "p"))
        return float(np.mean([torch.bincount(c.train_y, minlength=10).max() / c.n_train for c in p.clients]))

    assert skew(0.1) > skew(100.0) + 0.2


def test_samples_per_client_caps_and_keeps_proportions() -> None:
    p = partition("pathological:2", TRAIN, TEST, 10, 10, numpy_rng(0, "p"), samples_per_client=100)
    assert all(c.n_train == 100 for c in p.clients)
    assert all(len(torch.unique(c.train_y)) == 2 for c in p.clients)


def test_preference_maps_are_cyclic_shifts_by_group() -> None:
    p = partition("preference:0", TRAIN, TEST, 10, 10, numpy_rng(0, "p"))
    assert p.num_classes == 5 and p.label_maps is not None
    for i, m in enumerate(p.label_maps):
        assert list(m) == [(c + i % 5) % 5 for c in range(10)]
    # labels are the map applied to the true class
    train_classes = TRAIN[p.clients[3].train_idx]
    mapped = torch.tensor(p.label_maps[3])[train_classes]
    assert torch.equal(mapped, p.clients[3].train_y)
    test_classes = TEST[p.clients[3].test_idx]
    assert torch.equal(torch.tensor(p.label_maps[3])[test_classes], p.clients[3].test_y)


def test_preference_redraws_about_p_of_ratings() -> None:
    p = partition("preference", TRAIN, TEST, 500, 10, numpy_rng(0, "p"), test_per_client=1)
    assert p.label_maps is not None
    changed = sum(m[c] != (c + i % 5) % 5 for i, m in enumerate(p.label_maps) for c in range(10))
    # redrawn with probability 0.1, of which 4/5 land on another rating: 0.08 of 5000
    assert 300 < changed < 500


def test_preference_no_global_model_beats_one_fifth() -> None:
    # the best single map (per class, the most common rating) is right for about 1/5 of users
    p = partition("preference:0", TRAIN, TEST, 10, 10, numpy_rng(0, "p"))
    assert p.label_maps is not None
    maps = np.array(p.label_maps)
    best = np.mean([np.bincount(maps[:, c], minlength=5).max() / len(maps) for c in range(10)])
    assert best == pytest.approx(0.2)


@pytest.mark.parametrize("spec", ["pathological:0", "pathological:11", "pathological:x", "dirichlet:-1",
                                  "dirichlet:abc", "iid:3", "preference:2"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(ConfigError):
        partition(spec, TRAIN, TEST, 10, 10, numpy_rng(0, "p"))


def test_unknown_partitioner_lists_valid() -> None:
    with pytest.raises(UnknownNameError) as e:
        partition("shards:2", TRAIN, TEST, 10, 10, numpy_rng(0, "p"))
    for name in list_partitioners():
        assert name in str(e.value)


def test_same_seed_same_partition() -> None:
    a = partition("dirichlet:0.3", TRAIN, TEST, 10, 10, numpy_rng(5, "p"))
    b = partition("dirichlet:0.3", TRAIN, TEST, 10, 10, numpy_rng(5, "p"))
    assert all(torch.equal(x.train_idx, y.train_idx) for x, y in zip(a.clients, b.clients, strict=True))


def test_unknown_dataset_lists_valid() -> None:
    with pytest.raises(UnknownNameError) as e:
        get_dataset("imagenet")
    assert all(n in str(e.value) for n in list_datasets())


def _write_cifar(d: Path, n_per_batch: int = 20) -> None:
    rng = np.random.default_rng(0)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        batch = {b"batch_label": name.encode(), b"labels": rng.integers(0, 10, n_per_batch).tolist(),
                 b"data": rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8),
                 b"filenames": [b"x.png"] * n_per_batch}
        (d / name).write_bytes(pickle.dumps(batch, protocol=2))


def test_cifar10_python_batches(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    ds = get_dataset("cifar10", data_dir=tmp_path)
    assert ds.train_x.shape == (100, 3, 32, 32) and ds.test_x.shape == (20, 3, 32, 32)
    assert ds.num_classes == 10 and ds.in_channels == 3 and ds.image_size == 32
    # pixel (channel 1, row 0, col 0) of image 0 is byte 1024 of its row: the CHW layout of the format
    raw = pickle.loads((tmp_path / "data_batch_1").read_bytes())[b"data"][0, 1024]
    assert ds.train_x[0, 1, 0, 0].item() == pytest.approx((raw / 255 - 0.4822) / 0.2435, abs=1e-5)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_cifar10_refuses_foreign_pickles(tmp_path: Path) -> None:
    _write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(pickle.dumps({b"data": _Evil()}))
    with pytest.raises(DataError, match="refusing to unpickle"):
        get_dataset("cifar10", data_dir=tmp_path)


def test_cifar10_missing_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data_batch"):
        get_dataset("cifar10", data_dir=tmp_path)


def test_fashion_mnist_bad_idx(tmp_path: Path) -> None:
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(b"\x00\x00\x08\x03" + (5).to_bytes(4, "big") * 3 + b"short")
    with pytest.raises(DataError, match="does not match its header"):
        get_dataset("fashion-mnist", data_dir=tmp_path)


@pytest.mark.needs_fmnist
def test_fashion_mnist() -> None:
    ds = get_dataset("fashion-mnist")
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert torch.equal(torch.bincount(ds.train_y), torch.full((10,), 6000))
    assert abs(float(ds.train_x.mean())) < 0.01 and abs(float(ds.train_x.std()) - 1) < 0.01


def test_truncated_gzip_is_a_data_error(tmp_path: Path) -> None:
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        with gzip.open(tmp_path / name, "wb") as f:
            f.write(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"abcde")
        (tmp_path / name).write_bytes((tmp_path / name).read_bytes()[:-6])
    with pytest.raises(DataError, match="cannot read"):
        get_dataset("fashion-mnist", data_dir=tmp_path)


def test_tiny_dirichlet_alpha_still_partitions_or_says_why() -> None:
    try:
        p = partition("dirichlet:0.001", TRAIN, TEST, 5, 10, numpy_rng(0, "p"))
    except DataError as e:
        assert "could not give" in str(e)
    else:
        assert all(c.n_train >= 10 for c in p.clients)


def test_dirichlet_client_split_gives_equal_sizes_and_skewed_priors() -> None:
    """The DisPFL reference's split: equal client sizes, each client's classes drawn from its own Dir(alpha)
    prior; no sample goes to two clients. Small alpha concentrates a client on few classes; large alpha
    approaches the overall class mix."""
    import numpy as np

    from pfl_edge.data import partition as deal_out

    y = torch.arange(10).repeat_interleave(600)  # 6,000 samples, 10 balanced classes
    yte = torch.arange(10).repeat_interleave(100)

    def top_share(alpha: float) -> float:
        part = deal_out(f"dirichlet-client:{alpha}", y, yte, 20, 10, np.random.default_rng(0))
        sizes = {c.n_train for c in part.clients}
        assert sizes == {300}
        every = torch.cat([c.train_idx for c in part.clients])
        assert len(every) == len(set(every.tolist()))  # no sample twice
        return float(np.mean([torch.bincount(c.train_y, minlength=10).max() / c.n_train for c in part.clients]))

    # every sample dealt (20 x 300 of 6,000), so classes run out late in the deal and the last draws go to
    # whatever is left: at alpha 0.1 about half of a client's data is one class (0.50 with this seed)
    assert top_share(0.1) > 0.4 > top_share(1.0) > 0.2
    assert top_share(100.0) < 0.2  # close to uniform (1/10)


def test_dirichlet_client_deals_interleaved_so_skew_does_not_follow_the_index() -> None:
    """Classes run out late in the deal; dealt one sample at a time to random clients (the reference's order),
    that falls on random clients. Dealt client after client, the last ones got the leftovers: over these seeds the
    correlation of label entropy with the client index was -0.33 on average and the last 20 clients' mean top-class
    share 0.59 against 0.47 for the first 50."""
    y = torch.arange(10).repeat_interleave(6000)
    yte = torch.arange(10).repeat_interleave(1000)
    corr, gap = [], []
    for seed in range(5):
        p = partition("dirichlet-client:0.3", y, yte, 100, 10, np.random.default_rng(seed))
        q = torch.stack([torch.bincount(c.train_y, minlength=10).double() / c.n_train for c in p.clients])
        ent = -(q * q.clamp_min(1e-12).log()).sum(1)
        corr.append(float(np.corrcoef(np.arange(100), ent.numpy())[0, 1]))
        top = q.max(1).values
        gap.append(float(top[80:].mean() - top[:50].mean()))
    assert abs(float(np.mean(corr))) < 0.15, corr
    assert abs(float(np.mean(gap))) < 0.05, gap


def test_pathological_random_draws_k_classes_per_client_as_the_reference() -> None:
    """Each client its own K random classes (45 possible pairs of 10 for K = 2; two clients share a class with
    p = 1 - C(8,2)/C(10,2) = 0.378), equal sizes, every class of a client about half its samples; the cyclic
    ``pathological:2`` gives 5 disjoint pairs only."""
    y = torch.arange(10).repeat_interleave(600)
    yte = torch.arange(10).repeat_interleave(100)
    p = partition("pathological-random:2", y, yte, 100, 10, np.random.default_rng(0))
    sets = [frozenset(torch.unique(c.train_y).tolist()) for c in p.clients]
    assert all(len(s) == 2 for s in sets) and {c.n_train for c in p.clients} == {60}
    assert len(set(sets)) > 20  # the cyclic deal: 5
    share = np.mean([bool(a & b) for i, a in enumerate(sets) for b in sets[i + 1:]])
    assert abs(share - (1 - 28 / 45)) < 0.06, share
    halves = [float(torch.bincount(c.train_y, minlength=10).max()) / c.n_train for c in p.clients]
    assert 0.5 <= float(np.mean(halves)) < 0.65  # each of its two classes about half (binomial spread)
    for c in p.clients:
        assert set(torch.unique(c.test_y).tolist()) <= set(torch.unique(c.train_y).tolist())
    cyclic = partition("pathological:2", y, yte, 100, 10, np.random.default_rng(0))
    assert len({frozenset(torch.unique(c.train_y).tolist()) for c in cyclic.clients}) == 5


def test_pathological_random_deals_a_class_that_runs_out_again() -> None:
    """Class 0 has 10 samples, class 1 190; 10 clients of 20 samples, one class each: the clients that drew class
    0 need more than it holds, and get its samples again (the reference refills an exhausted class) instead of
    fewer samples."""
    y = torch.cat([torch.zeros(10), torch.ones(190)]).long()
    p = partition("pathological-random:1", y, torch.arange(2).repeat_interleave(50), 10, 2,
                  np.random.default_rng(0))
    assert {c.n_train for c in p.clients} == {20}
    zero = [c for c in p.clients if int(c.train_y[0]) == 0]
    assert len(zero) >= 1 and all(bool((c.train_y == 0).all()) for c in zero)
    drawn = torch.cat([c.train_idx for c in zero])
    assert len(drawn) > 10 and set(drawn.tolist()) == set(range(10))  # all ten, each dealt more than once


def _header_only_images(d: Path) -> None:
    """Fashion-MNIST's folder with the real label files and a train-images file that is its header alone: reading
    its shape works, loading an image fails."""
    src = Path("/usr/share/datasets/fashion-mnist")
    d.mkdir(parents=True, exist_ok=True)
    for name in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (d / name).symlink_to(src / name)
    with gzip.open(d / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(b"\x00\x00\x08\x03" + (60000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)


@pytest.mark.parametrize("name", ["synthetic", pytest.param("fashion-mnist", marks=pytest.mark.needs_fmnist)])
def test_the_labels_alone_are_the_full_loads(name: str) -> None:
    lab, ds = get_labels(name), get_dataset(name)
    assert torch.equal(lab.train_y, ds.train_y) and torch.equal(lab.test_y, ds.test_y)
    assert (lab.num_classes, lab.in_channels, lab.image_size) == (ds.num_classes, ds.in_channels, ds.image_size)


@pytest.mark.needs_fmnist
@pytest.mark.parametrize("split", ["pathological:2", "dirichlet-client:0.3", "preference"])
def test_a_coordinator_deals_fashion_mnist_from_its_labels_alone(tmp_path: Path, split: str) -> None:
    _header_only_images(tmp_path / "labels-only")
    cfg = FederationConfig(algorithm="fedper", dataset="fashion-mnist", partition=split, clients=20, kp=1,
                           samples_per_client=500, seed=3)
    with pytest.raises(DataError, match="does not match its header"):
        deal(cfg, data_dir=str(tmp_path / "labels-only"))  # no image to be had there
    part, spec = deal_labels(cfg, data_dir=str(tmp_path / "labels-only"))
    _, full, full_spec = deal(cfg)
    assert spec == full_spec and part.num_classes == full.num_classes
    for a, b in zip(part.clients, full.clients, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(
            (a.train_idx, a.train_y, a.test_idx, a.test_y), (b.train_idx, b.train_y, b.test_idx, b.test_y),
            strict=True))
