"""The programs a device runs, exported once and kept: the ONNX inference program of a federation's model and its
ExecuTorch training programs (``export``: ``prepare`` -> the model traced with its weights as inputs |
``lower_executorch_training`` -> ``package``), and the model card that lists them (``pfl_edge.modelcard``,
docs/model.md).

A program is named by what decides its bytes, ``ProgramKey``: the model (its id), the kind and, for training,
the mode, K_P (mode ``personal`` only) and the batch size. Weights do not decide them: a device swaps its own
into every program (ONNX graph inputs named by state-dict key; the training program's parameters in place), so
one file serves every federation and device of that model.

Exports run in a child process, the export worker (``python -m export.worker <work dir>``: the export and the
checks of every program against eager PyTorch), one batch at a time, off the request threads and off the
server's interpreter: an export holds a CPU for seconds to minutes and would starve the event loop of the GIL,
and the server's process imports neither ONNX Runtime nor ExecuTorch (it only names the module to run). ONNX
programs are exported before any training program, and each training program in a child of its own, so that a
card that needs only ONNX is answered within seconds and each training program as soon as it is ready. A
federation's programs are scheduled when it is created (``prefetch``; setting ``export_on_create``); a request
for a program not exported yet schedules it and is answered 503 with ``Retry-After``; the device's client
retries 5xx answers. Files land in ``<data_dir>/programs/``: the program (``os.replace`` from the child's work
dir), then its record ``<file>.json`` (written atomically): a program without a record is an interrupted export
and is exported again. So the cache survives restarts, and a reader
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

__all__ = ["Artefacts", "NotReady", "ProgramKey", "ProgramRecord"]

log = logging.getLogger(__name__)

EXPORT_WORKER = "export.worker"  # the module the child runs (it is installed beside the server, not imported)
EXPORT_TIMEOUT_S = 1800.0  # a large model's training export, on a slow host
RETRY_AFTER_S = 5  # what a 503 asks the caller to wait: the cnn's exports take about that
FAILED_BACKOFF_S = 60.0  # a failed export is not tried again for this long (no export storm from retries)
_RECORD = ".json"
# in every file name's hash: bump it when what an export writes changes, so no cache serves the old form
# (3: the ONNX program is traced with the weights as inputs, so GroupNorm models export too; 4: training programs
# compute convolutions and linear layers through matrix products, export.matmul_conv)
PROGRAM_FORMAT = 4


class NotReady(ApiError):
    """A program is being exported: ask again after ``Retry-After`` seconds."""

    status = HTTPStatus.SERVICE_UNAVAILABLE

    def __init__(self, detail: str, retry_after: float = RETRY_AFTER_S) -> None:
        super().__init__(detail)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(max(1, int(self.retry_after)))}


@dataclass(frozen=True)
class ProgramKey:
    """What decides a program's bytes."""

    spec: ModelSpec
    kind: str  # inference | training
    mode: str | None = None  # training: fedper | personal | dispfl
    kp: int | None = None  # mode personal: the blocks it trains
    batch_size: int | None = None  # training: the fixed batch
    trainer: str = "executorch"  # training: the runtime that runs it (pfl_edge.modelcard.TRAINING_RUNTIMES)

    @property
    def runtime(self) -> str:
        return "onnxruntime" if self.kind == "inference" else self.trainer

    @property
    def file(self) -> str:
        ident: list[Any] = [PROGRAM_FORMAT, model_id(self.spec), self.kind, self.mode, self.kp, self.batch_size]
        if self.kind == "training" and self.trainer != "executorch":  # ExecuTorch programs keep their names
            ident.append(self.trainer)
        h = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:12]
        name = re.sub(r"[^a-z0-9-]+", "-", self.spec.model.lower())[:40].strip("-") or "model"  # a plain name
        if self.kind == "inference":
            return f"{name}-inference-{h}.onnx"
        kp = f"-kp{self.kp}" if self.kp is not None else ""
        suffix = ".onnx" if self.trainer == "onnxruntime" else ".pte"
        return f"{name}-train-{self.mode}{kp}-b{self.batch_size}-{h}{suffix}"

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
        self._child: subprocess.Popen[bytes] | None = None  # the export running now, ended by close()
        self._closed = False
        for stale in self.root.glob(".export-*"):  # the work dirs of a previous process's unfinished exports
            try:  # older than any export may run: another server sharing the directory may be exporting now
                if time.time() - stale.stat().st_mtime > self.timeout_s:
                    shutil.rmtree(stale, ignore_errors=True)
            except OSError:
                continue

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

    def prefetch(self, keys: list[ProgramKey]) -> int:
        """Schedule the programs of ``keys`` not exported yet (a federation's, when it is created), without
        waiting; how many were scheduled. ONNX programs go first whatever the order (``_work``)."""
        scheduled = 0
        now = time.monotonic()
        with self._lock:
            for k in keys:
                failed = self._failed.get(k.file)
                if (self.record(k.file) is not None or k.file in self._running or k.file in self._queue
                        or (failed is not None and now - failed[0] < FAILED_BACKOFF_S)):
                    continue
                self._queue[k.file] = k
                scheduled += 1
            if scheduled:
                self._start_worker()
                self._lock.notify_all()
        return scheduled

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
                # every ONNX program first, in one child (seconds each, the training programs' too): a device
                # that trains with torch or ONNX Runtime needs only those, and must not wait behind ExecuTorch
                # training exports (a minute or more each); then one of those a child, so each one is served as
                # soon as it is ready
                queued = list(self._queue.values())
                batch = [k for k in queued if k.runtime == "onnxruntime"] or queued[:1]
                for k in batch:
                    del self._queue[k.file]
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
            (work / "request.json").write_text(json.dumps([{"file": k.file, **k.to_json()} for k in batch]))
            log.info("exporting %s", ", ".join(k.file for k in batch))
            started = time.monotonic()
            with self._lock:
                if self._closed:
                    return {k.file: "the server is stopping" for k in batch}
                child = self._child = subprocess.Popen([self.python, "-m", EXPORT_WORKER, str(work)],
                                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                _, err = child.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.communicate()
                raise
            finally:
                with self._lock:
                    self._child = None
            if child.returncode != 0:
                tail = err.decode(errors="replace")[-2000:]
                return {k.file: f"exit {child.returncode}: {tail}" for k in batch}
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

    def close(self, grace_s: float = 10.0) -> None:
        """Stop exporting: the running export child is ended (SIGTERM, then SIGKILL after ``grace_s``), none is
        started after. The server's shutdown calls this, so a stopped server leaves no export worker running."""
        with self._lock:
            self._closed = True
            child = self._child
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(grace_s)
            except subprocess.TimeoutExpired:
                child.kill()

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
