"""Federations whose devices bring their own data (``partition = "device"``): the server deals nothing, so a
federation is not capped by a data set's test split; each device trains on its own image folder."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from sqlalchemy import select

from edge_runtime.agent import Agent, AgentConfig
from edge_runtime.data import ArrayData, LocalData, load_image_folder
from pfl_edge.data import DatasetArrays, InputShape, get_labels, get_shape, register_dataset
from pfl_edge.errors import ConfigError, DataError
from pfl_edge.federation import OWN_DATA_SAMPLES, FederationConfig, deal_labels, input_spec
from pfl_edge.protocol import MAX_CLIENTS
from server.db import Update
from server.launch import BackgroundServer, start_background
from server.settings import Settings

SECRET = "enrol-secret-own-data"
CONFIG: dict[str, Any] = dict(algorithm="fedper", kp=2, clients=2, rounds=2, dataset="synthetic", partition="device",
                              samples_per_client=40, local_epochs=1, batch_size=8, lr=0.05, workers=1, seed=5)


def _images(root: Path, classes: dict[int, int], seed: int) -> Path:
    """A device's own folder: ``classes`` {label: count} of 20x20 RGB images (resized to the model's 1x28x28)."""
    rng = np.random.default_rng(seed)
    for label, n in classes.items():
        (root / str(label)).mkdir(parents=True)
        for i in range(n):
            px = np.clip(rng.normal(40 + 20 * label, 25, (20, 20, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(px).save(root / str(label) / f"{i}.png")
    return root


def test_the_coordinators_view_of_an_own_data_federation() -> None:
    cfg = FederationConfig.from_dict({**CONFIG, "clients": MAX_CLIENTS})
    spec, share = input_spec(cfg)
    _, dealt_spec = deal_labels(FederationConfig.from_dict({**CONFIG, "partition": "iid"}))
    assert spec == dealt_spec and share == 40  # the data set's shape and classes; samples_per_client caps
    assert input_spec(cfg.replace(samples_per_client=None))[1] == OWN_DATA_SAMPLES
    with pytest.raises(ConfigError, match="bring"):  # the simulator deals: it cannot run one
        deal_labels(cfg)
    # a dealt federation of as many clients is refused: the data set runs out
    with pytest.raises(DataError, match="without training data"):
        input_spec(cfg.replace(partition="iid"))


def test_a_device_without_torch_holds_out_the_same_images(tmp_path: Path) -> None:
    """One definition of the hold-out: a device without torch (numpy arrays) trains and tests on exactly the
    images a torch device would, and the model's input comes from the data set's registered shape."""
    folder = _images(tmp_path / "img", {0: 9, 4: 6, 7: 5}, 2)
    cfg = FederationConfig.from_dict(CONFIG)
    a = load_image_folder(str(folder), cfg, slot=3, arrays="numpy")
    t = load_image_folder(str(folder), cfg, slot=3)
    assert isinstance(a, ArrayData) and isinstance(t, LocalData) and a.spec == t.spec
    tx, ty = t.xy
    assert np.array_equal(a.arrays.train_x, tx.numpy()) and np.array_equal(a.arrays.train_y, ty.numpy())
    assert (a.n_train, a.n_test) == (16, 4)  # 20 % of each class held out: 2 + 1 + 1
    assert sorted(a.arrays.test_y.tolist()) == [0, 0, 4, 7]
    other = load_image_folder(str(folder), cfg, slot=4, arrays="numpy")  # another slot holds out others
    assert not np.array_equal(other.arrays.test_x, a.arrays.test_x)


def test_a_data_sets_shape_is_known_without_its_files_and_checked_on_load() -> None:
    assert get_shape("cifar10", data_dir="/nonexistent") == InputShape(3, 32, 10)  # no file is read

    @register_dataset("wrong-shape-for-test", shape=InputShape(3, 28, 10))
    def _wrong(data_dir: Path | None) -> DatasetArrays:
        x = np.zeros((4, 1, 28, 28), np.float32)
        return DatasetArrays("wrong-shape-for-test", x, np.zeros(4, np.int64), x, np.zeros(4, np.int64), 10)

    with pytest.raises(DataError, match="registered as"):
        get_labels("wrong-shape-for-test")


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[BackgroundServer]:
    s = start_background(Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                                  admin_token="admin-token-own-data", tick_s=0.05,
                                  export_on_create="none"))  # type: ignore[arg-type]
    yield s
    s.stop()


def _create(srv: BackgroundServer, fed: str, config: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/federations", headers={"Authorization": f"Bearer {srv.admin_token}"},
                      json={"id": fed, "enrol_secret": SECRET, "config": config}, timeout=60)


def _agent(srv: BackgroundServer, root: Path, name: str, images: Path | None) -> Agent:
    return Agent(AgentConfig(server=srv.url, federation="own", enrol_secret=SECRET, profile="phone-mid",
                             state_dir=str(root / name), threads=1, training_backend="torch", patience_s=30,
                             image_dir=None if images is None else str(images)))


def test_devices_train_on_their_own_folders(srv: BackgroundServer, tmp_path: Path) -> None:
    r = _create(srv, "big", {**CONFIG, "clients": MAX_CLIENTS})
    assert r.status_code == 201, r.text  # 100,000 slots: nothing is dealt
    assert _create(srv, "dealt", {**CONFIG, "clients": MAX_CLIENTS, "partition": "iid"}).status_code == 422
    assert _create(srv, "own", CONFIG).status_code == 201
    with pytest.raises(ConfigError, match="--data-dir"):  # a device without its own data is told what to pass
        _agent(srv, tmp_path, "dev0", None).run()
    # it took a slot when it enrolled: started again with its folder it keeps that slot (its nonce), so the
    # two-slot federation still has room for the second device
    folders = [_images(tmp_path / "img0", {0: 12, 1: 12}, 0), _images(tmp_path / "img1", {2: 10, 3: 16}, 1)]
    agents = [_agent(srv, tmp_path, f"dev{i}", f) for i, f in enumerate(folders)]
    rcs: list[Any] = [None, None]

    def run(i: int) -> None:
        try:
            rcs[i] = agents[i].run()
        except BaseException as e:  # reported below
            rcs[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert rcs == [0, 0], rcs
    assert all(a.store.progress.final for a in agents)
    # each update counted the device's own training images (80 % of each class: 20 and 21), under the cap
    assert srv.app_state is not None
    with srv.app_state.coordinator.store.read() as s:
        counts = {(u.round, u.n_samples) for u in s.scalars(select(Update).where(Update.federation == "own"))}
    assert counts == {(t, n) for t in (1, 2) for n in (20, 21)}, counts
