"""A server with one small FedPer federation ``f`` and a device's state dir, HTTP client and config for it: the
setup the enrolment tests share (test_renew.py, test_device_key.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from edge_runtime.config import AgentConfig
from edge_runtime.http import Http
from edge_runtime.state import StateDir
from server.launch import BackgroundServer, start_background
from server.settings import Settings

ADMIN = "admin-token-for-agent-tests"
SECRET = "agent-secret-0123456789"
CONFIG = dict(algorithm="fedper", kp=2, clients=3, rounds=2, dataset="synthetic", samples_per_client=32,
              test_per_client=8, local_epochs=1, batch_size=16)


def serve(tmp_path: Path) -> Iterator[BackgroundServer]:
    """The body of a ``srv`` fixture: the server, federation ``f`` created, stopped after."""
    s = start_background(Settings(data_dir=tmp_path / "data", admin_token=ADMIN, tick_s=0.05))  # type: ignore[arg-type]
    admin = Http(s.url, 5)
    admin.token = ADMIN
    admin.call("POST", "/v1/federations", json_body={"id": "f", "enrol_secret": SECRET, "config": CONFIG})
    yield s
    s.stop()


def device(srv: BackgroundServer, root: Path) -> tuple[StateDir, Http, AgentConfig]:
    cfg = AgentConfig(server=srv.url, federation="f", enrol_secret=SECRET, profile="phone-mid", state_dir=str(root))
    return StateDir(root), Http(srv.url, 5), cfg
