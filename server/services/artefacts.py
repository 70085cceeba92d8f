"""The programs a device runs, exported once and kept: the ONNX inference program of a federation's model and its
ExecuTorch training programs (``export``: ``prepare`` -> ``lower_onnx`` | ``lower_executorch_training`` ->
``package``), and the model card that lists them (``pfl_edge.modelcard``, docs/model.md).

A program is named by what decides its bytes, ``ProgramKey``: the model (its id), the kind and, for training,
the mode, K_P (mode ``personal`` only) and the batch size. Weights do not decide them: a device swaps its own
into every program (ONNX initialisers named by state-dict key; the training program's parameters in place), so
one file serves every federation and device of that model.

Exports run in a child process (``python -m server.services.artefacts <work dir>``), one batch at a time, off the
request threads and off the server's interpreter: an export holds a CPU for seconds to minutes and would starve
the event loop of the GIL. A request for a program not exported yet schedules it and is answered 503 with
``Retry-After``; the device's client retries 5xx answers. Files land in ``<data_dir>/programs/``: the program
(``os.replace`` from the child's work dir), then its record ``<file>.json`` (written atomically): a program
without a record is an interrupted export and is exported again. So the cache survives restarts, and a reader
never sees half a file."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from pfl_edge.checkpoint import ModelSpec
from pfl_edge.federation import model_id

from ..errors import ApiError

__all__ = ["Artefacts", "NotReady", "ProgramKey", "ProgramRecord", "training_modes"]

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 1800.0  # a large model's training export, on a slow host
RETRY_AFTER_S = 5  # what a 503 asks the caller to wait: the cnn's exports take about that
FAILED_BACKOFF_S = 60.0  # a failed export is not tried again for this long (no export storm from retries)
_RECORD = ".json"
# in every file name's hash: bump it when what an export writes changes, so no cache serves the old form
PROGRAM_FORMAT = 2


class NotReady(ApiError):
    """A program is being exported: ask again after ``Retry-After`` seconds."""

    status = HTTPStatus.SERVICE_UNAVAILABLE

    def __init__(self, detail: str, retry_after: float = RETRY_AFTER_S) -> None:
        super().__init__(detail)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(max(1, int(self.retry_after)))}


def training_modes(algorithm: str, kp: int) -> list[str]:
    """The training programs a device of ``algorithm`` with ``kp`` personal blocks runs: the whole model
    (``fedper``; FedAvg and FedPer), FedPer-FT's first phase on the personal blocks too (``personal``, when it has
    any), DisPFL's masked training (``dispfl``)."""
    if algorithm == "dispfl":
        return ["dispfl"]
    if algorithm == "fedper-ft" and kp >= 1:
        return ["fedper", "personal"]
    return ["fedper"]


@dataclass(frozen=True)
class ProgramKey:
    """What decides a program's bytes."""

    spec: ModelSpec
    kind: str  # inference | training
    mode: str | None = None  # training: fedper | personal | dispfl
    kp: int | None = None  # mode personal: the blocks it trains
    batch_size: int | None = None  # training: the fixed batch

    @property
    def runtime(self) -> str:
        return "onnxruntime" if self.kind == "inference" else "executorch"

    @property
    def file(self) -> str:
        ident = json.dumps([PROGRAM_FORMAT, model_id(self.spec), self.kind, self.mode, self.kp, self.batch_size])
        h = hashlib.sha256(ident.encode()).hexdigest()[:12]
        name = re.sub(r"[^a-z0-9-]+", "-", self.spec.model.lower())[:40].strip("-") or "model"  # a plain name
        if self.kind == "inference":
            return f"{name}-inference-{h}.onnx"
        kp = f"-kp{self.kp}" if self.kp is not None else ""
        return f"{name}-train-{self.mode}{kp}-b{self.batch_size}-{h}.pte"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "spec": asdict(self.spec)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> ProgramKey:
        return ProgramKey(**{**d, "spec": ModelSpec(**d["spec"])})


