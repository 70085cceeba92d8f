"""A device's side of a secure round (docs/secagg.md; the steps: ``pfl_edge.secagg.wire``): its keys, its
sealed shares for its neighbours, its masked input (uploaded as the round's update by the agent), and the
shares the server asks of it to unmask the sum. Its update leaves the device only masked.

Its keys and self-mask seed live in memory only (never in the state dir): a device restarted during a secure
round sits the rest of it out, and the round recovers as from any dropout. Between steps it asks the server
where the round stands, with a backoff that grows to a second, until the step it waits for comes, the round
closes, or the server's step deadline and one more step's time have passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from pfl_edge.errors import ConfigError
from pfl_edge.protocol import API_PREFIX
from pfl_edge.secagg.wire import (
    SecAggComplaint,
    SecAggKeys,
    SecAggSealed,
    SecAggShare,
    SecAggShares,
    SecAggStep,
    SecAggUnmask,
    encode_masked,
    round_id,
)

from .http import Http, ServerError

if TYPE_CHECKING:
    from pfl_edge.federation import FederationConfig

__all__ = ["SecureRound", "send_securely"]

log = logging.getLogger("pfl_edge.client")

_FIRST_WAIT_S, _MOST_WAIT_S = 0.05, 1.0


def send_securely(http: Http, cfg: FederationConfig, federation: str, slot: int, t: int,
                  base: Mapping[str, Any], sent: Mapping[str, Any], send_input: Callable[[bytes], bool],
                  stop: threading.Event | None = None) -> bool:
    """Round ``t``'s update (``sent`` from ``base``, as it would go in the clear) through the round's secure
    aggregation (``SecureRound.run``)."""
    from pfl_edge.secagg.aggregate import secagg_config, secure_input

    sa = secagg_config(cfg)
    x = secure_input(cfg, {k: base[k] for k in sent}, sent)
    return SecureRound(http, federation, slot, t, sa.step_s, stop).run(x, send_input)


class SecureRound:
    """Round ``t`` of ``federation`` for the device in ``slot``; ``step_s``: the federation's step time."""

    def __init__(self, http: Http, federation: str, slot: int, t: int, step_s: float,
                 stop: threading.Event | None = None) -> None:
        try:
            from pfl_edge.secagg import KeyPair
        except ImportError as e:  # the agent's lean install leaves it out: only secure federations need it
            raise ConfigError(f"this federation aggregates securely, which needs the 'cryptography' package on "
                              f"the device ({e}): pip install cryptography") from None
        self.http, self.federation, self.slot, self.t = http, federation, slot, t
        self.step_s = step_s
        self.stop = stop or threading.Event()
        self.c, self.s = KeyPair(), KeyPair()

    def run(self, x: np.ndarray, send_input: Callable[[bytes], bool]) -> bool:
        """The round's steps with the quantized update ``x``; ``send_input(payload)`` uploads the masked input as
        the round's update (False: refused or too late). True once it has sent what the unmask step asked."""
        from pfl_edge.secagg import Advert, Client, Params

        keys = SecAggKeys(c_public=self.c.public.hex(), s_public=self.s.public.hex())
        at = self._post("keys", keys)
        at = self._wait(at, ("share", "input", "unmask", "done"))
        if at is None or at.step != "share" or at.params is None or not at.neighbours:
            return self._out("the round moved past its share step without this device", at)
        params = Params(at.params.degree, at.params.threshold, at.params.size, round_id(self.federation, self.t))
        if params.size != x.size:
            raise ConfigError(f"the server's secure round sums {params.size} values; this device's base has {x.size}")
        client = Client(self.slot, params, c=self.c, s=self.s)
        nbrs = {n.index: Advert(n.index, bytes.fromhex(n.c_public), bytes.fromhex(n.s_public)) for n in at.neighbours}
        dealt = client.share_keys(nbrs)
        at = self._post("shares", SecAggShares(shares=[SecAggSealed(index=j, box=b.hex(), commits=h.hex())
                                                       for j, (b, h) in dealt.items()]))
        at = self._wait(at, ("input", "unmask", "done"))
        if at is None or at.step != "input":
            return self._out("the round moved past its input step without this device", at)
        y = client.masked_input(x, {s.index: (bytes.fromhex(s.box), bytes.fromhex(s.commits)) for s in at.inbox})
        if client.accused:  # a pair that does not open or check: the server judges, this device stays
            secret, accused = client.complaint()
            log.warning("round %d: the pairs of %s do not open or check; complaining before the input", self.t,
                        accused)
            if self._post("complaint", SecAggComplaint(c_secret=secret.hex(), accused=accused)) is None:
                return self._out("the server took no complaint", at)
        if not send_input(encode_masked(y, self.t)):
            return False
        at = self._wait(self._state(), ("unmask", "done"))
        if at is None or at.step != "unmask":
            return self._out("the round closed before its unmask step reached this device", at)
        shares = client.unmask(frozenset(at.survivors), frozenset(at.dropped))
        self._post("unmask", SecAggUnmask(shares=[SecAggShare(about=j, kind=k, share=v.hex())
                                                  for j, (k, v) in sorted(shares.items())]))
        return True

    def _out(self, why: str, at: SecAggStep | None) -> bool:
        log.warning("round %d: secure aggregation goes on without this device: %s (step %s)", self.t, why,
                    None if at is None else at.step)
        return False

    def _path(self, what: str = "") -> str:
        return f"{API_PREFIX}/rounds/{self.t}/secagg" + (f"/{what}" if what else "")

    def _state(self) -> SecAggStep:
        return SecAggStep.model_validate_json(self.http.call("GET", self._path()).content)

    def _post(self, what: str, msg: SecAggKeys | SecAggShares | SecAggComplaint | SecAggUnmask) -> SecAggStep | None:
        try:
            r = self.http.call("POST", self._path(what), json_body=msg.model_dump())
        except ServerError as e:
            if e.status not in (409, 422):  # 422: named for a forged message (a false complaint): out of the round
                raise
            log.warning("round %d: the server took no %s message of this device: %s", self.t, what, e)
            return None
        return SecAggStep.model_validate_json(r.content)

    def _wait(self, at: SecAggStep | None, until: tuple[str, ...]) -> SecAggStep | None:
        """The round's state once its step is one of ``until`` (None: gave up, or the post was refused)."""
        if at is None:
            return None
        give_up = time.monotonic() + max(at.deadline - time.time(), 0.0) + self.step_s
        wait = _FIRST_WAIT_S
        while at.step not in until:
            if time.monotonic() > give_up or self.stop.wait(wait):
                return None
            wait = min(2 * wait, _MOST_WAIT_S)
            at = self._state()
            if at.step not in until and at.deadline - time.time() > 0:  # a step moved on: its own deadline
                give_up = max(give_up, time.monotonic() + at.deadline - time.time() + self.step_s)
        return at
