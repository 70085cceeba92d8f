"""Shamir's secret sharing of 32-byte secrets over the prime field GF(2^521 - 1): one field element holds a whole
secret, so a share is one element (66 bytes) and its x."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from ..errors import ConfigError

__all__ = ["PRIME", "SHARE_BYTES", "combine", "evaluator", "split", "split_with"]

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
    return split_with(secret, xs, [secrets.randbelow(PRIME) for _ in range(threshold - 1)])


def split_with(secret: bytes, xs: Sequence[int], coeffs: Sequence[int]) -> dict[int, bytes]:
    """``split``'s shares with its coefficients a_1 ... a_{t-1} given (``split`` draws them uniform in [0, PRIME);
    fixed ones are for test vectors only, docs/vectors/secagg): f(x) mod PRIME for each x, 66 bytes big-endian,
    where f's constant term is ``secret`` read as a big-endian integer."""
    poly = [int.from_bytes(secret, "big"), *coeffs]
    out: dict[int, bytes] = {}
    for x in xs:
        y = 0
        for a in reversed(poly):  # Horner
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
    secret = evaluator(ys)(0)
    if secret >= 2 ** (8 * size):
        raise ConfigError("the shares do not combine to a secret of this size (a wrong or forged share)")
    return secret.to_bytes(size, "big")


def evaluator(points: list[tuple[int, int]]) -> Callable[[int], int]:
    """The polynomial through ``points`` ((x, y), distinct x) as a function over GF(PRIME): its barycentric
    weights 1 / prod_{j != i} (x_i - x_j) found once, with one inversion for all of them (Montgomery's trick), so
    each value costs about 3 t multiplications and no inversion (at 1,000 clients the server checks thousands of
    shares: one inversion per term made that check 6x the round's unmasking)."""
    xs = [x for x, _ in points]
    dens = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if i != j:
                d = d * (xi - xj) % PRIME
        dens.append(d)
    weights = [w * y % PRIME for w, (_, y) in zip(_inverses(dens), points, strict=True)]

    def at(x: int) -> int:
        terms = [(x - xj) % PRIME for xj in xs]
        suffix = [1] * (len(terms) + 1)
        for i in range(len(terms) - 1, -1, -1):
            suffix[i] = suffix[i + 1] * terms[i] % PRIME
        out, prefix = 0, 1
        for i, w in enumerate(weights):
            out = (out + w * prefix % PRIME * suffix[i + 1]) % PRIME
            prefix = prefix * terms[i] % PRIME
        return out

    return at


def _inverses(values: list[int]) -> list[int]:
    """Each of ``values`` (non-zero mod PRIME) inverted, with one modular inversion in all."""
    prefix = [1]
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inv = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inv * prefix[i] % PRIME
        inv = inv * values[i] % PRIME
    return out