@dataclass(frozen=True)
class ProgramRecord:
    file: str
    sha256: str
    bytes: int
    details: dict[str, Any]


class Artefacts:
    """Programs under ``root``, exported on first demand (one child process at a time) and kept."""

    def __init__(self, root: Path, *, python: str = sys.executable, timeout_s: float = EXPORT_TIMEOUT_S) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.python, self.timeout_s = python, timeout_s
        self.exports = 0  # child processes run (a cache hit runs none)
        self._lock = threading.Condition()
        self._records: dict[str, ProgramRecord] = {}
        self._queue: dict[str, ProgramKey] = {}
        self._running: set[str] = set()
        self._failed: dict[str, tuple[float, str]] = {}
        self._thread: threading.Thread | None = None
        for stale in self.root.glob(".export-*"):  # the work dirs of a previous process's unfinished exports
            shutil.rmtree(stale, ignore_errors=True)

    # -------------------------------------------------------------------------------------------- reading
    def record(self, file: str) -> ProgramRecord | None:
        """The program's record if it has been exported (and its file is whole), else None."""
        with self._lock:
            hit = self._records.get(file)
        if hit is not None:
            return hit
        try:
            d = json.loads((self.root / (file + _RECORD)).read_text())
            size = (self.root / file).stat().st_size
        except (OSError, ValueError):
            return None
        rec = ProgramRecord(file, str(d["sha256"]), int(d["bytes"]), dict(d["details"]))
        if rec.bytes != size:  # not ours, or damaged: exported again
            log.error("program %s is %d bytes, its record says %d; exporting it again", file, size, rec.bytes)
            return None
        with self._lock:
            self._records[file] = rec
        return rec

    def path(self, file: str) -> Path:
        return self.root / file

    def ensure(self, keys: list[ProgramKey]) -> list[ProgramRecord]:
        """Every key's record; missing ones are scheduled and ``NotReady`` raised (a 503 with Retry-After)."""
        records = [self.record(k.file) for k in keys]
        missing = [k for k, r in zip(keys, records, strict=True) if r is None]
        if not missing:
            return [r for r in records if r is not None]
        now = time.monotonic()
        with self._lock:
            for k in missing:
                failed = self._failed.get(k.file)
                if failed is not None and now - failed[0] < FAILED_BACKOFF_S:
                    raise NotReady(f"exporting {k.file} failed ({failed[1]:.300}); trying again later",
                                   FAILED_BACKOFF_S - (now - failed[0]))
                if k.file not in self._running:
                    self._queue[k.file] = k
            self._start_worker()
            self._lock.notify_all()
        raise NotReady(f"exporting {len(missing)} program(s) for this model ({', '.join(k.file for k in missing)}); "
                       f"ask again in {RETRY_AFTER_S} s")

    def wait(self, keys: list[ProgramKey], timeout_s: float) -> list[ProgramRecord]:
        """``ensure``, waiting up to ``timeout_s`` for the exports (the CLI's and the tests' convenience)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.ensure(keys)
            except NotReady:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    # -------------------------------------------------------------------------------------------- exporting
    def _start_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # a daemon: a server stopping mid-export leaves a work dir, swept at the next start
            self._thread = threading.Thread(target=self._work, name="pfl-artefacts", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                batch = list(self._queue.values())
                self._queue.clear()
                self._running.update(k.file for k in batch)
            errors: dict[str, str] = {}
            try:
                errors = self._export(batch)
            except Exception as e:  # a crashed or timed-out child: every program of the batch failed
                log.exception("exporting %s failed", [k.file for k in batch])
                errors = {k.file: f"{type(e).__name__}: {e}" for k in batch}
            finally:
                with self._lock:
                    now = time.monotonic()
                    for k in batch:
                        self._running.discard(k.file)
                        if k.file in errors:
                            self._failed[k.file] = (now, errors[k.file])
                        else:
                            self._failed.pop(k.file, None)
                    self._lock.notify_all()

    def _export(self, batch: list[ProgramKey]) -> dict[str, str]:
        """Run the child on ``batch``; move each program it made into place, then write its record."""
        self.exports += 1
        work = Path(tempfile.mkdtemp(prefix=".export-", dir=self.root))
        try:
            (work / "request.json").write_text(json.dumps([k.to_json() for k in batch]))
            log.info("exporting %s", ", ".join(k.file for k in batch))
            started = time.monotonic()
            proc = subprocess.run([self.python, "-m", "server.services.artefacts", str(work)], capture_output=True,
                                  timeout=self.timeout_s, check=False)
            if proc.returncode != 0:
                tail = proc.stderr.decode(errors="replace")[-2000:]
                return {k.file: f"exit {proc.returncode}: {tail}" for k in batch}
            results = json.loads((work / "result.json").read_text())
            errors: dict[str, str] = {}
            for res in results:
                if "error" in res:
                    errors[res["file"]] = res["error"]
                    log.error("exporting %s failed: %s", res["file"], res["error"])
                    continue
                self._install(work, res)
            log.info("exported %d program(s) in %.1f s", len(results) - len(errors), time.monotonic() - started)
            return errors
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _install(self, work: Path, res: dict[str, Any]) -> None:
        file = str(res["file"])
        data = (work / file).read_bytes()
        rec = ProgramRecord(file, hashlib.sha256(data).hexdigest(), len(data), dict(res["details"]))
        os.replace(work / file, self.root / file)
        tmp = work / (file + _RECORD)
        tmp.write_text(json.dumps(asdict(rec), indent=1))
        os.replace(tmp, self.root / (file + _RECORD))  # last: its presence says the program is whole
        with self._lock:
            self._records[file] = rec


# ------------------------------------------------------------------------------------------- the child process

_PACKAGE_ONLY = {"format", "path", "bytes", "sha256", "model", "model_spec", "round", "profile", "density", "source",
                 "verify"}


def export_one(key: ProgramKey, out: Path) -> dict[str, Any]:
    """Export ``key`` into ``out/<key.file>``; its details (what a device needs to drive it)."""
    from device_profiles import get_profile, list_profiles
    from export import lower_executorch_training, lower_onnx, package, prepare, verify

    # a program does not depend on the profile (only on the key); prepare wants one for its file name
    prep = prepare(get_profile(list_profiles()[0]), spec=key.spec, seed=0)
    if key.kind == "inference":
        packaged = package(lower_onnx(prep), out / "pkg")
        verify(packaged)  # against eager PyTorch before it is ever served
        details = {k: v for k, v in packaged.entry.items() if k not in _PACKAGE_ONLY}
        state = {k: v.detach().numpy() for k, v in prep.model.state_dict().items()}
        program, interface = _weights_as_inputs(packaged.path.read_bytes(), state, list(prep.input_shape))
        _check_onnx(program, state, prep)
        packaged.path.write_bytes(program)
        details.update(interface)
    else:
        if key.mode is None or key.batch_size is None:
            raise ValueError(f"training key {key} lacks a mode or batch size")
        lowered = lower_executorch_training(prep, mode=key.mode, batch_size=key.batch_size,
                                            kp=key.kp if key.mode == "personal" else None)
        packaged = package(lowered, out / "pkg")
        _check_training(lowered.program, lowered.details, prep)
        details = {k: v for k, v in packaged.entry.items() if k not in _PACKAGE_ONLY}
        details["outputs"] = ["loss"]
        details["signature"] = "forward(x, y, weight, *frozen) -> (loss,)"
    os.replace(packaged.path, out / key.file)
    return details


def _weights_as_inputs(program: bytes, state: dict[str, Any], input_shape: list[int]) -> tuple[bytes, dict[str, Any]]:
    """The ONNX program with every state-dict tensor a graph input instead of a baked initialiser: a device
    feeds its own weights by name at every run (its personal blocks differ from everyone's; onnxruntime's graph
    optimiser may fold or pre-pack initialisers, so overriding baked ones is not reliable), and the program
    carries no weights of its own. Its inputs and outputs, described."""
    import onnx
    from onnx import helper

    proto = onnx.load_from_string(program)
    inits = {i.name: i for i in proto.graph.initializer}
    missing = [k for k in state if k not in inits]
    if missing:
        raise ValueError(f"the ONNX exporter folded {missing} into constants: they cannot be given as inputs")
    kept = [i for i in proto.graph.initializer if i.name not in state]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    for k, v in state.items():
        proto.graph.input.append(helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, list(v.shape)))
    onnx.checker.check_model(proto)
    inputs = [{"name": "input", "dtype": "f32", "shape": ["batch", *input_shape]},
              *({"name": k, "dtype": "f32", "shape": list(v.shape)} for k, v in state.items())]
    return proto.SerializeToString(), {
        "kind": "inference", "inputs": inputs, "weights": list(state),
        "outputs": [{"name": "logits", "dtype": "f32", "shape": ["batch", "num_classes"]}]}


def _check_onnx(program: bytes, state: dict[str, Any], prep: Any) -> None:
    """The rewritten program, fed the model's weights, against eager PyTorch."""
    import numpy as np
    import onnxruntime as ort
    import torch

    x = torch.randn(3, *prep.input_shape, generator=torch.Generator().manual_seed(0))
    sess = ort.InferenceSession(program, providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"input": x.numpy(), **state})[0]
    with torch.no_grad():
        ref = prep.model(x).numpy()
    if not np.allclose(got, ref, atol=1e-4, rtol=1e-3):
        raise ValueError(f"the ONNX program with weights as inputs differs from eager PyTorch by "
                         f"{float(np.abs(got - ref).max()):.3g}")


