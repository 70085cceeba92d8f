"""Partial sums: with ``partial_sums`` on, each server process folds the updates it accepts into a running sum per
round (``pfl_edge.aggregate.PartialAverage``: float64 sums and weights per tensor) and writes it to the database
(``PartialSum``, one row per process and round, rewritten in place) every ``flush_s``. At close the leader
merges the round's rows and reads from the blob store only the updates no row holds: those accepted since a
process last wrote, or by a process that died before it wrote. The close then reads a sum per replica instead of
every update, and the folding is spread over the replicas while the round collects.

Only where the algorithm gives a ``partial_sum`` (the mean's: FedPer's, FedAvg's; its ``aggregate`` then starts
from the merged rows) and the rule is the mean do rows merge. A row is used only if every update it names is
one of the round's, it shares none with a row already used, it counts as many updates as
it names, and none of them is clipped by the round's norm bound (its ``max_norm`` is within it; a bound is
known only at close): otherwise its updates are read one by one, as without sums. A sum in another order than
the slot order may differ from the one-by-one mean in float64's last bits, so a federation that must match the
simulator to the bit runs with sums off (the default)."""

from __future__ import annotations

import json
import logging
import queue
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from sqlalchemy import select
from sqlalchemy.orm import Session
from torch import Tensor

from pfl_edge.aggregate import PartialAverage
from pfl_edge.errors import CodecError, ConfigError

from ..db import Device, PartialSum, Update, now
from ..states import RoundState
from .blob_access import BlobAccess
from .store import Store
from .updates import aggregation_rule

__all__ = ["Partials", "Sum", "merge_sums", "pack", "unpack"]

log = logging.getLogger(__name__)

_META = "pfl"


def pack(avg: PartialAverage) -> bytes:
    """A partial sum as safetensors bytes: the float64 sums, and their description in the metadata."""
    sums, meta = avg.state()
    return st_save({k: v.contiguous() for k, v in sums.items()}, metadata={_META: json.dumps(meta)})


