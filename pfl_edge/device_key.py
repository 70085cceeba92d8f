"""A device's own key pair (Ed25519): made on the device before its first enrolment, its public half kept by the
server, its private half never leaving the device's state dir. Enrolling again under the same nonce and rotating
a token must be signed with it, so a thief who learns a device's nonce and the federation's secret (or steals its
token) cannot take its slot while the device still holds its key (docs/protocol.md, "Device keys").

Each signature covers a ``counter`` that the device raises before every signed request and the server requires to
grow: a captured request cannot be replayed, and a retry (a lost answer) is signed afresh. The messages are
defined here once, for the device, the server and the tests: the domain tag, then the fields, NUL-separated (none
of them may hold a NUL: ids, nonces and keys are hex or ``[A-Za-z0-9_-]``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_COUNTER", "KeyProof", "TokenRotation", "enrol_message", "new_key", "public_of", "rotate_message",
           "sign", "verify"]

MAX_COUNTER = 2**53 - 1  # a JSON number every client reads exactly


class KeyProof(BaseModel):
    """A signature by the device's key over a message with ``counter``, which must grow (a protocol message)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    counter: int = Field(ge=1, le=MAX_COUNTER, strict=True, description="raised before every signed request")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$", description="Ed25519 signature, hex")


class TokenRotation(BaseModel):
    """A device's own token rotation's body: a device that enrolled with a key proves it holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    proof: KeyProof = Field(description="signature of rotate_message by the device's key")


# cryptography is imported by the functions that use it: the messages above load without it

def new_key() -> str:
    """A fresh private key, as 64 hex characters (its raw 32 bytes)."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    return key.private_bytes(ser.Encoding.Raw, ser.PrivateFormat.Raw, ser.NoEncryption()).hex()


def public_of(private_hex: str) -> str:
    """The public key of ``private_hex``, as 64 hex characters (what the server keeps)."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_hex))
    return key.public_key().public_bytes(ser.Encoding.Raw, ser.PublicFormat.Raw).hex()


def _message(tag: str, *fields: str) -> bytes:
    return b"\0".join(f.encode() for f in (tag, *fields))


def enrol_message(federation: str, nonce: str, public_key: str, counter: int) -> bytes:
    """What an enrolment's proof signs: the federation, the device's nonce and key, the counter."""
    return _message("pfl-enrol/1", federation, nonce, public_key, str(counter))


def rotate_message(device_id: str, counter: int) -> bytes:
    """What a token rotation's proof signs: the device's id and the counter."""
    return _message("pfl-rotate/1", device_id, str(counter))


def sign(private_hex: str, message: bytes) -> str:
    """The signature of ``message``, as 128 hex characters."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_hex)).sign(message).hex()


def verify(public_hex: str, message: bytes, signature_hex: str) -> bool:
    """Whether ``signature_hex`` is the holder of ``public_hex``'s signature of ``message`` (False for any
    malformed key or signature: they come from the network)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes.fromhex(signature_hex), message)
    except (ValueError, InvalidSignature):
        return False
    return True
