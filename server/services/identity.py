"""Who a device is, beyond its token: the protocol version it is answered in, its own key (pfl_edge.device_key)
and its MQTT client id. The rules ``EnrolmentService`` applies at enrolment and at a device's own token
rotation (docs/protocol.md, "Versions" and "Device keys")."""

from __future__ import annotations

from pfl_edge.device_key import KeyProof, enrol_message, rotate_message, verify
from pfl_edge.protocol import EnrolRequest, negotiate

from ..db import Device
from ..errors import Forbidden, Unauthorized, Unspoken
from .broker_access import device_client_id

__all__ = ["answered_in", "client_id", "take_enrol_proof", "take_rotation_proof", "version"]


def version(req: EnrolRequest, speaks: tuple[int, ...]) -> int:
    """The protocol version to answer this device in; Unspoken (426, naming both sides) if there is none."""
    got = negotiate(req.protocols, speaks)
    if got is None:
        said = ", ".join(map(str, req.protocols or [1]))
        raise Unspoken(f"this server speaks protocol versions {', '.join(map(str, speaks))}; the device speaks "
                       f"{said}{'' if req.protocols else ' (it named none: an earlier release)'}. Update the device "
                       "(docs/protocol-changes.md says what changed), or run a server that speaks its version")
    return got


def answered_in(dev: Device) -> int:
    """The version ``dev`` is answered in: negotiated at its last enrolment (a row from before schema 15: 1)."""
    return 1 if dev.protocol is None else dev.protocol


def client_id(version: int, password: str, dev_id: str) -> str | None:
    """The device's MQTT client id (broker_access.device_client_id), told to a device of protocol version 2 or
    later; None for one of version 1 (an earlier release: it connects as ``pfl-<device id>`` and refuses an
    Enrolment with a field it does not know)."""
    return None if version < 2 else device_client_id(password, dev_id)


def take_enrol_proof(dev: Device, req: EnrolRequest) -> None:
    """Keep the key ``req`` proves it holds (its signature of device_key.enrol_message, with a counter above the
    last one this device signed with); nothing without a key. A device that enrolled with a key must show it."""
    if dev.public_key is not None and req.public_key != dev.public_key:
        raise Forbidden("the device of this nonce enrolled with a key: enrolling again must be signed by it "
                        "(a device that lost its key is revoked by the operator and enrols afresh)")
    if req.public_key is None or req.proof is None or req.nonce is None:
        return
    last = dev.key_counter or 0
    msg = enrol_message(req.federation, req.nonce, req.public_key, req.proof.counter)
    if req.proof.counter <= last or not verify(req.public_key, msg, req.proof.signature):
        raise Forbidden(f"the enrolment's proof does not verify: a signature by its public key of "
                        f"device_key.enrol_message with a counter above {last} is expected")
    dev.public_key, dev.key_counter = req.public_key, req.proof.counter


def take_rotation_proof(dev: Device, proof: KeyProof | None) -> None:
    """A device that enrolled with a key signs its own rotations (device_key.rotate_message, a counter above its
    last): 401 otherwise, so a stolen token dies at its expiry. Nothing for a device without a key."""
    if dev.public_key is None:
        return
    last = dev.key_counter or 0
    if proof is None or proof.counter <= last or not verify(dev.public_key, rotate_message(dev.id, proof.counter),
                                                            proof.signature):
        raise Unauthorized(f"device {dev.id} enrolled with a key: its rotation must carry a proof, a signature of "
                           f"device_key.rotate_message with a counter above {last}")
    dev.key_counter = proof.counter
