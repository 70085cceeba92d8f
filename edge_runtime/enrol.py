"""A device's enrolment: once with the federation's secret (``enrol``; a retry whose answer was lost gets the same
device back through the nonce kept in the state dir), and again when its token chain ends (``renew``: the server
refused a rotation or a call with 401, the token expired or its chain reached the server's absolute lifetime):
the same nonce brings back the same device and slot with a new chain, and the state dir carries on."""

from __future__ import annotations

import secrets

from pfl_edge.errors import ConfigError
from pfl_edge.protocol import API_PREFIX, Enrolment, EnrolRequest, Platform

from .config import AgentConfig
from .http import Http, ServerError
from .state import StateDir

__all__ = ["enrol", "renew"]


def enrol(store: StateDir, http: Http, cfg: AgentConfig, platform: Platform | None = None) -> Enrolment:
    """The device's enrolment: the saved one, or a new one (with ``cfg``'s secret, saying it is ``platform``)."""
    saved = store.enrolment
    if saved is not None:
        enr = Enrolment.model_validate(saved)
        if enr.federation != cfg.federation:
            raise ConfigError(f"state dir {cfg.state_dir} belongs to federation {enr.federation!r}, "
                              f"not {cfg.federation!r}; use another --state-dir")
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
    req = EnrolRequest(federation=cfg.federation, enrol_secret=cfg.enrol_secret,
                       profile=cfg.profile, name=cfg.name, index=cfg.partition_id, nonce=nonce,
                       platform=platform)
    body = req.model_dump()
    if req.platform is None:  # says nothing: the very request an earlier release sent
        del body["platform"]
    try:
        r = http.call("POST", f"{API_PREFIX}/devices", json_body=body)
    except ServerError as e:
        # a server of an earlier release knows no ``platform`` and refuses the field: enrol without saying it
        if not (e.status == 422 and "platform" in str(e) and "platform" in body):
            raise
        r = http.call("POST", f"{API_PREFIX}/devices", json_body={k: v for k, v in body.items() if k != "platform"})
    enr = Enrolment.model_validate(r.json())
    store.save_enrolment(enr.model_dump())
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
