"""Uploads off the event loop and out of memory: a blob PUT's body is written to a temp file as it arrives and
hashed incrementally (:func:`spool_body`), so an upload in flight holds one chunk of memory, not its whole body;
the decode check runs in a pool of processes (:class:`DecodePool`, one per core by default) at a lower priority
than the server's own process, so that cheap requests stay cheap while uploads are checked on every core."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pfl_edge.codec import Decoded, decode
from pfl_edge.errors import CodecError

from ..errors import TooLarge

__all__ = ["BodyStalled", "DecodePool", "Spooled", "check_ones", "check_payload", "check_update", "spool_body"]

T = TypeVar("T")

_NICE = 5  # decode workers yield the CPU to the server's event loop and request threads


@dataclass
class Spooled:
    """A request body on disk: its path, size and sha256 (hex)."""

    path: Path
    size: int
    sha256: str

    def read(self) -> bytes:
        return self.path.read_bytes()

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


class BodyStalled(TimeoutError):
    """A body that stopped arriving: no chunk for the idle timeout."""


async def spool_body(chunks: AsyncIterator[bytes], limit: int, directory: Path,
                     declared: str | None = None, idle_timeout_s: float | None = None, min_rate: float = 0.0,
                     clock: Callable[[], float] | None = None) -> Spooled:
    """The body of ``chunks`` written to a temp file in ``directory`` and hashed as it arrives; TooLarge past
    ``limit`` bytes (at once when ``declared``, the Content-Length, says so); BodyStalled when no chunk comes for
    ``idle_timeout_s`` (the header was whole, so no timeout of the HTTP server's applies any more), or when, past
    ``idle_timeout_s`` from the first byte, the body has come at fewer than ``min_rate`` bytes a second on average
    (a byte a second resets an idle timer for ever). Either way the file is gone. ``clock``: the loop's time.
    Each write goes to the page cache (a few microseconds a chunk), so it is done on the event loop rather than
    with a thread hop per chunk."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"blob of {declared} bytes is over the limit of {limit} bytes")
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=".upload-")
    path = Path(name)
    h = hashlib.sha256()
    size = 0
    loop = asyncio.get_running_loop()
    now = clock or loop.time
    start = now()
    idle = asyncio.timeout(idle_timeout_s)  # one timer for the whole body, pushed on by each chunk
    try:
        async with idle:
            with os.fdopen(fd, "wb", buffering=0) as f:
                async for chunk in chunks:
                    if idle_timeout_s is not None:
                        idle.reschedule(loop.time() + idle_timeout_s)
                    size += len(chunk)
                    if size > limit:  # a body without (or with a lying) Content-Length
                        raise TooLarge(f"blob is over the limit of {limit} bytes")
                    took = now() - start
                    if min_rate > 0 and took > (idle_timeout_s or 0.0) and size < min_rate * took:
                        raise BodyStalled(f"the body came at {size / took:.0f} bytes a second ({size} bytes in "
                                          f"{took:.0f} s); at least {min_rate:g} are needed")
                    h.update(chunk)
                    f.write(chunk)
    except BaseException as e:
        path.unlink(missing_ok=True)
        if isinstance(e, TimeoutError) and idle.expired():
            raise BodyStalled(f"no byte of the body for {idle_timeout_s:g} s (after {size} bytes)") from None
        raise
    return Spooled(path, size, h.hexdigest())


def check_payload(source: Path | bytes, expected: Mapping[str, Sequence[int]], model_id: str, max_bytes: int,
                  allow_missing: bool) -> int:
    """``pfl_edge.codec.decode``'s whole check of a payload (a file or bytes), in whichever process runs it;
    CodecError if refused, else the round in its header. Only that crosses the process boundary back, never the
    decoded tensors."""
    data = source.read_bytes() if isinstance(source, Path) else source
    return decode(data, expected=expected, model_id=model_id, max_bytes=max_bytes, allow_missing=allow_missing).round


_STARTS: dict[str, Mapping[str, Any]] = {}  # in a worker: the last few rounds' start models, decoded


