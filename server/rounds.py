"""The federation's rounds as a durable state machine, and everything that changes state.

Round 0 is enrolment (DisPFL devices also upload their initial sparse model as an update of round 0). Round
t >= 1 goes ``open`` (its tasks are being prepared) -> ``collecting`` (tasks published, updates accepted) ->
``closing`` (FedPer: averaging) -> ``published`` (its result stored) -> round t+1 ``open``, or ``finished`` after
the last round. Every transition is committed before anything is published, so a server killed anywhere resumes
from the database: ``recover()`` re-publishes the current tasks and finishes a half-done close. FedPer's average
is computed at close by streaming the accepted updates from the blob store one at a time (one float64
accumulator per tensor), so nothing is held in memory between requests and a restart loses nothing.

All state transitions run in one worker thread (``step``), woken by enrolments and updates and by a ticker for
deadlines; HTTP handlers only insert rows. Writes in this process are serialised by a lock (SQLite has one
writer anyway); on PostgreSQL the federation row is also locked ``FOR UPDATE``.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from torch import Tensor

from device_profiles import get_profile, list_profiles
from pfl_edge.codec import DEFAULT_MAX_BYTES, Decoded, decode, encode
from pfl_edge.errors import CodecError, PflEdgeError, UnknownNameError
from pfl_edge.protocol import (
    DeviceStatus,
    Enrolment,
    EnrolRequest,
    FederationCreate,
    FederationInfo,
    MetricsReport,
    Neighbour,
    RoundAnnouncement,
    Task,
    UpdateAccepted,
    UpdateRequest,
    round_topic,
    task_topic,
)
from pfl_edge.split import take
from pfl_edge.topology import neighbours

from .blobs import BlobError, BlobStore, BlobTooLarge, sha256_hex
from .db import (
    SERVER,
    Blob,
    BlobRef,
    Device,
    Federation,
    Metric,
    Round,
    Update,
    hash_secret,
    hash_token,
    now,
    verify_secret,
)
from .fedmodel import FedModel, fed_model
from .mqtt import MqttLink

__all__ = ["ApiError", "Coordinator"]

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A refusal with its HTTP status; ``detail`` says what was wrong and what is valid."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Coordinator:
    def __init__(self, sessions: sessionmaker[Session], blobs: BlobStore, link: MqttLink | None, *,
                 device_broker_url: str, device_mqtt_password: str = "", max_blob_bytes: int = 64 << 20,
                 tick_s: float = 1.0) -> None:
        self.sessions = sessions
        self.blobs = blobs
        self.link = link
        self.device_broker_url = device_broker_url
        self.device_mqtt_password = device_mqtt_password
        self.max_blob_bytes = max_blob_bytes
        self.tick_s = tick_s
        self._lock = threading.RLock()  # every write transaction of this process
        self._step_lock = threading.Lock()  # state transitions: one at a time
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._republish = False
        self._thread: threading.Thread | None = None
        # (federation, whole-model digest, kp) -> digest of its base part
        self._base_cache: dict[tuple[str, str, int], str] = {}

    # ------------------------------------------------------------------------------------------------ plumbing

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._lock, self.sessions.begin() as s:
            yield s

    def _fed_locked(self, s: Session, fed_id: str) -> Federation:
        fed = s.get(Federation, fed_id, with_for_update=True)
        if fed is None:
            raise ApiError(404, f"unknown federation {fed_id!r}")
        return fed

    def _model(self, fed: Federation) -> FedModel:
        return fed_model(fed.config)

    def _decode_limit(self, fm: FedModel) -> int:
        dense = 4 * sum(math.prod(s) for s in fm.shapes.values())
        return max(self.max_blob_bytes, 2 * dense + (1 << 20))

    def _publish(self, topic: str, msg: Task | RoundAnnouncement) -> None:
        if self.link is not None:
            self.link.publish(topic, msg)

    def start(self) -> None:
        """Resume every unfinished federation, then run the worker (transitions and deadlines)."""
        self.recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pfl-rounds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def kick(self) -> None:
        self._wake.set()

    def request_republish(self) -> None:
        """From the MQTT thread: the broker came back; the worker re-publishes what devices must see now."""
        self._republish = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.tick_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if self._republish:
                    self._republish = False
                    self.recover()
                self.tick()
            except Exception:  # keep the worker alive; the next tick retries
                log.exception("round worker")

    def tick(self) -> None:
        with self.sessions() as s:
            ids = list(s.scalars(select(Federation.id).where(Federation.state != "finished")))
        for fed_id in ids:
            try:
                self.step(fed_id)
            except Exception:
                log.exception("federation %s: transition failed; will retry", fed_id)

    # --------------------------------------------------------------------------------------------------- auth

    def device_for_token(self, token: str | None) -> Device:
        if not token:
            raise ApiError(401, "missing bearer token: send 'Authorization: Bearer <device token>'")
        with self.sessions() as s:
            dev = s.scalar(select(Device).where(Device.token_hash == hash_token(token)))
        if dev is None:
            raise ApiError(401, "unknown or revoked device token")
        return dev

    # ----------------------------------------------------------------------------------------------- federations

    def create_federation(self, req: FederationCreate) -> FederationInfo:
        try:
            fm = fed_model(dict(req.config))
        except PflEdgeError as e:
            raise ApiError(422, f"config cannot run on devices: {e}") from None
        with self.sessions() as s:
            if s.get(Federation, req.id) is not None:
                raise ApiError(409, f"federation {req.id!r} already exists")
        init = fm.init_state()
        payload = encode(init, model_id=fm.model_id, round=0)
        digest = sha256_hex(payload)
        if not self.blobs.exists(digest):
            self.blobs.put(digest, payload)
        try:
            with self._write() as s:
                if s.get(Federation, req.id) is not None:
                    raise ApiError(409, f"federation {req.id!r} already exists")
                s.add(Federation(id=req.id, config=fm.cfg.to_dict(), enrol_secret_hash=hash_secret(req.enrol_secret),
                                 quorum=req.quorum, deadline_s=req.deadline_s, min_updates=req.min_updates,
                                 min_devices=req.min_devices,
                                 profile_capacity=req.profile_capacity, round=0, state="open", init_digest=digest,
                                 base_digest=digest))
                s.flush()
                self._add_ref(s, digest, len(payload), req.id, SERVER)
        except IntegrityError:
            raise ApiError(409, f"federation {req.id!r} already exists") from None
        info = self.federation_info(req.id)
        self._announce(req.id)
        return info

    def federation_info(self, fed_id: str) -> FederationInfo:
        with self.sessions() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                raise ApiError(404, f"unknown federation {fed_id!r}")
            n = s.scalar(select(func.count()).select_from(Device).where(Device.federation == fed_id)) or 0
            return FederationInfo(id=fed.id, config=fed.config, round=fed.round, state=fed.state,  # type: ignore[arg-type]
                                  devices=n, quorum=fed.quorum, deadline_s=fed.deadline_s,
                                  profile_capacity=fed.profile_capacity)

    # ------------------------------------------------------------------------------------------------- enrolment

    def enrol(self, req: EnrolRequest) -> Enrolment:
        with self.sessions() as s:
            fed0 = s.get(Federation, req.federation)
            if fed0 is None:
                raise ApiError(404, f"unknown federation {req.federation!r}")
            secret_hash = fed0.enrol_secret_hash
        if not verify_secret(req.enrol_secret, secret_hash):
            raise ApiError(403, f"wrong enrol secret for federation {req.federation!r}")
        try:
            profile = get_profile(req.profile)
        except UnknownNameError:
            raise ApiError(422, f"unknown device profile {req.profile!r}; valid profiles: "
                                f"{', '.join(list_profiles())}") from None
        token = secrets.token_urlsafe(32)
        dev_id = "dev-" + secrets.token_hex(8)
        with self._write() as s:
            fed = self._fed_locked(s, req.federation)
            fm = self._model(fed)
            cfg = fm.cfg
            again = None if req.nonce is None else s.scalar(
                select(Device).where(Device.federation == fed.id, Device.enrol_nonce == req.nonce))
            if again is not None:
                # the same device asking again (its first answer was lost): same slot, a fresh token
                again.token_hash = hash_token(token)
                dev_id, slot, density, kp = again.id, again.slot, again.density, again.kp
                fed_round, init_digest, config = again.joined_round, fed.init_digest, fed.config
            elif fed.state == "finished":
                raise ApiError(409, f"federation {fed.id!r} has finished its {cfg.rounds} rounds")
        if again is not None:
            init = init_digest if fm.decentral else self._base_for(req.federation, fm, init_digest, kp)
            log.info("federation %s: device %s enrolled again (same nonce)", req.federation, dev_id)
            return Enrolment(device_id=dev_id, token=token, index=slot, federation=req.federation, config=config,
                             density=density, kp=kp, broker_url=self.device_broker_url, mqtt_username=dev_id,
                             mqtt_password=self.device_mqtt_password, round=fed_round, init_digest=init)
        with self._write() as s:
            fed = self._fed_locked(s, req.federation)
            if fed.state == "finished":
                raise ApiError(409, f"federation {fed.id!r} has finished its {cfg.rounds} rounds")
            taken = set(s.scalars(select(Device.slot).where(Device.federation == fed.id)))
            free = [i for i in range(cfg.clients) if i not in taken]
            if not free:
                raise ApiError(409, f"federation {fed.id!r} is full: all {cfg.clients} slots are taken")
            if req.index is not None and req.index >= cfg.clients:
                raise ApiError(422, f"index {req.index} out of range: the federation has slots 0..{cfg.clients - 1}")
            slot = req.index if req.index is not None and req.index in free else free[0]
            if fed.profile_capacity:
                density, kp = float(profile.density), int(profile.kp)
            else:
                density, kp = cfg.client_density(slot), cfg.kp
            if fm.decentral or cfg.algorithm == "fedavg":
                kp = 0
            elif cfg.base == "linear":
                kp = cfg.kp  # the linear-base control builds a different model per kp: one kp per federation
            if kp > fm.num_blocks:
                raise ApiError(422, f"profile {profile.name!r} keeps {kp} personal blocks but model "
                                    f"{cfg.model!r} has only {fm.num_blocks}: {fm.model.block_names}")
            s.add(Device(id=dev_id, federation=fed.id, token_hash=hash_token(token), profile=profile.name,
                         name=req.name, slot=slot, density=density, kp=kp, online=False, joined_round=fed.round,
                         enrol_nonce=req.nonce))
            fed_round, init_digest, config = fed.round, fed.init_digest, fed.config
        init = init_digest if fm.decentral else self._base_for(req.federation, fm, init_digest, kp)
        self.kick()
        log.info("federation %s: device %s enrolled in slot %d (%s)", req.federation, dev_id, slot, profile.name)
        return Enrolment(device_id=dev_id, token=token, index=slot, federation=req.federation, config=config,
                         density=density, kp=kp, broker_url=self.device_broker_url, mqtt_username=dev_id,
                         mqtt_password=self.device_mqtt_password, round=fed_round, init_digest=init)

    # ----------------------------------------------------------------------------------------------------- blobs

    def _add_ref(self, s: Session, digest: str, size: int, fed_id: str, uploader: str) -> bool:
        if s.get(Blob, digest) is None:
            s.add(Blob(digest=digest, size=size))
            s.flush()
        if s.get(BlobRef, (digest, fed_id, uploader)) is None:
            s.add(BlobRef(digest=digest, federation=fed_id, uploader=uploader))
            return True
        return False

    def put_blob(self, dev: Device, digest: str, data: bytes) -> bool:
        """True if new for this device (201), False if it had already sent it (200)."""
        if len(data) > self.max_blob_bytes:
            raise ApiError(413, f"blob of {len(data)} bytes is over the limit of {self.max_blob_bytes} bytes")
        actual = sha256_hex(data)
        if actual != digest:
            raise ApiError(422, f"body has sha256 {actual}, the path names {digest}: the path must be the body's "
                                "sha256 (64 lowercase hex)")
        with self.sessions() as s:
            if s.get(BlobRef, (digest, dev.federation, dev.id)) is not None:
                return False  # the very same bytes, already checked and stored
            fed = s.get(Federation, dev.federation)
            assert fed is not None
            fm = self._model(fed)
        try:
            decode(data, expected=fm.shapes, model_id=fm.model_id, max_bytes=self._decode_limit(fm),
                   allow_missing=True)
        except CodecError as e:
            raise ApiError(422, f"payload refused: {e}") from None
        try:
            self.blobs.put(digest, data)
        except BlobTooLarge as e:
            raise ApiError(413, str(e)) from None
        except BlobError as e:
            raise ApiError(422, str(e)) from None
        with self._write() as s:
            return self._add_ref(s, digest, len(data), dev.federation, dev.id)

    def get_blob(self, fed_id: str | None, digest: str, reader: Device | None = None) -> bytes:
        """The blob, if ``reader`` (a device of ``fed_id``; None with ``fed_id`` None: the admin) may read it: what
        the server made (the initial model, averages), what the device itself uploaded, and in DisPFL the
        models of its in-neighbours of this round or the last. Another device's individual upload is never
        served in FedPer: an update can leak its owner's data."""
        with self.sessions() as s:
            if fed_id is not None:
                uploaders = set(s.scalars(select(BlobRef.uploader).where(BlobRef.digest == digest,
                                                                          BlobRef.federation == fed_id)))
                if not uploaders:
                    if s.get(Blob, digest) is not None:
                        raise ApiError(403, f"blob {digest} belongs to another federation")
                    raise ApiError(404, f"no blob {digest}")
                if reader is not None and not (SERVER in uploaders or reader.id in uploaders
                                               or self._neighbour_blob(s, fed_id, reader, uploaders)):
                    raise ApiError(403, f"blob {digest} is another device's upload; a device reads the server's "
                                        "models, its own uploads and (DisPFL) its current neighbours' models")
            elif s.get(Blob, digest) is None:
                raise ApiError(404, f"no blob {digest}")
        try:
            return self.blobs.get(digest)
        except KeyError:
            raise ApiError(404, f"no blob {digest} in the store") from None

    def _neighbour_blob(self, s: Session, fed_id: str, reader: Device, uploaders: set[str]) -> bool:
        fed = s.get(Federation, fed_id)
        assert fed is not None
        fm = self._model(fed)
        if not fm.decentral:
            return False
        slots = set(s.scalars(select(Device.slot).where(Device.id.in_(uploaders), Device.federation == fed_id)))
        for t in {fed.round, fed.round - 1} - {0, -1}:  # a device may still be on the last round's task
            if slots & set(neighbours(fm.cfg.topology_spec, fm.cfg.clients, t, fm.cfg.seed)[reader.slot]):
                return True
        return False

    def _store_server_blob(self, fed_id: str, payload: bytes) -> str:
        digest = sha256_hex(payload)
        if not self.blobs.exists(digest):
            self.blobs.put(digest, payload)
        with self._write() as s:
            self._add_ref(s, digest, len(payload), fed_id, SERVER)
        return digest

    def _load(self, digest: str, fm: FedModel, expected: dict[str, tuple[int, ...]] | None = None) -> Decoded:
        return decode(self.blobs.get(digest), expected=fm.shapes if expected is None else expected,
                      model_id=fm.model_id, max_bytes=max(DEFAULT_MAX_BYTES, self._decode_limit(fm)),
                      allow_missing=expected is None)

    def _base_for(self, fed_id: str, fm: FedModel, whole: str, kp: int) -> str:
        """Digest of the base part (for a device with ``kp``) of the whole model ``whole``; what a device receives
        holds no tensor that is personal to it."""
        # per federation: two federations with the same config share blobs, but each must hold a reference to
        # what its devices are sent (blob reads are checked per federation)
        key = (fed_id, whole, kp)
        hit = self._base_cache.get(key)
        if hit is not None:
            return hit
        d = self._load(whole, fm)
        keys = fm.base_keys(kp)
        digest = whole if set(keys) == set(d.tensors) else self._store_server_blob(
            fed_id, encode(take(d.tensors, keys), model_id=fm.model_id, round=d.round))
        self._base_cache[key] = digest
        return digest

    # --------------------------------------------------------------------------------------------------- updates

    def submit_update(self, dev: Device, t: int, req: UpdateRequest) -> UpdateAccepted:
        with self.sessions() as s:
            fed = s.get(Federation, dev.federation)
            assert fed is not None
            fm = self._model(fed)
            dup = s.scalar(select(Update).where(Update.federation == fed.id, Update.round == t,
                                                Update.device == dev.id))
            if dup is not None:
                return self._duplicate(s, dup, t, req)
            self._check_round(s, fed, fm, dev, t)
            if s.get(BlobRef, (req.digest, fed.id, dev.id)) is None:
                raise ApiError(422, f"blob {req.digest} was not uploaded by this device: PUT /v1/blobs/{req.digest} "
                                    "first")
        # the blob must be exactly what this device may send this round (decoded outside the lock)
        try:
            d = self._load(req.digest, fm, fm.expected(dev.kp))
        except CodecError as e:
            what = "its sparse model" if fm.decentral else f"exactly its base part (kp={dev.kp})"
            raise ApiError(422, f"update refused: a {fm.cfg.algorithm} device sends {what}: {e}") from None
        if d.round != t:
            raise ApiError(422, f"the payload's header is for round {d.round}, the update is posted for round {t}")
        with self._write() as s:
            fed = self._fed_locked(s, dev.federation)
            dup = s.scalar(select(Update).where(Update.federation == fed.id, Update.round == t,
                                                Update.device == dev.id))
            if dup is not None:  # a concurrent retry won the race
                return self._duplicate(s, dup, t, req)
            self._check_round(s, fed, fm, dev, t)  # the round may have closed meanwhile
            s.add(Update(federation=fed.id, round=t, device=dev.id, digest=req.digest, n_samples=req.n_samples,
                         train_loss=req.train_loss, train_s=req.train_s, bytes_down=req.bytes_down))
            s.flush()
            n = self._count(s, fed.id, t)
        self.kick()
        return UpdateAccepted(round=t, accepted=True, updates=n)

    def _count(self, s: Session, fed_id: str, t: int) -> int:
        return s.scalar(select(func.count()).select_from(Update).where(Update.federation == fed_id,
                                                                       Update.round == t)) or 0

    def _duplicate(self, s: Session, dup: Update, t: int, req: UpdateRequest) -> UpdateAccepted:
        if dup.digest != req.digest:
            raise ApiError(409, f"this device already sent a different update for round {t} ({dup.digest}); "
                                "one update per device and round")
        return UpdateAccepted(round=t, accepted=False, updates=self._count(s, dup.federation, t))

    def _check_round(self, s: Session, fed: Federation, fm: FedModel, dev: Device, t: int) -> None:
        if fed.state == "finished":
            raise ApiError(409, f"federation {fed.id!r} has finished (round {fed.round}); no more updates")
        if t == 0:
            if not fm.decentral:
                raise ApiError(409, f"round 0 takes no updates in {fm.cfg.algorithm}; the current round is "
                                    f"{fed.round}")
            return  # DisPFL: a device's initial sparse model, accepted whenever it enrols
        if t != fed.round or fed.state != "collecting":
            raise ApiError(409, f"round {t} is not collecting updates: the federation is in round {fed.round} "
                                f"({fed.state})")
        if dev.joined_round >= t:
            raise ApiError(409, f"device joined during round {dev.joined_round}; it takes part from round "
                                f"{dev.joined_round + 1}")
        if fm.decentral and s.scalar(select(Update.id).where(Update.federation == fed.id, Update.device == dev.id,
                                                             Update.round == 0)) is None:
            raise ApiError(409, "upload the initial sparse model as the update of round 0 first")

    # --------------------------------------------------------------------------------------------------- metrics

    def report_metrics(self, dev: Device, t: int, req: MetricsReport) -> None:
        with self._write() as s:
            fed = self._fed_locked(s, dev.federation)
            if not 0 <= t <= fed.round:
                raise ApiError(409, f"metrics for round {t}: the federation is in round {fed.round}; report rounds "
                                    f"0..{fed.round}")
            row = s.get(Metric, (fed.id, t, dev.id))
            values = req.model_dump()
            if row is None:
                s.add(Metric(federation=fed.id, round=t, device=dev.id, **values))
            else:
                for k, v in values.items():
                    setattr(row, k, v)
                row.reported_at = now()

    def metrics(self, fed_id: str) -> dict[str, Any]:
        with self.sessions() as s:
            if s.get(Federation, fed_id) is None:
                raise ApiError(404, f"unknown federation {fed_id!r}")
            rounds = {r.round: r for r in s.scalars(select(Round).where(Round.federation == fed_id))}
            counts = dict(s.execute(select(Update.round, func.count()).where(Update.federation == fed_id)
                                    .group_by(Update.round)).all())
            per: dict[int, dict[str, dict[str, Any]]] = {}
            for m in s.scalars(select(Metric).where(Metric.federation == fed_id)):
                per.setdefault(m.round, {})[m.device] = {
                    "accuracy": m.accuracy, "loss": m.loss, "n_test": m.n_test, "bytes_up": m.bytes_up,
                    "bytes_down": m.bytes_down, "step_ms": m.step_ms, "train_s": m.train_s}
        out = []
        for t in sorted(set(rounds) | set(per) | set(counts)):
            r = rounds.get(t)
            devs = per.get(t, {})
            accs = [d["accuracy"] for d in devs.values()]
            out.append({
                "round": t,
                "state": r.state if r else None,
                "updates": counts.get(t, 0),
                "active": r.active if r else None,
                "mean_accuracy": sum(accs) / len(accs) if accs else None,
                "wall_s": (r.closed_at - r.opened_at) if r and r.closed_at is not None else None,
                "devices": devs,
            })
        return {"federation": fed_id, "rounds": out}

    def devices(self, fed_id: str) -> list[dict[str, Any]]:
        with self.sessions() as s:
            if s.get(Federation, fed_id) is None:
                raise ApiError(404, f"unknown federation {fed_id!r}")
            stats = {row[0]: row[1:] for row in s.execute(
                select(Update.device, func.max(Update.round), func.coalesce(func.sum(Blob.size), 0),
                       func.coalesce(func.sum(Update.bytes_down), 0))
                .join(Blob, Blob.digest == Update.digest).where(Update.federation == fed_id)
                .group_by(Update.device))}
            out = []
            for d in s.scalars(select(Device).where(Device.federation == fed_id).order_by(Device.slot)):
                last, up, down = stats.get(d.id, (None, 0, 0))
                out.append({"device_id": d.id, "name": d.name, "profile": d.profile, "index": d.slot,
                            "density": d.density, "kp": d.kp, "online": d.online, "last_seen": d.last_seen,
                            "joined_round": d.joined_round, "last_round": last, "bytes_up": int(up),
                            "bytes_down": int(down)})
        return out

    # ---------------------------------------------------------------------------------------------------- status

    def on_status(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) != 5 or not payload:
            return  # a cleared retained message, or not ours
        fed_id, dev_id = parts[1], parts[3]
        try:
            st = DeviceStatus.model_validate_json(payload)
        except ValueError:
            log.warning("malformed status on %s", topic)
            return
        if st.device_id != dev_id:
            return
        with self._write() as s:
            dev = s.get(Device, dev_id)
            if dev is None or dev.federation != fed_id:
                return
            dev.online = st.state == "online"
            dev.last_seen = now()

    # ------------------------------------------------------------------------------------------- state machine

    def _active(self, s: Session, fed: Federation, fm: FedModel, t: int) -> list[Device]:
        """Devices that take part in round ``t``: enrolled before it opened (and, DisPFL, with a model)."""
        devs = list(s.scalars(select(Device).where(Device.federation == fed.id, Device.joined_round < t)
                              .order_by(Device.slot)))
        if fm.decentral:
            have = set(s.scalars(select(Update.device).where(Update.federation == fed.id, Update.round == 0)))
            devs = [d for d in devs if d.id in have]
        return devs

    def step(self, fed_id: str) -> None:
        """Make every transition that is due for this federation (idempotent; safe to call any time)."""
        with self._step_lock:
            for _ in range(4):  # e.g. closing -> published -> open -> collecting in one call
                if not self._step_once(fed_id):
                    return

    def _step_once(self, fed_id: str) -> bool:
        """One due transition, if any; True if it made one."""
        with self.sessions() as s:
            fed = s.get(Federation, fed_id)
            if fed is None or fed.state == "finished":
                return False
            fm = self._model(fed)
            t, state = fed.round, fed.state
            if t == 0:
                ready = len(self._active(s, fed, fm, 1)) >= min(fed.min_devices or fm.cfg.clients, fm.cfg.clients)
            elif state == "collecting":
                r = s.get(Round, (fed_id, t))
                assert r is not None
                n = self._count(s, fed_id, t)
                ready = n >= r.active or n >= math.ceil(fed.quorum * r.active - 1e-9) or (
                    time.time() >= r.deadline and n >= fed.min_updates)
            else:
                ready = True
        if not ready:
            return False
        if t == 0:
            self._open(fed_id, 1)
        elif state == "open":
            self._collect(fed_id, t)
        elif state == "collecting":
            with self._write() as w:
                f = self._fed_locked(w, fed_id)
                if f.round != t or f.state != "collecting":
                    return True
                f.state = "closing"
                rr = w.get(Round, (fed_id, t))
                assert rr is not None
                rr.state = "closing"
            self._announce(fed_id)
        elif state == "closing":
            self._close(fed_id, t)
        elif state == "published":
            if t >= fm.cfg.rounds:
                self._finish(fed_id)
            else:
                self._open(fed_id, t + 1)
        return True

    def _open(self, fed_id: str, t: int) -> None:
        with self._write() as s:
            fed = self._fed_locked(s, fed_id)
            fm = self._model(fed)
            n = len(self._active(s, fed, fm, t))
            opened = now()
            deadline = opened + fed.deadline_s
            if s.get(Round, (fed_id, t)) is None:
                s.add(Round(federation=fed_id, round=t, state="open", opened_at=opened, deadline=deadline, active=n,
                            start_digest=None if fm.decentral else fed.base_digest))
            fed.round, fed.state, fed.round_deadline = t, "open", deadline
        log.info("federation %s: round %d open (%d devices)", fed_id, t, n)
        self._collect(fed_id, t)

    def _collect(self, fed_id: str, t: int) -> None:
        tasks = self._tasks(fed_id, t)  # prepares every blob a task names before anyone is told
        with self._write() as s:
            fed = self._fed_locked(s, fed_id)
            if fed.round != t or fed.state != "open":
                return
            fed.state = "collecting"
            r = s.get(Round, (fed_id, t))
            assert r is not None
            r.state = "collecting"
        for dev_id, task in tasks:
            self._publish(task_topic(fed_id, dev_id), task)
        self._announce(fed_id)

    def _tasks(self, fed_id: str, t: int, *, final: bool = False) -> list[tuple[str, Task]]:
        with self.sessions() as s:
            fed = s.get(Federation, fed_id)
            r = s.get(Round, (fed_id, t))
            assert fed is not None and r is not None
            fm = self._model(fed)
            # the final task goes to every device, a late joiner of the last round too: each evaluates and stops
            devs = (list(s.scalars(select(Device).where(Device.federation == fed_id).order_by(Device.slot)))
                    if final else self._active(s, fed, fm, t))
            algo = fm.cfg.algorithm
            if fm.decentral:
                latest = self._latest_models(s, fed_id, t)
                by_slot = {d.slot: d for d in s.scalars(select(Device).where(Device.federation == fed_id))}
                nbrs = neighbours(fm.cfg.topology_spec, fm.cfg.clients, t, fm.cfg.seed)
                out = []
                for d in devs:
                    ns = [Neighbour(index=j, device_id=by_slot[j].id, digest=latest[by_slot[j].id])
                          for j in nbrs[d.slot] if j in by_slot and by_slot[j].id in latest]
                    out.append((d.id, Task(federation=fed_id, round=t, algorithm=algo, neighbours=ns,
                                           deadline=r.deadline)))
                return out
            whole = r.base_digest if final else r.start_digest
            assert whole is not None
            kps = [(d.id, d.kp) for d in devs]
            deadline = r.deadline
        return [(dev_id, Task(federation=fed_id, round=t, algorithm=algo, base=self._base_for(fed_id, fm, whole, kp),
                              deadline=deadline, final=final)) for dev_id, kp in kps]

    def _latest_models(self, s: Session, fed_id: str, t: int) -> dict[str, str]:
        """DisPFL: every device's latest sparse model from before round ``t``."""
        rows = s.execute(select(Update.device, Update.round, Update.digest)
                         .where(Update.federation == fed_id, Update.round < t))
        best: dict[str, tuple[int, str]] = {}
        for dev, rnd, digest in rows:
            if dev not in best or rnd > best[dev][0]:
                best[dev] = (rnd, digest)
        return {d: v[1] for d, v in best.items()}

    def _close(self, fed_id: str, t: int) -> None:
        with self.sessions() as s:
            fed = s.get(Federation, fed_id)
            r = s.get(Round, (fed_id, t))
            assert fed is not None and r is not None
            fm = self._model(fed)
            start = r.start_digest
            ups = [(u.digest, u.n_samples, kp) for u, kp in s.execute(
                select(Update, Device.kp).join(Device, Device.id == Update.device)
                .where(Update.federation == fed_id, Update.round == t).order_by(Device.slot))]
        result: str | None = None
        if not fm.decentral:
            assert start is not None
            new = self._average(fm, start, ups)
            result = self._store_server_blob(fed_id, encode(new, model_id=fm.model_id, round=t))
        with self._write() as s:
            fed = self._fed_locked(s, fed_id)
            if fed.round != t or fed.state != "closing":
                return
            rr = s.get(Round, (fed_id, t))
            assert rr is not None
            rr.state, rr.closed_at, rr.base_digest = "published", now(), result
            fed.state = "published"
            if result is not None:
                fed.base_digest = result
        log.info("federation %s: round %d closed with %d updates", fed_id, t, len(ups))

    def _average(self, fm: FedModel, start: str, ups: list[tuple[str, int, int]]) -> dict[str, Tensor]:
        """FedPer: per tensor, sum(n_j x_j) / sum(n_j) in float64 over the devices that sent it, in slot order (so
        the result does not depend on which device finished first, and equals ``pfl_edge.aggregate.weighted_average``
        over the simulator's clients bit for bit when every device sends the same tensors); a tensor no device
        sent keeps its value. One update decoded at a time."""
        prev = self._load(start, fm).tensors
        acc: dict[str, Tensor] = {}
        total: dict[str, float] = {}
        for digest, n, kp in ups:
            w = float(n)
            for k, v in self._load(digest, fm, fm.expected(kp)).tensors.items():
                contrib = v.detach().to(torch.float64) * w
                if k in acc:
                    acc[k] += contrib
                    total[k] += w
                else:
                    acc[k] = contrib
                    total[k] = 0.0 + w
        return {k: (acc[k] / total[k]).to(v.dtype) if k in acc else v for k, v in prev.items()}

    def _finish(self, fed_id: str) -> None:
        with self._write() as s:
            fed = self._fed_locked(s, fed_id)
            if fed.state != "published":
                return
            fed.state = "finished"
            t = fed.round
            decentral = self._model(fed).decentral
        log.info("federation %s: finished after round %d", fed_id, t)
        if not decentral:
            self._publish_final(fed_id, t)
        self._announce(fed_id)

    def _publish_final(self, fed_id: str, t: int) -> None:
        """FedPer's last step: every device evaluates its personal blocks on the last base and reports round t."""
        for dev_id, task in self._tasks(fed_id, t, final=True):
            self._publish(task_topic(fed_id, dev_id), task)

    def _announce(self, fed_id: str) -> None:
        with self.sessions() as s:
            fed = s.get(Federation, fed_id)
            if fed is None:
                return
            fm = self._model(fed)
            msg = RoundAnnouncement(federation=fed_id, round=fed.round, state=fed.state,  # type: ignore[arg-type]
                                    base=None if fm.decentral else fed.base_digest, deadline=fed.round_deadline)
        self._publish(round_topic(fed_id), msg)

    def recover(self) -> None:
        """After a (re)start: finish half-done transitions and re-publish what devices must see now."""
        with self.sessions() as s:
            feds = [(f.id, f.round, f.state) for f in s.scalars(select(Federation))]
        for fed_id, t, state in feds:
            try:
                if state == "collecting":
                    for dev_id, task in self._tasks(fed_id, t):
                        self._publish(task_topic(fed_id, dev_id), task)
                    self._announce(fed_id)
                elif state == "finished":
                    with self.sessions() as s:
                        fed = s.get(Federation, fed_id)
                        decentral = fed is not None and self._model(fed).decentral
                    if not decentral and t >= 1:
                        self._publish_final(fed_id, t)
                    self._announce(fed_id)
                else:
                    self._announce(fed_id)
                    self.step(fed_id)
            except Exception:
                log.exception("federation %s: recovery failed; the worker will retry", fed_id)
