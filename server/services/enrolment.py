"""Federations and their devices: creation (admin), enrolment with the federation's secret (a slot, a capacity
and a token; idempotent by the device's nonce), and authentication of device tokens."""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import exists, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased
from starlette.concurrency import run_in_threadpool

from device_profiles import Profile, get_profile, list_profiles
from pfl_edge.codec import encode
from pfl_edge.errors import InternalError, PflEdgeError, UnknownNameError
from pfl_edge.federation import device_capacity
from pfl_edge.privacy import new_key, secret_draw
from pfl_edge.protocol import (
    PROTOCOL_VERSIONS,
    Enrolment,
    EnrolRequest,
    FederationCreate,
    FederationInfo,
    KeyProof,
)

from ..db import SERVER, Device, Federation, hash_secret, hash_token, now
from ..enrol_gate import EnrolGate
from ..errors import Conflict, Forbidden, NotFound, Unauthorized, Unprocessable
from ..fedmodel import fed_model
from ..ratelimit import Buckets
from ..states import ENROLMENT_ROUND, RoundState
from . import identity
from .blob_access import BlobAccess
from .store import Store

__all__ = ["EnrolmentService"]

log = logging.getLogger(__name__)
_PROBES = 16  # random probes for a free slot of a sampled federation before the lowest free one


@dataclass(frozen=True)
class _Enrolled:
    """What an enrolment answers with, read inside its transaction."""

    device_id: str
    slot: int
    density: float
    kp: int
    round: int
    init_digest: str
    config: dict[str, object]
    client_id: str | None