def unpack(data: bytes) -> PartialAverage:
    """``pack``'s bytes back; ConfigError for bytes that do not hold a partial sum."""
    try:
        sums = st_load(data)
        meta = json.loads(json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"][_META])
    except (SafetensorError, ValueError, KeyError, TypeError, OverflowError) as e:
        raise ConfigError(f"not a partial sum: {type(e).__name__}") from None
    if not isinstance(meta, dict):
        raise ConfigError("not a partial sum: no description")
    return PartialAverage.from_state(sums, meta)


@dataclass(frozen=True)
class Sum:
    """A stored partial sum as the leader reads it: the updates it holds, the largest of their norms, its bytes."""

    updates: frozenset[int]
    max_norm: float | None
    data: bytes


def merge_sums(sums: Iterable[Sum], ids: Sequence[int], bound: float | None, shapes: Mapping[str, tuple[int, ...]],
               start: PartialAverage | None) -> tuple[PartialAverage | None, set[int], int]:
    """The sums that may stand for updates of a round whose accepted updates are ``ids``, merged into ``start``
    (the algorithm's empty sum, ``Algorithm.partial_sum``; None: it takes none, and none is used): (the merged
    sum, None if none merged; the update ids it holds; how many sums it merged). A sum is left out (its updates
    then read one by one) where it names an update not in ``ids`` or one already merged, counts other than it
    names, holds an update the norm ``bound`` (None: none) clips, or a tensor of another shape than the model's."""
    want, merged, covered, n = set(ids), start, set[int](), 0
    if merged is None:
        return None, covered, 0
    for p in sums:
        if not p.updates or not p.updates <= want or p.updates & covered:
            continue
        if bound is not None and (p.max_norm is None or p.max_norm > bound):
            continue
        try:
            avg = unpack(p.data)
            if avg.count != len(p.updates) or any(tuple(shape) != tuple(shapes.get(k, ())) for k, shape in
                                                  ((k, v.shape) for k, v in avg.state()[0].items())):
                raise ConfigError(f"it counts {avg.count} updates for {len(p.updates)} named, or a tensor's shape "
                                  "is not the model's")
            merged.merge(avg)
        except ConfigError as e:
            log.error("a partial sum of %d updates is not used: %s", len(p.updates), e)
            continue
        covered |= p.updates
        n += 1
    return merged if n else None, covered, n


@dataclass
class _Chain:
    """This process's running sum of one round."""

    avg: PartialAverage  # the algorithm's own sum (``Algorithm.partial_sum``)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    updates: list[int] = field(default_factory=list)
    max_norm: float | None = 0.0
    dirty: bool = False


class Partials:
    """Folds this process's accepted updates into its sums and writes them (module docstring)."""

    def __init__(self, store: Store, blobs: BlobAccess, *, flush_s: float = 1.0) -> None:
        self.store = store
        self.blobs = blobs
        self.flush_s = flush_s
        self._queue: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._chains: dict[tuple[str, int], _Chain] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def accepted(self, fed_id: str, t: int, update_id: int) -> None:
        """An update this process accepted (committed): it is folded in the background."""
        self._queue.put((fed_id, t, update_id))

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pfl-partial-sums", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.step()
            except Exception:  # a sum not written is not lost: the leader reads its updates one by one
                log.exception("partial sums: a step failed")

    def step(self) -> int:
        """Fold what was accepted since the last step, then write every sum that changed; the updates folded."""
        pending: dict[tuple[str, int], list[int]] = defaultdict(list)
        while True:
            try:
                fed_id, t, uid = self._queue.get_nowait()
            except queue.Empty:
                break
            pending[fed_id, t].append(uid)
        folded = sum(self._fold(fed_id, t, ids) for (fed_id, t), ids in pending.items())
        self._flush()
        return folded

    def _fold(self, fed_id: str, t: int, ids: list[int]) -> int:
        with self.store.read() as s:
            fed = self.store.existing(s, fed_id)
            fm = self.store.model(fed)
            empty = fm.algorithm().partial_sum()  # the sum this round's updates fold into; None: it takes none
            if empty is None or aggregation_rule(fed).rule != "mean" or \
                    fed.round != t or fed.state not in (RoundState.COLLECTING.value, RoundState.CLOSING.value):
                return 0
            rows = list(s.execute(select(Update.id, Update.digest, Update.n_samples, Update.delta_norm, Device.kp)
                                  .join(Device, Device.id == Update.device).where(Update.id.in_(ids))
                                  .order_by(Update.id)))
        for key in [k for k in self._chains if k[0] == fed_id and k[1] != t]:  # rounds gone by
            del self._chains[key]
        chain = self._chains.setdefault((fed_id, t), _Chain(avg=empty))
        for uid, digest, n, norm, kp in rows:
            try:
                tensors: dict[str, Tensor] = self.blobs.load(digest, fm, fm.expected(kp)).tensors
            except (CodecError, KeyError, OSError) as e:  # collected, or unreadable: the leader reads it alone
                log.warning("partial sums: update %d not folded: %s", uid, e)
                continue
            chain.avg.add(tensors, float(n))
            chain.updates.append(uid)
            chain.max_norm = None if norm is None or chain.max_norm is None else max(chain.max_norm, norm)
            chain.dirty = True
        return len(chain.updates)

    def _flush(self) -> None:
        for (fed_id, t), chain in list(self._chains.items()):
            if not chain.dirty:
                continue
            data = pack(chain.avg)
            with self.store.write() as s:
                fed = self.store.locked(s, fed_id)  # against the close, which deletes the round's sums
                if fed.round != t or fed.state not in (RoundState.COLLECTING.value, RoundState.CLOSING.value):
                    self._chains.pop((fed_id, t), None)  # closed: the leader has read what it needed
                    continue
                row = s.get(PartialSum, chain.id)
                if row is None:
                    s.add(PartialSum(id=chain.id, federation=fed_id, round=t, updates=list(chain.updates),
                                     max_norm=chain.max_norm, data=data, written_at=now()))
                else:
                    row.updates, row.max_norm, row.data, row.written_at = (list(chain.updates), chain.max_norm,
                                                                           data, now())
            chain.dirty = False

    @staticmethod
    def stored(s: Session, fed_id: str, t: int) -> list[Sum]:
        """The sums stored for round ``t`` (the leader's read at close)."""
        return [Sum(frozenset(int(i) for i in p.updates if isinstance(i, int)), p.max_norm, p.data)
                for p in s.scalars(select(PartialSum).where(PartialSum.federation == fed_id, PartialSum.round == t))]
