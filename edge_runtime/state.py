"""A device's state directory: its enrolment (token included), its model (personal blocks and last base, or its
sparse model and mask), its progress through the rounds and the payload it last uploaded. Every write is
atomic (a temporary file, fsync, then ``os.replace``), so a device killed at any moment restarts from its last
complete step and never from half a file."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pfl_edge.arrays import Array as Tensor
from pfl_edge.arrays import is_numpy
from pfl_edge.errors import ConfigError

__all__ = ["Progress", "RoundStats", "StateDir", "atomic_write"]


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # a temp file left by a crash keeps its old mode otherwise
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass
class RoundStats:
    """What a device measured of one round: bytes moved, training time."""

    bytes_up: int = 0
    bytes_down: int = 0
    step_ms: float | None = None
    train_s: float | None = None
    # task taken up to update accepted; a round retrained after a restart counts from the restart, and one whose
    # trained update a restart resent is unknown (None)
    round_s: float | None = None
    transfer_s: float | None = None  # its downloads and upload


@dataclass
class Progress:
    """Where a device stands, kept in ``progress.json`` and rewritten atomically after every step.

    ``round`` is the round of its model (0: initialised, not trained) and of the payload in ``upload.bin``;
    ``posted``: the server accepted that payload (or the round closed without it, ``abandoned``)."""

    round: int = 0
    posted: bool = True
    digest: str | None = None
    train_loss: float | None = None
    train_s: float | None = None
    initial_sent: bool = False  # the initial model, for algorithms whose devices send one
    late: bool = False  # enrolled while the federation was running
    final: bool = False  # took part in the federation's final evaluation
    abandoned: int | None = None
    bytes_up: int = 0  # in all, accepted uploads
    pending_metrics: list[dict[str, Any]] = field(default_factory=list)  # posted once the upload is accepted
    stats: dict[str, RoundStats] = field(default_factory=dict)  # by round (as a string: JSON keys)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str) -> Progress:
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            values = {k: v for k, v in d.items() if k in known}  # keys of older versions are dropped
            values["stats"] = {str(k): RoundStats(**v) for k, v in dict(values.get("stats", {})).items()}
            values["pending_metrics"] = [dict(m) for m in values.get("pending_metrics", [])]
            out = cls(**values)
            for f in dataclasses.fields(cls):  # JSON may hold anything: every field keeps its declared kind
                default = f.default if f.default is not dataclasses.MISSING else None
                value = getattr(out, f.name)
                if default is not None and (type(value) is not type(default)):
                    raise TypeError(f"{f.name} is {value!r}")
            return out
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where} is not a progress record ({e}); remove the state dir to enrol afresh") from e

    def stat(self, t: int) -> RoundStats:
        return self.stats.setdefault(str(t), RoundStats())


class StateDir:
    """``enrolment.json`` (mode 0600: it holds the token), ``model.safetensors``, ``masks.safetensors``,
    ``progress.json`` and ``upload.bin`` (the payload of the last round, kept until the server accepted it)."""

    def __init__(self, root: str | Path, *, arrays: str = "torch") -> None:
        self.arrays = arrays  # the kind of the tensors it loads: torch tensors, or numpy arrays (no torch)
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # its token and enrolment are secrets
        except OSError as e:
            raise ConfigError(f"cannot create state dir {self.root}: {e}") from e
        if not os.access(self.root, os.W_OK):
            raise ConfigError(f"state dir {self.root} is not writable")

    # --- JSON documents
    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def read_json(self, name: str) -> dict[str, Any] | None:
        p = self.root / name
        if not p.exists():
            return None
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p} is unreadable ({e}); remove the state dir to enrol afresh") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{p} does not hold a JSON object; remove the state dir to enrol afresh")
        return data

    def write_json(self, name: str, data: dict[str, Any], *, private: bool = False) -> None:
        atomic_write(self.root / name, json.dumps(data, indent=1).encode(), mode=0o600 if private else 0o644)

    @property
    def enrolment(self) -> dict[str, Any] | None:
        return self.read_json("enrolment.json")

    def save_enrolment(self, data: dict[str, Any]) -> None:
        self.write_json("enrolment.json", data, private=True)

    @property
    def progress(self) -> Progress:
        d = self.read_json("progress.json")
        return Progress() if d is None else Progress.from_json(d, str(self.root / "progress.json"))

    def save_progress(self, p: Progress) -> None:
        # only the last two rounds' stats are ever reported
        keep = sorted(p.stats, key=int)[-2:]
        p.stats = {k: p.stats[k] for k in keep}
        self.write_json("progress.json", p.to_json())

    # --- tensors
    def load_tensors(self, name: str) -> dict[str, Tensor] | None:
        p = self.root / name
        if not p.exists():
            return None
        try:
            if self.arrays == "numpy":
                from safetensors.numpy import load_file as load_numpy

                return dict(load_numpy(str(p)))
            from safetensors.torch import load_file

            return dict(load_file(str(p)))
        except Exception as e:  # safetensors raises its own error types for a damaged file
            raise ConfigError(f"{p} is damaged ({e}); remove the state dir to enrol afresh") from e

    # the device's state (model, and for DisPFL its support and mask), the round it was trained in and that
    # round's metrics live in one file, written atomically: a restart never sees parts of two rounds
    def save_model(self, state: dict[str, Tensor], t: int, metrics: list[dict[str, Any]]) -> None:
        self.save_tensors("model.safetensors", state, {"round": str(t), "metrics": json.dumps(metrics)})

    def load_model(self) -> tuple[dict[str, Tensor], int, list[dict[str, Any]]]:
        """The device's state, the round it was trained in and that round's metrics (``save_model``)."""
        got = self.load_tensors_meta("model.safetensors")
        if got is None:
            raise ConfigError(f"{self.root}/model.safetensors is missing; remove the state dir to enrol afresh")
        tensors, meta = got
        return tensors, int(meta.get("round", "0")), list(json.loads(meta.get("metrics", "[]")) or [])

    def load_tensors_meta(self, name: str) -> tuple[dict[str, Tensor], dict[str, str]] | None:
        """The tensors and the file's metadata."""
        from safetensors import safe_open

        tensors = self.load_tensors(name)
        if tensors is None:
            return None
        with safe_open(str(self.root / name), framework="np" if self.arrays == "numpy" else "pt") as f:
            meta = f.metadata() or {}
        return tensors, dict(meta)

    def save_tensors(self, name: str, tensors: dict[str, Tensor], meta: dict[str, str] | None = None) -> None:
        p = self.root / name
        tmp = p.with_name(f".{p.name}.tmp")
        if all(is_numpy(v) for v in tensors.values()):
            import numpy as np
            from safetensors.numpy import save_file as save_numpy

            save_numpy({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=meta)
        else:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, p)

    # --- the ledger: one JSON line per update the server accepted (appended, fsynced; a repeat after a restart
    # may appear twice with the same digest). ``bench/soak.py`` holds the server's database to it.
    def append_ledger(self, t: int, digest: str, n_samples: int) -> None:
        line = json.dumps({"round": t, "digest": digest, "n_samples": n_samples, "time": time.time()}) + "\n"
        fd = os.open(self.root / "ledger.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_ledger(self) -> list[dict[str, Any]]:
        """The ledger's entries (a line cut short by a kill mid-write is skipped)."""
        p = self.root / "ledger.jsonl"
        out: list[dict[str, Any]] = []
        for line in p.read_text().splitlines() if p.exists() else []:
            try:
                out.append(dict(json.loads(line)))
            except (ValueError, TypeError):
                continue
        return out

    # --- the payload of the round in flight
    def save_upload(self, data: bytes) -> None:
        atomic_write(self.root / "upload.bin", data)

    def load_upload(self) -> bytes | None:
        p = self.root / "upload.bin"
        return p.read_bytes() if p.exists() else None
