"""The epsilon a federation has spent, round by round, as each round actually ran (docs/privacy.md, "Achieved
epsilon"): the accountant of ``pfl_edge.privacy`` (Opacus's RDP analysis of the sampled Gaussian mechanism over
``ORDERS``), fed each round's realised noise.

Central mode: the server adds N(0, (z C)^2) whoever came, so every round is the nominal mechanism and the figure
is ``pfl_edge.privacy.epsilon``'s. Distributed mode: the noise is the participants' shares (``privatize``: each
N(0, (z C)^2 / (q N)) per coordinate), so a round with fewer participants than q N released less noise than the
accountant's nominal z C; each round is accounted at the multiplier its count achieved (``realised_multiplier``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .errors import ConfigError
from .privacy import ORDERS, epsilon, expected_count, noise_multiplier

if TYPE_CHECKING:
    from .federation import FederationConfig

__all__ = ["achieved_epsilon", "achieved_epsilons", "realised_multiplier", "reported_epsilons"]


def realised_multiplier(cfg: FederationConfig, count: int) -> float:
    """The noise multiplier a round whose released sum holds ``count`` participants' updates achieved.

    Central mode: z. Distributed mode: the sum (sensitivity C: one client's clipped update) carries one noise share
    N(0, (z C)^2 / (q N)) per participant. A participant's own share does not hide it: in the neighbouring run
    without it, its share is gone too (a round of one participant releases its update plus its own share; without
    it, the start exactly: the two are told apart with certainty, whatever that share's size). What hides any one
    participant is the other count - 1 shares, of variance (count - 1) (z C)^2 / (q N):
    z_r = z sqrt((count - 1) / (q N)), capped at z (a round of more than q N + 1 is counted at the nominal z, the
    figure the config was calibrated for; the extra noise is not claimed)."""
    dp = cfg.dp
    z = noise_multiplier(cfg)
    if dp is None or dp.mode == "central":
        return z
    return z * math.sqrt(min(1.0, max(count - 1, 0) / expected_count(cfg)))


def achieved_epsilons(cfg: FederationConfig, counts: Sequence[int | None]) -> list[float]:
    """The epsilon (at the config's delta) spent after each of the rounds whose released sums held ``counts``
    participants' updates (one entry per round, in order; None: a count not known, unbounded from there on).

    Central mode: ``epsilon(cfg, t)`` after round t. Distributed mode: each round's RDP is the sampled Gaussian
    mechanism's at rate q and its own ``realised_multiplier``, summed over the rounds so far (RDP composes by
    addition) and converted to (epsilon, delta) as Opacus's ``RDPAccountant`` does (the same functions, over the
    same ``ORDERS``); a round into which no update went (count 0: it released nothing but its start) adds nothing,
    and a round of one participant (no other share hides it), or of no noise, makes it unbounded (inf)."""
    dp = cfg.dp
    if dp is None:
        raise ConfigError("this federation has no [privacy] table")
    if dp.mode == "central":
        return [epsilon(cfg, t) for t in range(1, len(counts) + 1)]
    from opacus.accountants.analysis.rdp import get_privacy_spent  # the accountant's own conversion

    out: list[float] = []
    total = np.zeros(len(ORDERS))
    for count in counts:
        if count is None:
            total = total + math.inf
        elif count > 0:
            total = total + _round_rdp(realised_multiplier(cfg, count), cfg.participation)
        if not np.isfinite(total).any():
            out.append(math.inf)
        elif not total.any():
            out.append(0.0)
        else:
            out.append(float(get_privacy_spent(orders=list(ORDERS), rdp=total, delta=dp.delta)[0]))
    return out


def achieved_epsilon(cfg: FederationConfig, counts: Sequence[int | None]) -> float:
    """``achieved_epsilons``' last: the epsilon every round of ``counts`` spent together (0 for none)."""
    return achieved_epsilons(cfg, counts)[-1] if counts else 0.0


def reported_epsilons(cfg: FederationConfig, counts: Sequence[int | None], *, draw_hidden: bool = True
                      ) -> list[float]:
    """What a server reports after each published round of ``counts``: ``achieved_epsilons`` where no device can
    undo the noise nor knows who took part; inf (no guarantee: JSON's null) with ``secret_noise = false`` (the
    noise comes from the seed every device holds: any of them can subtract it from the base), and where a sampled
    federation's draw is not ``draw_hidden`` (one made before servers kept a sampling key: every device computes
    who took part, and amplification by sampling does not hold against them) (issue 48). The simulator's figure
    is the mechanism's (``achieved_epsilons``): there is nobody to hide the noise or the draw from."""
    dp = cfg.dp
    if dp is None:
        raise ConfigError("this federation has no [privacy] table")
    if not dp.secret_noise or (not draw_hidden and cfg.participation < 1):
        return [math.inf] * len(counts)
    return achieved_epsilons(cfg, counts)


@functools.lru_cache(maxsize=1024)
def _round_rdp(z: float, q: float) -> np.ndarray:
    """One round's RDP over ``ORDERS``: the sampled Gaussian mechanism at rate ``q`` and multiplier ``z``
    (Opacus's ``compute_rdp``; inf at every order where z is 0). Read-only: it is cached."""
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = np.asarray(compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(ORDERS)), dtype=np.float64)
    rdp.setflags(write=False)
    return rdp
