"""Shamir's secret sharing of 32-byte secrets over the prime field GF(2^521 - 1): one field element holds a whole
secret, so a share is one element (66 bytes) and its x."""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = ["PRIME", "SHARE_BYTES", "combine", "split"]

PRIME = 2**521 - 1  # a Mersenne prime: any 32-byte secret is one element
SHARE_BYTES = 66  # ceil(521 / 8)


def split(secret: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
    """Shares of ``secret`` at the points ``xs`` (distinct, in [1, 2^31)), any ``threshold`` of which recover it
    and fewer of which say nothing of it: f(x) = secret + a_1 x + ... + a_{t-1} x^{t-1}, uniform a_i."""
    if not 1 <= threshold <= len(xs):
        raise ConfigError(f"threshold must be in [1, {len(xs)}] (the shares made), got {threshold}")
    if len(set(xs)) != len(xs) or not all(0 < x < 2**31 for x in xs):
        raise ConfigError("share points must be distinct integers in [1, 2^31)")
    if len(secret) > 64:
        raise ConfigError(f"a secret is at most 64 bytes, got {len(secret)}")
    coeffs = [int.from_bytes(secret, "big"), *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
    out: dict[int, bytes] = {}
    for x in xs:
        y = 0
        for a in reversed(coeffs):  # Horner
            y = (y * x + a) % PRIME
        out[x] = y.to_bytes(SHARE_BYTES, "big")
    return out


def combine(shares: dict[int, bytes], threshold: int, size: int = 32) -> bytes:
    """The secret (``size`` bytes) from at least ``threshold`` shares ``{x: share}``: Lagrange interpolation at 0
    over the first ``threshold`` of them. Shares that are not field elements are refused (ConfigError)."""
    if len(shares) < threshold:
        raise ConfigError(f"{len(shares)} shares, {threshold} needed")
    points = sorted(shares.items())[:threshold]
    ys = []
    for x, share in points:
        y = int.from_bytes(share, "big")
        if len(share) != SHARE_BYTES or y >= PRIME or not 0 < x < 2**31:
            raise ConfigError("a share is not a point of the field")
        ys.append((x, y))
    secret = 0
    for i, (xi, yi) in enumerate(ys):
        num, den = 1, 1
        for j, (xj, _) in enumerate(ys):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME  # extended Euclid: 18x Fermat here
    if secret >= 2 ** (8 * size):
        raise ConfigError("the shares do not combine to a secret of this size (a wrong or forged share)")
    return secret.to_bytes(size, "big")
