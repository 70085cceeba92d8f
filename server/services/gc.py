"""Blob garbage collection: after a federation's round moves on, the blobs (and references) it no longer needs
are deleted.

Kept, per federation, with ``keep_rounds`` = K and t the federation's round now: the initial model and the
server's latest base; every round from t - K on: its start and result models (FedPer), the base part of each of
those for every K_P its devices hold (what their tasks name), the updates sent in it, and (DisPFL) every device's
latest model as of each of those rounds (what a task of any of them names; recovery re-publishes round t's);
and uploads that no update names yet, if sent since round t - K opened (they wait for their update; older ones
are abandoned). Everything else of the federation loses its reference; a blob no federation references is
deleted from the database, then from the store, under the store's write lock (an upload of the same bytes at
that moment stores its file again: ``BlobAccess.put``). Rows of updates stay: the ledger outlives the bytes.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from sqlalchemy import delete, select, tuple_
from sqlalchemy.orm import Session

from ..blobs import BlobStore
from ..db import SERVER, Blob, BlobRef, Device, Federation, Round, Update
from ..states import RoundState
from .blob_access import BlobAccess
from .planning import Planner
from .store import Store

__all__ = ["BlobGC"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class BlobGC:
    def __init__(self, store: Store, access: BlobAccess, blobs: BlobStore, *, keep_rounds: int = 2) -> None:
        self.store = store
        self.access = access
        self.blobs = blobs
        self.keep_rounds = keep_rounds
        self._seen: dict[str, tuple[int, bool]] = {}  # federation -> (round, finished) at its last collection

    def after_step(self, fed_id: str) -> int:
        """From the round worker after each step: collect once per round (and once more when a federation
        finishes, and at the first step after a start). The number of blobs deleted."""
        with self.store.read() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                return 0
            key = (fed.round, fed.state == RoundState.FINISHED.value)
        if self._seen.get(fed_id) == key:
            return 0
        n = self.collect(fed_id)
        self._seen[fed_id] = key
        return n

    def keep(self, s: Session, fed_id: str) -> tuple[set[str], float]:
        """The digests federation ``fed_id`` keeps, and since when its pending uploads are kept."""
        fed = self.store.existing(s, fed_id)
        fm = self.store.model(fed)
        lo = max(0, fed.round - self.keep_rounds)
        rounds = list(s.scalars(select(Round).where(Round.federation == fed_id, Round.round >= lo)))
        wholes = {fed.init_digest, fed.base_digest} | {d for r in rounds for d in (r.start_digest, r.base_digest)
                                                       if d is not None}
        keep = set(wholes) | set(s.scalars(select(Update.digest).where(Update.federation == fed_id,
                                                                        Update.round >= lo)))
        algo = fm.algorithm()
        # where devices read their neighbours' latest models, every device's latest is kept: a later round's
        # graph may pick any device, not only those this window's graphs name
        if any(algo.readable(t) for t in range(lo, fed.round + 2)):
            for t in range(lo, fed.round + 2):
                keep |= set(Planner.latest_models(s, fed_id, t).values())
        kps = set(s.scalars(select(Device.kp).where(Device.federation == fed_id).distinct()))
        for whole in wholes:
            for kp in kps:
                try:
                    keep.add(self.access.base_for(fed_id, fm, whole, kp))
                except KeyError:  # a whole model missing from the store: nothing derived from it to keep
                    log.error("federation %s: blob %s is missing from the store", fed_id, whole)
        since = min((r.opened_at for r in rounds), default=fed.created_at)
        return keep, since

    def collect(self, fed_id: str) -> int:
        """Drop what federation ``fed_id`` no longer needs; the number of blobs deleted. Bulk statements in chunks:
        the store's write lock (every upload and update waits for it) is held for a few statements a chunk."""
        with self.store.read() as s:
            keep, since = self.keep(s, fed_id)
            fed = self.store.existing(s, fed_id)
            lo = max(0, fed.round - self.keep_rounds)
            fresh = set(s.scalars(select(Blob.digest).where(Blob.created_at >= since)))
            drop = [(d, u) for d, u in s.execute(select(BlobRef.digest, BlobRef.uploader)
                                                 .where(BlobRef.federation == fed_id))
                    if d not in keep and (u == SERVER or d not in fresh)]
        if not drop:
            return 0
        gone: list[str] = []
        with self.store.write(blobs="collect"):  # held until the files are gone (the inner write commits first)
            with self.store.write() as s:
                # an update accepted since the read above names its digest: that one stays
                used = set(s.scalars(select(Update.digest).where(Update.federation == fed_id, Update.round >= lo)))
                # and a device's upload stored since (its update not yet posted) is fresh: the read above may have
                # seen its reference but not its blob's row (separate statements; on PostgreSQL, another replica
                # or thread commits between them); under the lock no store is in flight, so this read is whole
                new: set[str] = set()
                for uploads in _chunks(sorted({d for d, u in drop if u != SERVER})):
                    new |= set(s.scalars(select(Blob.digest).where(Blob.digest.in_(uploads),
                                                                   Blob.created_at >= since)))
                drop = [(d, u) for d, u in drop if d not in used and (u == SERVER or d not in new)]
                for part in _chunks(drop):
                    s.execute(delete(BlobRef).where(BlobRef.federation == fed_id,
                                                    tuple_(BlobRef.digest, BlobRef.uploader).in_(part)))
                for digests in _chunks(sorted({d for d, _ in drop})):
                    held = set(s.scalars(select(BlobRef.digest).where(BlobRef.digest.in_(digests))))
                    free = [d for d in digests if d not in held]
                    if free:
                        s.execute(delete(Blob).where(Blob.digest.in_(free)))
                        gone.extend(free)
            for d in gone:
                self.blobs.delete(d)
        if gone:
            log.info("federation %s: %d blobs collected", fed_id, len(gone))
        return len(gone)


def _chunks(items: list[T], n: int = 500) -> list[list[T]]:
    return [items[i:i + n] for i in range(0, len(items), n)]
