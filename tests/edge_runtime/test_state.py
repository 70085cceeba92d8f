"""The device's state dir: atomic writes, private enrolment, damaged files refused with a clear error."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from edge_runtime.state import StateDir
from pfl_edge.errors import ConfigError


def test_round_trip_and_private_enrolment(tmp_path: Path) -> None:
    s = StateDir(tmp_path / "dev")
    assert s.enrolment is None
    assert s.progress.round == 0 and s.progress.posted
    s.save_enrolment({"device_id": "d1", "token": "secret"})
    assert s.enrolment == {"device_id": "d1", "token": "secret"}
    assert stat.S_IMODE(os.stat(tmp_path / "dev" / "enrolment.json").st_mode) == 0o600
    t = {"w": torch.arange(6.0).view(2, 3), "b": torch.zeros(2)}
    s.save_tensors("model.safetensors", t)
    back = s.load_tensors("model.safetensors")
    assert back is not None and torch.equal(back["w"], t["w"]) and torch.equal(back["b"], t["b"])
    s.save_upload(b"payload")
    assert s.load_upload() == b"payload"
    assert not list((tmp_path / "dev").glob(".*.tmp"))  # no temporary files left behind


def test_progress_is_a_typed_record_kept_across_restarts(tmp_path: Path) -> None:
    s = StateDir(tmp_path)
    p = s.progress
    p.round, p.posted, p.digest = 3, False, "ab" * 32
    p.stat(2).bytes_up = 10
    p.stat(3).bytes_down = 20
    p.stat(1).train_s = 1.0  # only the last two rounds' figures are kept
    p.pending_metrics = [{"round": 3, "accuracy": 0.5, "loss": 1.0, "n_test": 4}]
    s.save_progress(p)
    back = StateDir(tmp_path).progress
    assert (back.round, back.posted, back.digest) == (3, False, "ab" * 32)
    assert set(back.stats) == {"2", "3"} and back.stats["3"].bytes_down == 20
    assert back.pending_metrics == p.pending_metrics
    (tmp_path / "progress.json").write_text('{"round": "three"}')
    with pytest.raises(ConfigError, match="progress record"):
        _ = s.progress


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    s = StateDir(tmp_path)
    (tmp_path / "progress.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"progress\.json"):
        _ = s.progress
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ConfigError, match="damaged"):
        s.load_tensors("model.safetensors")


def test_unwritable_state_dir(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="cannot create state dir"):
        StateDir(f / "sub")
