"""Blob access: devices' uploads (checked to decode against their federation's model before they are kept),
who may read what, the blobs the server makes itself, and the base part of a model each K_P is sent."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from pfl_edge.codec import DEFAULT_MAX_BYTES, Decoded, decode, encode
from pfl_edge.errors import CodecError
from pfl_edge.secagg.wire import decode_masked
from pfl_edge.split import take

from ..blobs import BlobError, BlobStore, BlobTooLarge, DirBlobStore, sha256_hex
from ..db import SERVER, Blob, BlobRef, Device, Update, now
from ..errors import Forbidden, NotFound, TooLarge, TooManyRequests, Unprocessable
from ..fedmodel import FedModel
from .spool import DecodePool, Spooled, check_update
from .store import Store

__all__ = ["BlobAccess"]


class BlobAccess:
    def __init__(self, store: Store, blobs: BlobStore) -> None:
        self.store = store
        self.blobs = blobs
        # (federation, whole-model digest, kp) -> digest of its base part
        self._base_cache: dict[tuple[str, str, int], str] = {}
        self.upload_quota = 4  # uploads a device may hold that no update of it names (settings.upload_quota_pending)
        self.in_flight = 2  # uploads of one device received at once, per server process (the rest: 429 unread)
        self._receiving: dict[str, int] = {}
        self._receiving_lock = threading.Lock()
        # uploads' decode checks (the app gives it processes: settings.decode_processes) and the threads that run
        # uploads, apart from the thread pool of cheap requests; temp files of bodies as they arrive
        self.decoder = DecodePool(0)
        self.upload_threads = ThreadPoolExecutor(8, thread_name_prefix="pfl-upload")
        self.spool_dir = Path(tempfile.gettempdir())

    @staticmethod
    def add_ref(s: Session, digest: str, size: int, fed_id: str, uploader: str) -> bool:
        """Record that ``uploader`` of ``fed_id`` holds ``digest``; True if that is new. Inserts that lose a race
        (replicas, or threads, storing the same blob at once) do nothing instead of failing."""
        insert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
        if s.get(Blob, digest) is None:
            s.execute(insert(Blob).values(digest=digest, size=size, created_at=now()).on_conflict_do_nothing())
        if s.get(BlobRef, (digest, fed_id, uploader)) is not None:
            return False
        got = s.execute(insert(BlobRef).values(digest=digest, federation=fed_id, uploader=uploader)
                        .on_conflict_do_nothing())
        return bool(got.rowcount)  # type: ignore[attr-defined]  # a CursorResult

    def put(self, dev: Device, digest: str, data: bytes | Spooled) -> bool:
        """True if new for this device (201), False if it had already sent it (200). ``data``: the body, or the
        body spooled to a file as it arrived (``server.services.spool``: hashed already, decoded in the decode
        pool by its path, read back only to be stored, in this thread)."""
        limit = self.store.max_blob_bytes
        size = data.size if isinstance(data, Spooled) else len(data)
        if size > limit:
            raise TooLarge(f"blob of {size} bytes is over the limit of {limit} bytes")
        actual = data.sha256 if isinstance(data, Spooled) else sha256_hex(data)
        if actual != digest:
            raise Unprocessable(f"body has sha256 {actual}, the path names {digest}: the path must be the body's "
                                "sha256 (64 lowercase hex)")
        with self.store.read() as s:
            if s.get(BlobRef, (digest, dev.federation, dev.id)) is not None:
                return False  # the very same bytes, already checked and stored
            self._check_quota(s, dev)
            fm = self.store.model(self.store.existing(s, dev.federation))
        # only what this device may send: FedPer/FedAvg its base part (never its personal blocks, which must not
        # even be stored), DisPFL its whole sparse model; a part of it may arrive (the update checks it is whole);
        # under secure aggregation only a masked input (pfl_edge.secagg.wire), never a model in the clear
        try:
            if fm.cfg.secure_aggregation is not None:
                decode_masked(data.read() if isinstance(data, Spooled) else data, fm.secure_size())
            else:
                self.decoder.check(data.path if isinstance(data, Spooled) else data, expected=fm.expected(dev.kp),
                                   model_id=fm.model_id, max_bytes=self.store.decode_limit(fm), allow_missing=True)
        except CodecError as e:
            what = ("its masked input only (secure aggregation)" if fm.cfg.secure_aggregation is not None
                    else fm.algorithm(dev.kp).describe_upload(dev.kp, dev.density))
            raise Unprocessable(f"payload refused: a {fm.cfg.algorithm} device sends {what}: {e}") from None
        payload = data.read() if isinstance(data, Spooled) else data
        try:
            self.blobs.put(digest, payload)
        except BlobTooLarge as e:
            raise TooLarge(str(e)) from None
        except BlobError as e:
            raise Unprocessable(str(e)) from None
        with self.store.write(blobs="store") as s:
            self._check_quota(s, dev)  # again: uploads racing each other
            if not self.blobs.exists(digest):  # collected meanwhile (server.services.gc): store it again
                self.blobs.put(digest, payload)
            new = self.add_ref(s, digest, size, dev.federation, dev.id)
            row = s.get(Device, dev.id)
            if new and row is not None:
                row.uploaded_bytes = (row.uploaded_bytes or 0) + size
            return new

    def check_quota(self, dev: Device, digest: str) -> None:
        """``_check_quota`` in a session of its own, unless the device holds ``digest`` already (sending the same
        bytes again costs nothing): the blob route asks before it reads a body."""
        with self.store.read() as s:
            if s.get(BlobRef, (digest, dev.federation, dev.id)) is None:
                self._check_quota(s, dev)

    @contextmanager
    def receiving(self, dev: Device) -> Iterator[None]:
        """One of the device's ``in_flight`` slots while its body arrives; 429 (before a byte of the body is read)
        when they are taken: one device's silent uploads cannot fill the spool (20 of 48 MB held 960 MB)."""
        with self._receiving_lock:
            n = self._receiving.get(dev.id, 0)
            if n >= self.in_flight:
                raise TooManyRequests(f"device {dev.id} is already sending {n} uploads (at most {self.in_flight} at "
                                      "once): finish one first")
            self._receiving[dev.id] = n + 1
        try:
            yield
        finally:
            with self._receiving_lock:
                left = self._receiving[dev.id] - 1
                if left:
                    self._receiving[dev.id] = left
                else:
                    del self._receiving[dev.id]

    def _check_quota(self, s: Session, dev: Device) -> None:
        """A device holds at most ``upload_quota`` uploads that none of its updates names yet (an upload waits
        for its update; the collector drops those a round older than its window): 429 beyond."""
        named = select(Update.digest).where(Update.federation == dev.federation, Update.device == dev.id)
        pending = s.scalar(select(func.count()).select_from(BlobRef).where(
            BlobRef.federation == dev.federation, BlobRef.uploader == dev.id, BlobRef.digest.not_in(named))) or 0
        if pending >= self.upload_quota:
            raise TooManyRequests(f"device {dev.id} already holds {pending} uploads that no update of it names "
                                  f"(the quota is {self.upload_quota}): post an update for one of them first")

    def get(self, fed_id: str | None, digest: str, reader: Device | None = None) -> bytes:
        """The blob, if ``reader`` (a device of ``fed_id``; None with ``fed_id`` None: the admin) may read it: what
        the server made (the initial model, averages), what the device itself uploaded, and in decentralised
        algorithms the models of its in-neighbours of this round or the last. Another device's individual
        upload is never served where a server averages: an update can leak its owner's data."""
        with self.store.read() as s:
            if fed_id is not None:
                self._check_reader(s, fed_id, digest, reader)
            elif s.get(Blob, digest) is None:
                raise NotFound(f"no blob {digest}")
        try:
            return self.blobs.get(digest)
        except KeyError:
            raise NotFound(f"no blob {digest} in the store") from None

    def _check_reader(self, s: Session, fed_id: str, digest: str, reader: Device | None) -> None:
        uploaders = set(s.scalars(select(BlobRef.uploader).where(BlobRef.digest == digest,
                                                                  BlobRef.federation == fed_id)))
        if not uploaders:  # another federation's blob is answered exactly as one that does not exist
            raise NotFound(f"no blob {digest}")
        if reader is not None and not (SERVER in uploaders or reader.id in uploaders
                                       or self._neighbour_blob(s, fed_id, reader, uploaders)):
            raise Forbidden(f"blob {digest} is another device's upload; a device reads the server's models, its "
                            "own uploads and (DisPFL) its current neighbours' models")

    def _neighbour_blob(self, s: Session, fed_id: str, reader: Device, uploaders: set[str]) -> bool:
        fed = self.store.existing(s, fed_id)
        algo = self.store.model(fed).algorithm()
        slots: set[int] | None = None
        for t in {fed.round, fed.round - 1} - {0, -1}:  # a device may still be on the last round's task
            readable = algo.readable(t, reader.slot)  # none where a server averages
            if not readable:
                continue
            if slots is None:
                slots = set(s.scalars(select(Device.slot).where(Device.id.in_(uploaders),
                                                                Device.federation == fed_id)))
            if slots & readable:
                return True
        return False

    def keep(self, payload: bytes) -> str:
        """Store a payload the server made (no reference yet: the caller adds it); its digest."""
        digest = sha256_hex(payload)
        if not self.blobs.exists(digest):
            self.blobs.put(digest, payload)
        return digest

    def store_server_blob(self, fed_id: str, payload: bytes) -> str:
        """Keep a payload the server made, readable by every device of ``fed_id``; its digest."""
        digest = self.keep(payload)
        with self.store.write(blobs="store") as s:
            if not self.blobs.exists(digest):  # collected meanwhile (server.services.gc): store it again
                self.blobs.put(digest, payload)
            self.add_ref(s, digest, len(payload), fed_id, SERVER)
        return digest

    def load(self, digest: str, fm: FedModel, expected: dict[str, tuple[int, ...]] | None = None) -> Decoded:
        """A stored payload decoded against the federation's model: exactly ``expected``'s tensors, or (None) any
        of the model's."""
        return decode(self.blobs.get(digest), expected=fm.shapes if expected is None else expected,
                      model_id=fm.model_id, max_bytes=max(DEFAULT_MAX_BYTES, self.store.decode_limit(fm)),
                      allow_missing=expected is None)

    def check_update(self, digest: str, fm: FedModel, expected: dict[str, tuple[int, ...]],
                     start: str | None, ones: Mapping[str, int] | None = None) -> tuple[int, float | None]:
        """``load(digest, fm, expected)``'s check (CodecError if refused) and the update's norm from the model
        ``start`` (None: no norm), run in the decode pool: (the payload's round, its norm). ``ones``: DisPFL's
        most ones per tensor's mask (``spool.check_ones``), None where masks are not checked."""
        limit = max(DEFAULT_MAX_BYTES, self.store.decode_limit(fm))
        begin = None if start is None else (start, self._source(start), fm.shapes)
        return self.decoder.call(check_update, self._source(digest), expected=expected, model_id=fm.model_id,
                                 max_bytes=limit, start=begin, ones=ones)

    def _source(self, digest: str) -> Path | bytes:
        """A stored blob as the decode pool takes it: its file where the store is a directory, else its bytes."""
        if isinstance(self.blobs, DirBlobStore):
            path = self.blobs._path(digest)
            if path.is_file():
                return path
        return self.blobs.get(digest)

    def base_for(self, fed_id: str, fm: FedModel, whole: str, kp: int) -> str:
        """Digest of the base part (for a device with ``kp``) of the whole model ``whole``; what a device receives
        holds no tensor that is personal to it (where every tensor is shared, ``whole`` itself)."""
        # per federation: two federations with the same config share blobs, but each must hold a reference to
        # what its devices are sent (blob reads are checked per federation)
        key = (fed_id, whole, kp)
        hit = self._base_cache.get(key)
        if hit is not None:
            return hit
        d = self.load(whole, fm)
        keys = fm.base_keys(kp)
        digest = whole if set(keys) == set(d.tensors) else self.store_server_blob(
            fed_id, encode(take(d.tensors, keys), model_id=fm.model_id, round=d.round))
        self._base_cache[key] = digest
        return digest