def _check_training(program: bytes, details: dict[str, Any], prep: Any) -> None:
    """The training program's loss and gradients on a random, partly padded batch against autograd's (the full
    check, with SGD steps, is edge_runtime.verify_training; the server does not import the device runtime)."""
    import torch
    import torch.nn.functional as F
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    gen = torch.Generator().manual_seed(0)
    b, n = int(details["batch_size"]), max(1, int(details["batch_size"]) - 1)  # n real samples, padded to b
    x, y = torch.randn(b, *prep.input_shape, generator=gen), torch.randint(0, prep.spec.num_classes, (b,),
                                                                           generator=gen)
    w = torch.cat([torch.ones(n), torch.zeros(b - n)])
    params = dict(prep.model.named_parameters())
    module = _load_for_executorch_for_training_from_buffer(program)
    loss = module.forward_backward("forward", (x, y, w, *(params[k].detach() for k in details["frozen"])))[0]
    grads = {k.removeprefix("net."): g for k, g in module.named_gradients().items()}
    model = prep.model
    model.zero_grad()
    ref = F.cross_entropy(model(x[:n]), y[:n])
    ref.backward()
    if sorted(grads) != sorted(details["trainable"]) or abs(float(loss) - float(ref.detach())) > 1e-4:
        raise ValueError(f"the training program's loss {float(loss)} or gradients {sorted(grads)} are not eager "
                         f"PyTorch's ({float(ref.detach())}, {sorted(details['trainable'])})")
    for k, g in grads.items():
        ref_g = params[k].grad
        if ref_g is None or not torch.allclose(g, ref_g, atol=1e-4):
            raise ValueError(f"the training program's gradient of {k} differs from eager PyTorch's")


def _child(work: Path) -> int:
    keys = [ProgramKey.from_json(d) for d in json.loads((work / "request.json").read_text())]
    results: list[dict[str, Any]] = []
    for key in keys:
        try:
            results.append({"file": key.file, "details": export_one(key, work)})
        except Exception as e:  # one failed export must not take the others of the batch with it
            results.append({"file": key.file, "error": f"{type(e).__name__}: {e}"})
    (work / "result.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))
