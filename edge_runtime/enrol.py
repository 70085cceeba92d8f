"""A device's enrolment: once with the federation's secret (``enrol``; a retry whose answer was lost gets the same
device back through the nonce kept in the state dir), and again when its token chain ends (``renew``: the server
refused a rotation or a call with 401, the token expired or its chain reached the server's absolute lifetime):
the same nonce brings back the same device and slot with a new chain, and the state dir carries on.

The device's key (``DeviceKey``, pfl_edge.device_key) is made with the nonce, before the first request; every
enrolment and every token rotation is signed with it, each attempt with a counter raised and saved first, so that
whoever learns the nonce (or steals the token) cannot take this device's slot while the key stays here."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from pfl_edge.device_key import enrol_message, new_key, public_of, rotate_message, sign
from pfl_edge.errors import ConfigError
from pfl_edge.protocol import API_PREFIX, PROTOCOL_VERSIONS, Enrolment, EnrolRequest, KeyProof, Platform

from .config import AgentConfig
from .http import Http, ServerError
from .state import StateDir

__all__ = ["DeviceKey", "enrol", "renew"]

_KEY_FILE = "device-key.json"
# a server of an earlier release refuses them (422): left out
_NEW_FIELDS = ("platform", "public_key", "proof", "protocols")


class DeviceKey:
    """The device's Ed25519 key and signing counter, in the state dir (0600); made on first use."""

    def __init__(self, store: StateDir) -> None:
        self.store = store
        saved = store.read_json(_KEY_FILE) or {}
        key, counter = saved.get("key"), saved.get("counter", 0)
        if not (isinstance(key, str) and len(key) == 64 and isinstance(counter, int)):
            key, counter = new_key(), 0
            store.write_json(_KEY_FILE, {"key": key, "counter": counter}, private=True)
        self._key, self._counter = key, counter
        self.public = public_of(key)

    def prove(self, message: Callable[[int], bytes]) -> KeyProof:
        """A proof over ``message(counter)`` with the next counter, saved before it is used (a proof is never
        signed twice with one counter, even across a crash)."""
        self._counter += 1
        self.store.write_json(_KEY_FILE, {"key": self._key, "counter": self._counter}, private=True)
        return KeyProof(counter=self._counter, signature=sign(self._key, message(self._counter)))

    def rotation_of(self, device_id: str) -> Callable[[], dict[str, Any]]:
        """The body of each of the device's signed token rotations (protocol.TokenRotation), a new proof a call."""
        return lambda: {"proof": self.prove(lambda c: rotate_message(device_id, c)).model_dump()}


def enrol(store: StateDir, http: Http, cfg: AgentConfig, platform: Platform | None = None) -> Enrolment:
    """The device's enrolment: the saved one, or a new one (with ``cfg``'s secret, saying it is ``platform``)."""
    saved = store.enrolment
    if saved is not None:
        enr = Enrolment.model_validate(saved)
        if enr.federation != cfg.federation:
            raise ConfigError(f"state dir {cfg.state_dir} belongs to federation {enr.federation!r}, "
                              f"not {cfg.federation!r}; use another --state-dir")
        http.rotation_body = DeviceKey(store).rotation_of(enr.device_id)
        return enr
    # the nonce is kept before asking: a retry (here, or after a restart) whose first answer was lost gets
    # this device back instead of enrolling a second one; it stays, for ``renew``
    pending = store.read_json("enrol-nonce.json") or {}
    nonce = pending.get("nonce")
    if not isinstance(nonce, str):
        nonce = secrets.token_hex(16)
        store.write_json("enrol-nonce.json", {"nonce": nonce}, private=True)
    if not cfg.enrol_secret:
        raise ConfigError("this device is not enrolled yet and has no enrolment secret: give --enrol-secret-file "
                          "(or PFL_ENROL_SECRET, or --enrol-secret)")
    key = DeviceKey(store)

    def body() -> dict[str, Any]:  # each attempt signed afresh: the server takes a counter once only
        proof = key.prove(lambda c: enrol_message(cfg.federation, nonce, key.public, c))
        req = EnrolRequest(federation=cfg.federation, enrol_secret=cfg.enrol_secret, profile=cfg.profile,
                           name=cfg.name, index=cfg.partition_id, nonce=nonce, platform=platform,
                           public_key=key.public, proof=proof, protocols=list(PROTOCOL_VERSIONS))
        # the newer fields only where they say something: a device saying nothing sends an earlier release's request
        return {k: v for k, v in req.model_dump().items() if not (k in _NEW_FIELDS and v is None)}

    try:
        r = http.call("POST", f"{API_PREFIX}/devices", json_body=body)
    except ServerError as e:
        # a server of an earlier release knows none of the newer fields and refuses them: enrol without them
        if not (e.status == 422 and any(f in str(e) for f in _NEW_FIELDS)):
            raise
        r = http.call("POST", f"{API_PREFIX}/devices",
                      json_body={k: v for k, v in body().items() if k not in _NEW_FIELDS})
    enr = Enrolment.model_validate(r.json())
    store.save_enrolment(enr.model_dump())
    http.rotation_body = key.rotation_of(enr.device_id)
    return enr


def renew(store: StateDir, http: Http, cfg: AgentConfig, old: Enrolment,
          platform: Platform | None = None) -> Enrolment:
    """Enrol again (module docstring); ``http`` then holds the new token. A revoked device is refused (403,
    ``ServerError``), which ends it; a device the server does not give back is a ConfigError."""
    store.remove("enrolment.json")
    store.remove("token.json")
    enr = enrol(store, http, cfg, platform)
    if (enr.device_id, enr.index) != (old.device_id, old.index):
        raise ConfigError(f"enrolling again gave device {enr.device_id} (slot {enr.index}), not {old.device_id} "
                          f"(slot {old.index}): this state dir is not its; use another --state-dir")
    http.use_token(store.root / "token.json", enr.token)
    return enr
