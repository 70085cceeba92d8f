"""Updates: a device's upload for a round, checked (its round, its blob, exactly the tensors it may send) and
counted exactly once (``UNIQUE(federation, round, device)``; a retry of the same update is answered again).

A device's sample count is its averaging weight, and a number it reports about itself, so the server never takes
more than it knows: ``min(reported, declared at enrolment, cap)`` (``counted_samples``), kept in
``Update.n_samples``. The cap (``sample_cap``) is the share the server dealt the device's slot (a dealt federation:
the server deals the labels as the simulator and every device do, so it knows each slot's count; an honest device
reports exactly that), lowered by the federation's ``aggregation.max_samples`` where set. Where every device brings
its own data (``partition = "device"``) the server knows nothing of a device's data: the cap is the operator's
word, ``aggregation.max_samples`` or else the config's ``samples_per_client``, and with neither every update counts
1 (equal weights: a device claiming 2^31-1 samples weighs what an honest one does). A device that declared
nothing at enrolment (the agent learns its data only once enrolled) is bound by its first accepted update's count:
it never weighs more later.
Each update's norm from its round's start model is computed here, where the upload is decoded anyway, and kept
(``Update.delta_norm``) for the round's norm bound at close.

A DisPFL device's mask is its own, but not its density: that is the capacity the server gave it at enrolment
(``Device.density``), and ERK at that density fixes each parameter tensor's count of ones (``int(density_l *
numel)``, pfl_edge.sparse; prune-and-regrow keeps it). An update whose mask holds more ones than that in any
tensor (a tensor sent dense where ERK keeps it sparse counts as all ones), or none where ERK keeps some, is
refused (``mask_bound``; docs/protocol.md, DisPFL masks). Its norm (of the whole model, kept in
``Update.delta_norm``) must be within the algorithm's ``upload_norm_bound`` of the round's other uploads: a model
every honest neighbour's screen would leave out is not served to them at all. Each refused upload counts in
``Device.refused_updates``."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from pfl_edge.aggregate import MIN_UPDATES, AggregationRule
from pfl_edge.errors import CodecError
from pfl_edge.protocol import AggregationSettings, UpdateAccepted, UpdateRequest

from ..db import BlobRef, Device, Federation, Update
from ..errors import Conflict, Unprocessable
from ..fedmodel import FedModel
from ..states import ENROLMENT_ROUND, RoundState
from .blob_access import BlobAccess
from .secure import SecureRounds, is_secure
from .store import Store

__all__ = ["Updates", "aggregation_rule", "counted_samples", "mask_bound", "sample_cap"]

_CACHE_LOCK = threading.Lock()
_ERK: weakref.WeakKeyDictionary[FedModel, dict[float, dict[str, int] | None]] = weakref.WeakKeyDictionary()


def _settings(fed: Federation) -> AggregationSettings:
    return AggregationSettings.model_validate(fed.aggregation or {})


def aggregation_rule(fed: Federation) -> AggregationRule:
    """The federation's rule for combining a round's updates (its stored settings, else the defaults)."""
    a = _settings(fed)
    return AggregationRule(a.rule, a.max_update_norm, a.norm_multiple, a.trim)


def sample_cap(fed: Federation, fm: FedModel, slot: int) -> int:
    """The most samples one update of the device in ``slot`` counts for in ``fed`` (module docstring)."""
    bound = _settings(fed).max_samples
    if fm.shares:
        share = fm.shares[slot] if 0 <= slot < len(fm.shares) else 1
        return share if bound is None else min(share, bound)
    if bound is None:  # own data: the operator's word for what one device holds, else equal weights
        bound = fm.cfg.samples_per_client
    return 1 if bound is None else bound


def mask_bound(fm: FedModel, density: float) -> dict[str, int] | None:
    """The most ones each tensor's mask may hold in an update at ``density`` (``Algorithm.mask_ones``; None:
    updates carry no masks); computed once per model and density."""
    with _CACHE_LOCK:
        per = _ERK.setdefault(fm, {})
        if density not in per:  # densities are the server's own (config or profiles): a handful per federation
            per[density] = fm.algorithm().mask_ones(density)
        return per[density]


def counted_samples(reported: int, declared: int | None, cap: int) -> int:
    """What an update's sample count counts for: never more than declared at enrolment nor the cap."""
    return max(1, min(reported, cap, reported if declared is None else declared))


