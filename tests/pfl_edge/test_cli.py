import json
import subprocess
import sys
from pathlib import Path

import pytest

from pfl_edge.cli import main


def test_simulate_writes_json_png_and_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["simulate", "--algorithm", "fedper", "--dataset", "synthetic", "--clients", "3", "--rounds", "2",
               "--samples-per-client", "60", "--local-epochs", "1", "--out", str(out), "--save-dir",
               str(tmp_path / "ck"), "--no-progress"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["config"]["clients"] == 3 and len(r["rounds"]) == 2
    assert out.with_suffix(".png").exists()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        "base.safetensors", "client_000.safetensors", "client_001.safetensors", "client_002.safetensors"]
    text = capsys.readouterr().out
    assert "accuracy" in text and "fedper: mean accuracy" in text
    # --config re-runs it; a flag overrides the file
    out2 = tmp_path / "r2.json"
    assert main(["simulate", "--config", str(out), "--rounds", "1", "--out", str(out2), "--no-progress"]) == 0
    r2 = json.loads(out2.read_text())
    assert r2["config"] == {**r["config"], "rounds": 1}
    assert r2["rounds"][0]["client_acc"] == r["rounds"][0]["client_acc"]


def test_user_errors_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "vgg", "--dataset", "synthetic", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'vgg'" in err and "cnn" in err


def test_missing_data_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--dataset", "cifar10", "--data-dir", str(tmp_path), "--no-progress"]) == 3
    assert "data_batch" in capsys.readouterr().err


def test_python_dash_m_and_list() -> None:
    p = subprocess.run([sys.executable, "-m", "pfl_edge", "list"], capture_output=True, text=True, check=True)
    assert "resnet18-gn" in p.stdout and "dirichlet" in p.stdout and "fedper-ft" in p.stdout


def test_unwritable_output_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--dataset", "synthetic", "--out", str(tmp_path), "--no-progress"]) == 2
    assert "is a folder" in capsys.readouterr().err
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["simulate", "--dataset", "synthetic", "--save-dir", str(f), "--no-progress"]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_bad_config_file_types(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('rounds = "five"\n')
    assert main(["simulate", "--config", str(cfg), "--no-progress"]) == 2
    assert "rounds must be an integer" in capsys.readouterr().err
