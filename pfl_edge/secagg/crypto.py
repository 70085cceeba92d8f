"""The cryptography SecAgg+ stands on, all from ``cryptography`` (nothing of it written here): X25519 key
agreement, HKDF-SHA256 to a key of each use, AES-256-GCM for the shares in transit, AES-256-CTR as the masks'
pseudo-random generator."""

from __future__ import annotations

import os

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..errors import CodecError

__all__ = ["KeyPair", "agree", "open_sealed", "prg", "seal", "sealed_with"]

_RAW = serialization.Encoding.Raw


class KeyPair:
    """An X25519 key pair: ``public`` (32 bytes) to advertise, ``secret`` (32 bytes) to keep or share."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._sk = X25519PrivateKey.generate() if secret is None else X25519PrivateKey.from_private_bytes(secret)
        self.public = self._sk.public_key().public_bytes(_RAW, serialization.PublicFormat.Raw)
        self.secret = self._sk.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())

    def agree(self, public: bytes, info: bytes) -> bytes:
        return agree(self._sk, public, info)


def agree(sk: X25519PrivateKey, public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret, bound to ``info``."""
    if len(public) != 32:
        raise CodecError(f"an X25519 public key is 32 bytes, got {len(public)}")
    try:
        shared = sk.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:  # a low-order point: all-zero shared secret
        raise CodecError(f"unusable public key: {e}") from None
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM: a random 12-byte nonce, then the ciphertext and its tag; ``aad`` authenticated, not sent."""
    return sealed_with(key, os.urandom(12), plaintext, aad)


def sealed_with(key: bytes, nonce: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``seal`` with its nonce given: ``nonce`` (12 bytes) then AES-256-GCM's ciphertext and 16-byte tag. For test
    vectors only (docs/vectors/secagg): a nonce must never repeat under one key, which only ``seal``'s draw makes
    sure of."""
    if len(key) != 32 or len(nonce) != 12:
        raise CodecError(f"AES-256-GCM takes a 32-byte key and a 12-byte nonce, got {len(key)} and {len(nonce)}")
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes:
    """``seal``'s plaintext; CodecError for anything else (forged, altered, for another pair or round)."""
    if len(sealed) < 12 + 16:
        raise CodecError("a sealed share is too short")
    try:
        return AESGCM(key).decrypt(sealed[:12], sealed[12:], aad)
    except InvalidTag:
        raise CodecError("a sealed share does not open: forged, altered, or not for this pair and round") from None


def prg(seed: bytes, n: int) -> np.ndarray:
    """``n`` pseudo-random uint32 from a 32-byte seed: AES-256-CTR's keystream (zero nonce: a seed is used for
    one mask only), little-endian."""
    if len(seed) != 32:
        raise CodecError(f"a mask seed is 32 bytes, got {len(seed)}")
    enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    return np.frombuffer(enc.update(bytes(4 * n)) + enc.finalize(), dtype="<u4")