class Updates:
    def __init__(self, store: Store, blobs: BlobAccess, on_accepted: Callable[[], None]) -> None:
        self.store = store
        self.blobs = blobs
        self.on_accepted = on_accepted  # wakes the round worker: the update may close the round
        self.on_stored: Callable[[str, int, int], None] | None = None  # (federation, round, update id) committed
        self.secure: SecureRounds | None = None  # checks a secure round's masked inputs (server.services.secure)

    def submit(self, dev: Device, t: int, req: UpdateRequest) -> UpdateAccepted:
        try:
            return self._submit(dev, t, req)
        except Unprocessable:  # its payload refused: counted per device (the dashboard's devices, /metrics)
            with self.store.write() as s:
                row = s.get(Device, dev.id)
                if row is not None:
                    row.refused_updates = (row.refused_updates or 0) + 1
            raise

    def _submit(self, dev: Device, t: int, req: UpdateRequest) -> UpdateAccepted:
        with self.store.read() as s:
            fed = self.store.existing(s, dev.federation)
            fm = self.store.model(fed)
            dup = self._previous(s, fed.id, t, dev.id)
            if dup is not None:
                return self._duplicate(s, dup, t, req)
            self._check_round(s, fed, fm, dev, t)
            if s.get(BlobRef, (req.digest, fed.id, dev.id)) is None:
                raise Unprocessable(f"blob {req.digest} was not uploaded by this device: PUT /v1/blobs/{req.digest} "
                                    "first")
            start = None if t == ENROLMENT_ROUND else fm.algorithm().shared_digest(
                self.store.round(s, fed.id, t).start_digest)
            masked = self.secure is not None and t != ENROLMENT_ROUND and is_secure(fm)
            if masked and self.secure is not None:  # a masked input: nothing to decode, nothing to measure
                self.secure.check_input(s, fm, self.store.round(s, fed.id, t), dev, self.blobs.blobs.get(req.digest))
        norm = None if masked else self._check_payload(fm, dev, t, req.digest, start)  # decoded outside the lock
        counted = counted_samples(req.n_samples, dev.declared_samples, sample_cap(fed, fm, dev.slot))
        with self.store.write() as s:
            fed = self.store.locked(s, dev.federation)
            dup = self._previous(s, fed.id, t, dev.id)
            if dup is not None:  # a concurrent retry won the race
                return self._duplicate(s, dup, t, req)
            self._check_round(s, fed, fm, dev, t)  # the round may have closed meanwhile
            if masked and self.store.round(s, fed.id, t).secagg_step != "input":
                raise Conflict(f"round {t} takes no more masked inputs: its secure aggregation moved on")
            if start is None and norm is not None:
                self._check_norm(s, fm, fed.id, t, dev.id, norm)
            upd = Update(federation=fed.id, round=t, device=dev.id, digest=req.digest, n_samples=counted,
                         train_loss=req.train_loss, train_s=req.train_s, bytes_down=req.bytes_down,
                         delta_norm=norm)
            s.add(upd)
            row = s.get(Device, dev.id)
            if row is not None and row.declared_samples is None:  # undeclared at enrolment: its first word binds
                row.declared_samples = counted
            s.flush()
            n, uid = self.store.count_updates(s, fed.id, t), upd.id
        if self.on_stored is not None and t != ENROLMENT_ROUND:
            self.on_stored(fed.id, t, uid)  # committed: this process's partial sum may fold it
        self.on_accepted()
        return UpdateAccepted(round=t, accepted=True, updates=n)

    def _check_payload(self, fm: FedModel, dev: Device, t: int, digest: str, start: str | None) -> float | None:
        """The blob must be exactly what this device may send this round; its norm from the round's ``start``
        model (None without one), for the round's norm bound."""
        ones = mask_bound(fm, dev.density)  # a sparse update at its capacity
        try:  # decoded and measured in the decode processes (each keeps the round's start model decoded)
            rnd, norm = self.blobs.check_update(digest, fm, fm.expected(dev.kp), start, ones)
        except CodecError as e:
            what = fm.algorithm(dev.kp).describe_upload(dev.kp, dev.density)
            raise Unprocessable(f"update refused: a {fm.cfg.algorithm} device sends {what}: {e}") from None
        if rnd != t:
            raise Unprocessable(f"the payload's header is for round {rnd}, the update is posted for round {t}")
        return norm

    @staticmethod
    def _check_norm(s: Session, fm: FedModel, fed_id: str, t: int, dev_id: str, norm: float) -> None:
        """A whole model (DisPFL) whose norm is far off the round's others' (``upload_norm_bound``: the
        previous round's count too while this one holds fewer than ``MIN_UPDATES``) is refused."""
        others = [n for n in s.scalars(select(Update.delta_norm).where(
            Update.federation == fed_id, Update.round == t, Update.device != dev_id)) if n is not None]
        if len(others) < MIN_UPDATES and t > ENROLMENT_ROUND:
            others += [n for n in s.scalars(select(Update.delta_norm).where(
                Update.federation == fed_id, Update.round == t - 1, Update.device != dev_id)) if n is not None]
        bound = fm.algorithm().upload_norm_bound(others)
        if bound is not None and not norm <= bound:
            raise Unprocessable(f"update refused: its model's norm {norm:.4g} is past {bound:.4g}, the bound of "
                                f"this round ({len(others)} other uploads' median times the neighbour bound)")

    @staticmethod
    def _previous(s: Session, fed_id: str, t: int, dev_id: str) -> Update | None:
        return s.scalar(select(Update).where(Update.federation == fed_id, Update.round == t, Update.device == dev_id))

    def _duplicate(self, s: Session, dup: Update, t: int, req: UpdateRequest) -> UpdateAccepted:
        if dup.digest != req.digest:
            raise Conflict(f"this device already sent a different update for round {t} ({dup.digest}); one update "
                           "per device and round")
        return UpdateAccepted(round=t, accepted=False, updates=self.store.count_updates(s, dup.federation, t))

    @staticmethod
    def _check_round(s: Session, fed: Federation, fm: FedModel, dev: Device, t: int) -> None:
        if fed.state == RoundState.FINISHED:
            raise Conflict(f"federation {fed.id!r} has finished (round {fed.round}); no more updates")
        if t != ENROLMENT_ROUND and (t != fed.round or fed.state != RoundState.COLLECTING):
            raise Conflict(f"round {t} is not collecting updates: the federation is in round {fed.round} "
                           f"({fed.state})")
        if t != ENROLMENT_ROUND and dev.joined_round >= t:
            raise Conflict(f"device joined during round {dev.joined_round}; it takes part from round "
                           f"{dev.joined_round + 1}")
        # the algorithm's rule (a device's initial model is accepted whenever it enrolls, where one is taken)
        has_initial = s.scalar(select(Update.id).where(Update.federation == fed.id, Update.device == dev.id,
                                                       Update.round == ENROLMENT_ROUND)) is not None
        why = fm.algorithm().participation(t, fed.draw_key).refusal(dev.slot, has_initial=has_initial)
        if why is not None:
            raise Conflict(f"{why}; the current round is {fed.round}" if t == ENROLMENT_ROUND else why)