def check_ones(d: Decoded, allowed: Mapping[str, int]) -> None:
    """DisPFL: CodecError unless every tensor of ``allowed`` carries at most its count of ones in its mask (a
    tensor sent without a mask counts as all ones), and at least one where its count is at least one: a mask
    emptied where ERK keeps weights is a broken device, which prune-and-regrow never makes."""
    for k, cap in allowed.items():
        t = d.tensors.get(k)
        if t is None:  # not sent: decode's check of the expected names refuses that
            continue
        m = d.masks.get(k)
        ones = t.numel() if m is None else int(m.sum())
        sent = "sent dense, all ones" if m is None else f"of {t.numel()}"
        if ones > cap or (ones == 0 and cap > 0):
            bound = f"at most {cap}" if ones > cap else f"at least 1 and at most {cap}"
            raise CodecError(f"tensor {k!r} has {ones} ones in its mask ({sent}); ERK at the device's density "
                             f"allows {bound}")


def check_update(source: Path | bytes, expected: Mapping[str, Sequence[int]], model_id: str, max_bytes: int,
                 start: tuple[str, Path | bytes, Mapping[str, Sequence[int]]] | None,
                 ones: Mapping[str, int] | None = None) -> tuple[int, float | None]:
    """An update's payload decoded whole against exactly ``expected`` (CodecError if refused): the round in its
    header, and its norm from the round's start model ``start`` = (digest, its source, the model's shapes), which
    each process decodes once per round (None without one: then, where ``ones`` is given, the norm of the model
    itself, a DisPFL upload being a whole model). ``ones``: DisPFL's most ones per tensor's mask
    (:func:`check_ones`; None: no mask check)."""
    from pfl_edge.aggregate import update_norm

    data = source.read_bytes() if isinstance(source, Path) else source
    d = decode(data, expected=expected, model_id=model_id, max_bytes=max_bytes)
    if ones is not None:
        check_ones(d, ones)
    if start is None:
        if ones is None:
            return d.round, None
        import torch

        return d.round, update_norm(dict.fromkeys(d.tensors, torch.zeros((), dtype=torch.float64)), d.tensors)
    digest, src, shapes = start
    prev = _STARTS.get(digest)
    if prev is None:
        raw = src.read_bytes() if isinstance(src, Path) else src
        prev = decode(raw, expected=shapes, model_id=model_id, max_bytes=max_bytes, allow_missing=True).tensors
        while len(_STARTS) >= 4:
            _STARTS.pop(next(iter(_STARTS)))
        _STARTS[digest] = prev
    return d.round, update_norm(prev, d.tensors)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"  # a zombie is a dead server not yet reaped
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (not Linux): whether the pid exists
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _watch(server_pid: int) -> None:
    while _alive(server_pid):
        time.sleep(1.0)
    os._exit(0)


def _worker_init(server_pid: int) -> None:
    # a worker outlives a server killed with SIGKILL (it holds its own queue's pipe and the forkserver's "alive"
    # pipe, so neither ever reads EOF): it watches the server and exits with it, and the forkserver follows
    threading.Thread(target=_watch, args=(server_pid,), name="pfl-decode-watch", daemon=True).start()
    with contextlib.suppress(OSError):  # not allowed here: run at the same priority
        os.nice(_NICE)
    import torch

    torch.set_num_threads(1)  # one process per core already


class DecodePool:
    """``processes`` worker processes for decode checks (0: check in the calling thread). Started lazily from a
    clean interpreter (``forkserver``: the server has threads, which a plain fork would copy half-held), and
    warmed at :meth:`start` so the first uploads do not wait for the imports."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = (os.cpu_count() or 1) if processes is None else processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False  # stopped: no fresh pool after a broken one (checks run in the calling thread)

    def start(self) -> None:
        with self._lock:
            if self.processes <= 0 or self._pool is not None or self._closed:
                return
            ctx = multiprocessing.get_context("forkserver")
            # torch too: decode builds tensors (the codec itself no longer imports it)
            ctx.set_forkserver_preload(["torch", "pfl_edge.codec", "server.services.spool"])
            pool = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=ctx, initializer=_worker_init,
                                                          initargs=(os.getpid(),))
            for f in [pool.submit(os.getpid) for _ in range(self.processes)]:
                f.result()
            self._pool = pool

    def stop(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def check(self, source: Path | bytes, **kw: Any) -> int:
        """:func:`check_payload` in the pool (a file is passed by its path, not its bytes); blocks the calling
        thread, never the event loop."""
        return self.call(check_payload, source, **kw)

    def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``fn(*args, **kw)`` in the pool (here without one); ``fn`` must be a module-level function."""
        pool = self._pool
        if pool is None:
            return fn(*args, **kw)
        try:
            return pool.submit(fn, *args, **kw).result()
        except concurrent.futures.process.BrokenProcessPool:  # a worker died (OOM kill): a fresh pool next time
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False)
            self.start()
            return fn(*args, **kw)
