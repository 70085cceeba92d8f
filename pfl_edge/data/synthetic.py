"""The ``synthetic`` data set: 10 classes of 1x28x28 inputs, a smooth prototype per class plus noise, learnable in a
few hundred steps (for tests and quick runs). Defined by arithmetic a device repeats in any language with IEEE-754
doubles and the documented Mersenne Twister (docs/determinism.md, "The synthetic data set"): no torch, no numpy
sampler, so a device without either (the JavaScript device, a board without torch) makes the same bits.

Until issue 50 it was drawn with torch's ``randn`` and ``interpolate``, which no second implementation reproduces.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from ..seeding import MT

__all__ = ["AMP", "NOISE", "SEED", "SIZES", "make_synthetic", "make_synthetic_labels", "prototypes"]

SEED = 20261129  # the generator's own: the data set is the same in every federation
SIZES = (6000, 2000)  # train, test
CLASSES, COARSE, SIDE = 10, 7, 28
AMP = 2.1650635094610964  # 1.25 * sqrt(3) as doubles compute it (this literal defines it): coarse std 1.25
NOISE = 2.598076211353316  # the double nearest 1.5 * sqrt(3): uniform sums of variance 1/3, scaled to std 1.5
_CHUNK = 500  # samples drawn at once (4 x 784 draws each)


def _taps() -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.float64]]:
    """Bilinear 7 -> 28, half-pixel centres (align_corners false): output d reads src = (d + 0.5) / 4 - 0.5,
    clamped at 0; i0 = floor(src), i1 = min(i0 + 1, 6), w = src - i0 (every w a multiple of 1/8, exact)."""
    d = np.arange(SIDE, dtype=np.float64)
    src = np.maximum((d + 0.5) / (SIDE // COARSE) - 0.5, 0.0)
    i0 = np.floor(src).astype(np.int64)
    return i0, np.minimum(i0 + 1, COARSE - 1), src - i0


def prototypes(g: MT) -> NDArray[np.float64]:
    """[10, 28, 28] float64: coarse values AMP * (2u - 1) (u: the generator's float32 draws, 10 x 7 x 7
    row-major), upsampled as ``(1 - wy) * ((1 - wx) * a + wx * b) + wy * ((1 - wx) * c + wx * d)`` with a, b the
    row i0's columns i0, i1, and c, d row i1's, evaluated in that order."""
    coarse = AMP * (2.0 * g.rand(CLASSES * COARSE * COARSE).astype(np.float64) - 1.0)
    coarse = coarse.reshape(CLASSES, COARSE, COARSE)
    r0, r1, wy = _taps()
    c0, c1, wx = _taps()
    a, b = coarse[:, r0][:, :, c0], coarse[:, r0][:, :, c1]
    c, d = coarse[:, r1][:, :, c0], coarse[:, r1][:, :, c1]
    wy, wx = wy[:, None], wx[None, :]
    return (1.0 - wy) * ((1.0 - wx) * a + wx * b) + wy * ((1.0 - wx) * c + wx * d)


def _split(g: MT, protos: NDArray[np.float64], n: int) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """n samples: labels ``(arange(n) mod 10)[randperm(n)]``; then, sample by sample and pixel by pixel
    (row-major), four draws u1..u4 and ``x = float32(proto[y] + NOISE * (u1 + u2 + u3 + u4 - 2))``."""
    y = (np.arange(n, dtype=np.int64) % CLASSES)[g.randperm(n)]
    x = np.empty((n, 1, SIDE, SIDE), dtype=np.float32)
    pixels = SIDE * SIDE
    for s in range(0, n, _CHUNK):
        m = min(_CHUNK, n - s)
        # u1 + u2 + u3 + u4 as the sum of the draws' 24-bit integers times 2**-24: the same double, exactly
        k = g.rand24(m * pixels * 4).reshape(m, pixels, 4).sum(axis=2)
        noise = NOISE * (k * 2.0**-24 - 2.0)
        x[s:s + m, 0] = (protos[y[s:s + m]].reshape(m, pixels) + noise).reshape(m, SIDE, SIDE).astype(np.float32)
    return x, y


def make_synthetic() -> tuple[NDArray[np.float32], NDArray[np.int64], NDArray[np.float32], NDArray[np.int64]]:
    """(train_x, train_y, test_x, test_y): one generator, MT19937 seeded ``SEED``, draws the prototypes, then the
    train split, then the test split."""
    g = MT(SEED)
    protos = prototypes(g)
    train_x, train_y = _split(g, protos, SIZES[0])
    test_x, test_y = _split(g, protos, SIZES[1])
    return train_x, train_y, test_x, test_y


def make_synthetic_labels() -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """(train_y, test_y) of ``make_synthetic`` without its inputs (what a coordinator deals from): the same draws,
    the prototypes' and the noise's skipped, ~100x faster."""
    g = MT(SEED)
    g.skip(CLASSES * COARSE * COARSE)
    out = []
    for n in SIZES:
        out.append((np.arange(n, dtype=np.int64) % CLASSES)[g.randperm(n)])
        g.skip(n * SIDE * SIDE * 4)
    return out[0], out[1]