class EnrolmentService:
    def __init__(self, store: Store, blobs: BlobAccess, *, device_broker_url: str, device_mqtt_password: str,
                 on_enrolled: Callable[[], None], on_created: Callable[[str], None], token_ttl_s: float = 30 * 86400.0,
                 gate: EnrolGate | None = None, on_revoked: Callable[[str], None] | None = None,
                 token_max_lifetime_s: float = 30 * 86400.0, speaks: tuple[int, ...] = PROTOCOL_VERSIONS) -> None:
        self.store = store
        self.speaks = speaks  # the protocol versions it answers devices in (docs/protocol.md, "Versions")
        self.token_ttl_s = token_ttl_s  # a device token's lifetime; the agent rotates its own before the end
        self.token_max_lifetime_s = token_max_lifetime_s  # a token chain's (rotate_token)
        self.rng: random.Random = random.SystemRandom()  # draws sampled federations' slots (tests seed their own)
        self.gate = gate or EnrolGate(Buckets(1.0, 20), Buckets(5.0, 100))
        self.on_revoked = on_revoked or (lambda dev_id: None)  # the broker forgets the device's credentials
        self.blobs = blobs
        self.device_broker_url = device_broker_url
        self.device_mqtt_password = device_mqtt_password
        # a device's MQTT password and its hash to keep (None: keep nothing), and the broker told of it where it
        # keeps accounts of its own; the coordinator sets them from BrokerAccess
        self.mqtt_password: Callable[[tuple[str, str, str] | None], tuple[str, str | None]] = (
            lambda derive: (device_mqtt_password, None))
        self.provision: Callable[[str, str, str, str | None], None] = lambda fed_id, dev_id, password, client: None
        self.mqtt_token: Callable[[str], str | None] | None = None  # jwt mode: a device's broker token now
        self.on_enrolled = on_enrolled  # wakes the round worker: enrolment may open round 1
        self.on_created = on_created  # announces a new federation

    # ----------------------------------------------------------------------------------------- federations

    def create_federation(self, req: FederationCreate) -> FederationInfo:
        try:
            fm = fed_model(dict(req.config))
        except PflEdgeError as e:
            raise Unprocessable(f"config cannot run on devices: {e}") from None
        with self.store.read() as s:
            if s.get(Federation, req.id) is not None:
                raise Conflict(f"federation {req.id!r} already exists")
        payload = encode(fm.init_state(), model_id=fm.model_id, round=ENROLMENT_ROUND)
        limit = self.store.max_blob_bytes
        if len(payload) > limit:  # its devices could never upload a model of this size either
            raise Unprocessable(f"model {fm.cfg.model!r} takes {len(payload)} bytes on the wire, over this server's "
                                f"max_blob_bytes of {limit}: raise PFL_MAX_BLOB_BYTES or pick a smaller model")
        dp = fm.cfg.dp
        if dp is not None and req.aggregation is not None and req.aggregation.rule != "mean":
            raise Unprocessable(f"aggregation rule {req.aggregation.rule!r} with differential privacy: the private "
                                "mean bounds every update to privacy.clip itself; leave the rule 'mean'")
        noise_key = new_key().hex() if dp is not None and dp.secret_noise else None
        # the draw's key, apart from the noise's: an admin may hand it to the simulator without the noise's
        sampling_key = new_key().hex() if secret_draw(fm.cfg) else None
        digest = self.blobs.keep(payload)
        try:
            with self.store.write(blobs="store") as s:
                if not self.blobs.blobs.exists(digest):  # collected meanwhile (server.services.gc): again
                    self.blobs.blobs.put(digest, payload)
                if s.get(Federation, req.id) is not None:
                    raise Conflict(f"federation {req.id!r} already exists")
                s.add(Federation(id=req.id, config=fm.cfg.to_dict(), enrol_secret_hash=hash_secret(req.enrol_secret),
                                 quorum=req.quorum, deadline_s=req.deadline_s, min_updates=req.min_updates,
                                 min_devices=req.min_devices, profile_capacity=req.profile_capacity,
                                 aggregation=None if req.aggregation is None else req.aggregation.model_dump(),
                                 round=ENROLMENT_ROUND, state=RoundState.OPEN.value, init_digest=digest,
                                 base_digest=digest, noise_key=noise_key,
                                 sampling_key=sampling_key))
                s.flush()
                self.blobs.add_ref(s, digest, len(payload), req.id, SERVER)
        except IntegrityError:
            raise Conflict(f"federation {req.id!r} already exists") from None
        info = self.federation_info(req.id)
        self.on_created(req.id)
        return info

    def federation_info(self, fed_id: str) -> FederationInfo:
        with self.store.read() as s:
            fed = self.store.federation(s, fed_id)
            n = s.scalar(select(func.count()).select_from(Device).where(Device.federation == fed_id)) or 0
            return FederationInfo(id=fed.id, config=fed.config, round=fed.round, state=fed.state,  # type: ignore[arg-type]
                                  devices=n, quorum=fed.quorum, deadline_s=fed.deadline_s,
                                  profile_capacity=fed.profile_capacity)

    # ------------------------------------------------------------------------------------------- devices

    def authenticate(self, token: str | None) -> Device:
        """The device holding ``token``."""
        if not token:
            raise Unauthorized("missing bearer token: send 'Authorization: Bearer <device token>'")
        with self.store.read() as s:
            dev = s.scalar(select(Device).where(Device.token_hash == hash_token(token)))
        if dev is None:
            raise Unauthorized("unknown or revoked device token")
        if dev.revoked_at is not None:
            raise Unauthorized(f"device {dev.id} was revoked by the operator")
        if dev.token_expires is not None and dev.token_expires <= now():
            raise Unauthorized(f"the token of device {dev.id} expired; a device rotates its token before it "
                               "expires (POST /v1/devices/me/token), or enrols again with its nonce")
        return dev

    def enrol(self, req: EnrolRequest, address: str = "") -> Enrolment:
        """Enrol a device (``address``: the client's, for the rate limit), from a thread of the caller's."""
        version = identity.version(req, self.speaks)
        self.gate.check(req.federation, req.enrol_secret, self._secret_hash(req.federation), address)
        return self._enrol_admitted(req, self._profile(req), version)

    async def enrol_async(self, req: EnrolRequest, address: str = "") -> Enrolment:
        """:meth:`enrol` for the event loop: the database work in the threadpool, the secret's KDF awaited on the
        gate's own pool, so guesses (a scrypt each) never hold the request threads that device calls need."""
        version = identity.version(req, self.speaks)
        stored = await run_in_threadpool(self._secret_hash, req.federation)
        await self.gate.acheck(req.federation, req.enrol_secret, stored, address)
        return await run_in_threadpool(self._enrol_admitted, req, self._profile(req), version)

    def _enrol_admitted(self, req: EnrolRequest, profile: Profile, version: int = 1) -> Enrolment:
        """Enrol a device whose secret the gate passed: one write transaction, on the federation's locked row."""
        token = secrets.token_urlsafe(32)
        with self.store.write() as s:
            fed = self.store.locked(s, req.federation)
            # with a nonce, the same password for every enrolment of this device (broker_access's docstring)
            password, keep = self.mqtt_password(None if req.nonce is None else
                                                (self._mqtt_key(fed), req.nonce, req.enrol_secret))
            got = self._again(s, fed, req, token, keep, password, version)
            again = got is not None
            if got is None:
                got = self._new(s, fed, req, token, profile, keep, password, version)
        if again:
            log.info("federation %s: device %s enrolled again (same nonce)", req.federation, got.device_id)
        else:
            self.on_enrolled()
            log.info("federation %s: device %s enrolled in slot %d (%s)", req.federation, got.device_id, got.slot,
                     profile.name)
        self.provision(req.federation, got.device_id, password, got.client_id)
        password = (self.mqtt_token(got.device_id) if self.mqtt_token is not None else None) or password
        fm = fed_model(got.config)
        return Enrolment(device_id=got.device_id, token=token, index=got.slot, federation=req.federation,
                         config=got.config, density=got.density, kp=got.kp, broker_url=self.device_broker_url,
                         mqtt_username=got.device_id, mqtt_password=password, round=got.round,
                         mqtt_client_id=got.client_id, protocol=version if req.protocols else None,
                         init_digest=self.blobs.base_for(req.federation, fm, got.init_digest, got.kp),
                         init_model=got.init_digest)

    def _secret_hash(self, fed_id: str) -> str | None:
        """The federation's secret hash, None if there is no such federation (the gate refuses it as a wrong
        secret; rate limits and the verify cache: ``server.enrol_gate.EnrolGate``)."""
        with self.store.read() as s:
            fed = s.get(Federation, fed_id)
            return None if fed is None else fed.enrol_secret_hash

    @staticmethod
    def _profile(req: EnrolRequest) -> Profile:
        """The device's profile (asked once the gate passed its secret)."""
        try:
            return get_profile(req.profile)
        except UnknownNameError:
            raise Unprocessable(f"unknown device profile {req.profile!r}; valid profiles: "
                                f"{', '.join(list_profiles())}") from None

    def _again(self, s: Session, fed: Federation, req: EnrolRequest, token: str, mqtt: str | None, password: str,
               version: int) -> _Enrolled | None:
        """The same device asking again with its nonce (its first answer was lost, or its token chain ended): same
        slot, a fresh token. A device that enrolled with a key must prove it holds it (``proven``); one that
        enrolled without gets the key it shows now (an agent upgraded since: trust on its first key)."""
        again = None if req.nonce is None else s.scalar(
            select(Device).where(Device.federation == fed.id, Device.enrol_nonce == req.nonce))
        if again is None:
            self._check_open(fed)
            return None
        if again.revoked_at is not None:
            raise Forbidden(f"device {again.id} was revoked by the operator; it cannot enrol again")
        identity.take_enrol_proof(again, req)
        client = identity.client_id(version, password, again.id)
        again.mqtt_client, again.protocol = client, version
        at = now()  # it showed the secret: a new token chain
        again.token_hash, again.token_expires, again.token_origin = hash_token(token), self._expiry(at, at), at
        if mqtt is not None:
            again.mqtt_hash = mqtt
        if req.platform is not None:  # it may have been upgraded since (a new runtime, another Python)
            again.platform = req.platform.model_dump()
        # a row of an earlier release kept the config's density for an algorithm with no mask (it trains dense)
        again.density = self.store.model(fed).algorithm().mask_density(again.density)
        return _Enrolled(again.id, again.slot, again.density, again.kp, again.joined_round, fed.init_digest,
                         fed.config, client)

    @staticmethod
    def _mqtt_key(fed: Federation) -> str:
        """The federation's key for derived MQTT passwords, made at its first use (its row is locked)."""
        if fed.mqtt_key is None:
            fed.mqtt_key = secrets.token_hex(32)
        return fed.mqtt_key

    @staticmethod
    def _check_open(fed: Federation) -> None:
        if fed.state == RoundState.FINISHED:
            raise Conflict(f"federation {fed.id!r} has finished its {fed_model(fed.config).cfg.rounds} rounds")

    def _new(self, s: Session, fed: Federation, req: EnrolRequest, token: str, profile: Profile,
             mqtt: str | None, password: str, version: int) -> _Enrolled:
        slot = self._slot(s, fed, req.index)
        fm = self.store.model(fed)
        density, kp = device_capacity(fm.cfg, slot,
                                      profile_density=profile.density if fed.profile_capacity else None,
                                      profile_kp=profile.kp if fed.profile_capacity else None)
        if kp > fm.num_blocks:
            raise Unprocessable(f"profile {profile.name!r} keeps {kp} personal blocks but model "
                                f"{fm.cfg.model!r} has only {fm.num_blocks}: {fm.model.block_names}")
        private = fm.cfg.privacy is not None or fm.cfg.secure_aggregation is not None
        if private and kp != device_capacity(fm.cfg, slot)[1]:
            # the private mean divides every tensor by the expected count: a base only some devices send would
            # shrink towards its start (docs/privacy.md); a secure round sums one vector of one length
            raise Unprocessable(f"profile {profile.name!r} keeps {kp} personal blocks; this federation is private "
                                f"and its devices share one base (K_P {device_capacity(fm.cfg, slot)[1]})")
        dev_id, at = "dev-" + secrets.token_hex(8), now()
        client = identity.client_id(version, password, dev_id)
        dev = Device(id=dev_id, federation=fed.id, token_hash=hash_token(token), profile=profile.name,
                     name=req.name, slot=slot, density=density, kp=kp, online=False, joined_round=fed.round,
                     enrol_nonce=req.nonce, declared_samples=req.n_samples, mqtt_hash=mqtt,
                     token_expires=self._expiry(at, at), token_origin=at, mqtt_client=client, protocol=version,
                     platform=None if req.platform is None else req.platform.model_dump())
        identity.take_enrol_proof(dev, req)
        s.add(dev)
        return _Enrolled(dev_id, slot, density, kp, fed.round, fed.init_digest, fed.config, client)

    def _slot(self, s: Session, fed: Federation, asked: int | None) -> int:
        """The slot asked for if it is free, else the lowest free one (in SQL, on the (federation, slot) index:
        an enrolment must not load every device of a large fleet). Where rounds sample their devices, the draw
        is public (the config's seed), so a device must not pick a slot a round draws: the one asked for is
        ignored and a free slot is drawn at random (a few probes, then the lowest free)."""
        cfg = fed_model(fed.config).cfg
        clients = cfg.clients
        mine = (Device.federation == fed.id,)
        if (s.scalar(select(func.count()).select_from(Device).where(*mine)) or 0) >= clients:
            raise Conflict(f"federation {fed.id!r} is full: all {clients} slots are taken")
        if asked is not None and asked >= clients:
            raise Unprocessable(f"index {asked} out of range: the federation has slots 0..{clients - 1}")
        if cfg.participation < 1:
            asked = None
            for _ in range(_PROBES):
                probe = self.rng.randrange(clients)
                if s.scalar(select(Device.id).where(*mine, Device.slot == probe)) is None:
                    return probe
        if asked is not None and s.scalar(select(Device.id).where(*mine, Device.slot == asked)) is None:
            return asked
        if s.scalar(select(Device.id).where(*mine, Device.slot == 0)) is None:
            return 0
        other = aliased(Device)
        gap = s.scalar(select(func.min(Device.slot + 1)).where(*mine, Device.slot + 1 < clients, ~exists().where(
            other.federation == fed.id, other.slot == Device.slot + 1)))
        if gap is None:
            raise InternalError(f"federation {fed.id!r} has fewer than {clients} devices and no free slot")
        return int(gap)

    # ------------------------------------------------------------------------ rotation and revocation

    def _expiry(self, origin: float, at: float) -> float:
        """When a token issued at ``at`` in a chain that began at ``origin`` expires."""
        return min(at + self.token_ttl_s, origin + self.token_max_lifetime_s)

    def rotate_token(self, dev_id: str, *, own: bool = False, proof: KeyProof | None = None) -> tuple[str, float]:
        """A fresh token for the device (the old one is dead at once) and when it expires. ``own``: the device
        rotates its own token, in its chain: the new one expires no later than ``token_max_lifetime_s`` after
        the chain began (its last enrolment with the secret, or the admin's last rotation), and past that the
        rotation is refused (401; the device enrols again with its secret and nonce), so a stolen token cannot
        be kept alive by rotating it. A device that enrolled with a key signs its own rotation (``proof``: 401
        without one, so a stolen token dies at its expiry). The admin's rotation (not ``own``) starts a new chain."""
        token, at = secrets.token_urlsafe(32), now()
        with self.store.write() as s:
            dev = s.get(Device, dev_id, with_for_update=True)
            if dev is None or dev.revoked_at is not None:
                raise Unauthorized(f"device {dev_id} is unknown or revoked")
            if own:
                identity.take_rotation_proof(dev, proof)
            # a row from before schema 9 has no origin: its chain starts at this rotation
            origin = dev.token_origin if own and dev.token_origin is not None else at
            if at - origin >= self.token_max_lifetime_s:
                raise Unauthorized(f"the tokens of device {dev_id} descend from an enrolment older than the "
                                   f"server's device_token_max_lifetime_s ({self.token_max_lifetime_s:.0f} s): "
                                   "enrol again with the enrolment secret and the device's nonce")
            expires = self._expiry(origin, at)
            dev.token_hash, dev.token_expires, dev.token_origin = hash_token(token), expires, origin
        log.info("device %s: token rotated%s", dev_id, "" if own else " (by the admin: a new chain)")
        return token, expires

    def device_of(self, fed_id: str, dev_id: str) -> Device:
        """A device of the federation; NotFound otherwise."""
        with self.store.read() as s:
            self.store.federation(s, fed_id)
            dev = s.get(Device, dev_id)
        if dev is None or dev.federation != fed_id:
            raise NotFound(f"no device {dev_id!r} in federation {fed_id!r}")
        return dev

    def revoke(self, fed_id: str, dev_id: str) -> float:
        """Revoke a device: its token is refused from now on, it takes no part in later rounds, and the broker
        drops its credentials. Idempotent; returns when it was revoked."""
        self.device_of(fed_id, dev_id)
        with self.store.write() as s:
            dev = s.get(Device, dev_id, with_for_update=True)
            if dev is None:
                raise NotFound(f"no device {dev_id!r} in federation {fed_id!r}")
            if dev.revoked_at is None:
                dev.revoked_at = now()
            at = dev.revoked_at
        self.on_revoked(dev_id)
        log.warning("federation %s: device %s revoked", fed_id, dev_id)
        return at

    def set_enrol_secret(self, fed_id: str, secret: str) -> None:
        """A new enrolment secret (the old one is refused from now on; enrolled devices keep their tokens)."""
        new_hash = hash_secret(secret)
        with self.store.write() as s:
            self.store.locked(s, fed_id).enrol_secret_hash = new_hash
        self.gate.forget(fed_id)
        log.warning("federation %s: enrolment secret rotated", fed_id)
