"""A device's share of the dealt data (GET /v1/devices/me/share, pfl_edge.data_share): what a device that cannot
deal a partition itself (Dirichlet's gamma draws) trains on. Held to an independent path: the samples and labels
pfl_edge.federation.deal_arrays gives the slot, gathered here from the data set by the served indices."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_testkit import FEDPER, Dev, create

from pfl_edge.data import get_arrays
from pfl_edge.data_share import DataShare
from pfl_edge.federation import FederationConfig, deal_arrays
from server.app import create_app
from server.settings import Settings

ADMIN = "admin-token-for-share-tests"
CONFIGS: dict[str, dict[str, Any]] = {
    "dirichlet": dict(FEDPER, partition="dirichlet-client:0.3"),
    "classwise": dict(FEDPER, partition="dirichlet:0.5", samples_per_client=None),
    "preference": dict(FEDPER, partition="preference:0.3"),
}


@pytest.fixture
def client(tmp_path: Path, broker_url: str) -> Iterator[TestClient]:
    s = Settings(data_dir=tmp_path / "data", broker_url=broker_url, admin_token=ADMIN)  # type: ignore[arg-type]
    with TestClient(create_app(s)) as c:
        for fed, cfg in CONFIGS.items():
            create(c, ADMIN, fed, cfg)
        create(c, ADMIN, "own", dict(FEDPER, partition="device"))
        yield c


@pytest.mark.parametrize("fed", list(CONFIGS))
def test_each_device_is_served_its_slots_share_as_dealt(client: TestClient, fed: str) -> None:
    ds = get_arrays("synthetic")
    cfg = FederationConfig.from_dict(CONFIGS[fed])
    for _ in range(cfg.clients):
        dev = Dev(client, fed)
        r = client.get("/v1/devices/me/share", headers=dev.h)
        assert r.status_code == 200, r.text
        got = DataShare.model_validate(r.json())
        want = deal_arrays(cfg, dev.index)
        assert (got.federation, got.slot, got.dataset, got.partition) == (fed, dev.index, "synthetic", cfg.partition)
        assert got.train == sorted(got.train) and len(set(got.train)) == len(got.train)
        np.testing.assert_array_equal(ds.train_x[got.train], want.train_x)
        np.testing.assert_array_equal(ds.test_x[got.test], want.test_x)
        relabel = np.arange(10) if got.label_map is None else np.asarray(got.label_map)
        np.testing.assert_array_equal(relabel[ds.train_y[got.train]], want.train_y)
        np.testing.assert_array_equal(relabel[ds.test_y[got.test]], want.test_y)
        assert got.num_classes == want.num_classes == (5 if fed == "preference" else 10)
        assert (got.label_map is None) == (fed != "preference")


def test_no_share_without_a_token_or_where_devices_bring_their_own_data(client: TestClient) -> None:
    assert client.get("/v1/devices/me/share").status_code == 401
    assert client.get("/v1/devices/me/share", headers={"Authorization": "Bearer nobody"}).status_code == 401
    assert client.get("/v1/devices/me/share", headers={"Authorization": f"Bearer {ADMIN}"}).status_code in (401, 403)
    own = Dev(client, "own")
    r = client.get("/v1/devices/me/share", headers=own.h)
    assert r.status_code == 409 and "bring their own" in r.json()["detail"]
