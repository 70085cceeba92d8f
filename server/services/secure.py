"""Secure aggregation on the wire (docs/secagg.md, docs/protocol.md "Secure aggregation"): a collecting round of
a federation with a ``[secure_aggregation]`` table goes through SecAgg+'s four steps (``pfl_edge.secagg.wire``)
before it may close, and its new base is computed from the sum the server unmasks, never from an update.

The step is the round's (``Round.secagg_step``, ``Round.step_deadline``), moved on by the round machine
(``advance``) when every device still in the round has sent the step's message, or at the step's deadline:
``advertise`` (until the round's deadline: devices train first) -> ``share`` -> ``input`` -> ``unmask`` ->
``done``; advertising ends early at the federation's quorum of the round's devices, as a plain round closes
at its quorum of updates. Each device message is kept whole (``SecAggMessage``) and checked against the step
and the graph before it is: a device sends only in its step, only to and about its neighbours, once (a retry of
the same message is answered again; another is refused). The sum is unmasked from those rows (``stored_total``):
nothing of a round is held in memory, and a replica or a restart reads the same state.

A device whose message fails a check only it could fail is named (``pfl_edge.secagg.verify``; a row of kind
``out`` or ``named``, its ``refused_updates`` counted, the log): a dealer whose pair a neighbour's complaint
shows bad, or the neighbour whose complaint is false, is **out** of the round (its input is refused or ignored,
its neighbours reveal its mask key as a dropout's); a survivor whose revealed share is not the one its dealer
committed to is **named** and its answer discarded (its input stays: its neighbours revealed its seed already),
and a dealer whose committed shares make no secret is named and the round releases nothing.

Grouped rounds (``min_group``): each group is a SecAgg+ round of its own over the same messages, unmasked alone.
The server cannot bound an update's norm (it sees masked vectors); each group's sum is checked before release
(``check_sum``). A group releases nothing with fewer than ``MIN_CLIENTS`` inputs, a secret that cannot be rebuilt
or a dealer's forged shares; the next round opens either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from pfl_edge.errors import CodecError, ConfigError
from pfl_edge.privacy import MIN_CLIENTS
from pfl_edge.protocol import quorum_updates
from pfl_edge.secagg.aggregate import secagg_config
from pfl_edge.secagg.wire import (
    SecAggComplaint,
    SecAggKeys,
    SecAggNeighbour,
    SecAggParams,
    SecAggSealed,
    SecAggShares,
    SecAggStep,
    SecAggUnmask,
    decode_masked,
    round_id,
)

from ..db import Device, Federation, Round, SecAggMessage, Update
from ..errors import Conflict, Unprocessable
from ..fedmodel import FedModel
from ..states import RoundState
from .blob_access import BlobAccess
from .planning import Planner
from .store import Store

__all__ = ["STEPS", "SecureRounds", "is_secure"]

log = logging.getLogger(__name__)

STEPS = ("advertise", "share", "input", "unmask", "done")
# each message: the step it belongs to and the kind it is kept as
_MSG: dict[type, tuple[str, str]] = {SecAggKeys: ("advertise", "keys"), SecAggShares: ("share", "shares"),
                                     SecAggComplaint: ("input", "complain"), SecAggUnmask: ("unmask", "unmask")}
Message = SecAggKeys | SecAggShares | SecAggComplaint | SecAggUnmask


def is_secure(fm: FedModel) -> bool:
    return fm.cfg.secure_aggregation is not None


class SecureRounds:
    def __init__(self, store: Store, blobs: BlobAccess, planner: Planner, *,
                 on_message: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.blobs = blobs
        self.planner = planner
        self.on_message = on_message  # wakes the round worker: the message may end the step

    # ------------------------------------------------------------------------------------------- devices
    def state(self, dev: Device, t: int) -> SecAggStep:
        """What ``dev`` needs of round ``t``'s step now (``SecAggStep``)."""
        with self.store.read() as s:
            fed, fm, r = self._round(s, dev, t)
            return self._answer(s, fed, fm, r, dev.slot)

    def post(self, dev: Device, t: int, msg: Message) -> SecAggStep:
        """A device's message for the step it belongs to, checked and kept (module docstring). A message that
        names a device (a complaint, a forged share) is kept with the name (an unmask answer without its forged
        shares: the others were each checked), then answered 422 if it named its sender."""
        step, kind = _MSG[type(msg)]
        body = msg.model_dump()
        with self.store.write() as s:
            fed, fm, r = self._round(s, dev, t, lock=True)
            old = s.get(SecAggMessage, (fed.id, t, dev.slot, kind))
            if old is not None:
                if old.body != body:
                    raise Conflict(f"this device sent a different {kind} message for round {t} already")
                return self._answer(s, fed, fm, r, dev.slot)
            if r.secagg_step != step:
                raise Conflict(f"round {t}'s secure aggregation is in its {r.secagg_step} step; this message "
                               f"belongs to the {step} step")
            if not self.planner.takes_part(s, fed, fm, t, dev):
                raise Conflict(f"this device takes no part in round {t}")
            if self._named(s, r, dev.slot):
                raise Conflict(f"this device was named for a forged message of round {t}: it is out of the round")
            forged, bad = self._check(s, fed, fm, r, dev.slot, msg)
            if bad:  # an unmask answer's shares that are not their dealers' committed ones go, the rest stay
                body = {"shares": [x for x in body["shares"] if x["about"] not in bad]}
            s.add(SecAggMessage(federation=fed.id, round=t, slot=dev.slot, kind=kind, body=body))
            for culprit, why in forged.items():
                self._name(s, r, culprit, why, out=step == "input")
            s.flush()
            answer = self._answer(s, fed, fm, r, dev.slot)
        self.on_message()
        if forged and dev.slot in forged:
            raise Unprocessable(f"round {t}: {forged[dev.slot]}; this device is named (its forged shares discarded, "
                                "a false complaint kept as judged)")
        return answer

    def check_input(self, s: Session, fm: FedModel, r: Round, dev: Device, payload: bytes) -> None:
        """An update of a secure round: in its ``input`` step, from a device that shared its keys, a masked
        payload of the round's size (Updates calls this instead of decoding a model)."""
        if r.secagg_step != "input":
            raise Conflict(f"round {r.round}'s secure aggregation is in its {r.secagg_step} step; masked inputs are "
                           "taken in the input step")
        if s.get(SecAggMessage, (r.federation, r.round, dev.slot, "shares")) is None:
            raise Conflict(f"this device shared no keys in round {r.round}: its input could never be unmasked")
        if self._named(s, r, dev.slot):
            raise Conflict(f"this device was named for a forged message of round {r.round}: it is out of the round")
        try:
            got, _ = decode_masked(payload, fm.secure_size())
        except CodecError as e:
            raise Unprocessable(f"update refused: {e}") from None
        if got != r.round:
            raise Unprocessable(f"the masked payload is for round {got}, the update is posted for round {r.round}")

    # ------------------------------------------------------------------------------------------- the machine
    def begin(self, r: Round) -> None:
        """Round ``r`` starts collecting: its devices train, then advertise until the round's deadline."""
        r.secagg_step, r.step_deadline = "advertise", r.deadline

    def advance(self, fed_id: str, clock: Callable[[], float]) -> bool:
        """Move the current round's step on where it is due (module docstring); True if it moved. Read first: a
        plain federation, or a step not due, costs one read, never a write."""
        with self.store.read() as s:
            if not self._due(s, s.get(Federation, fed_id), clock):
                return False
        with self.store.write() as s:
            fed = self.store.locked(s, fed_id)
            if not self._due(s, fed, clock):  # moved on meanwhile
                return False
            fm = self.store.model(fed)
            r = self.store.round(s, fed_id, fed.round)
            step = r.secagg_step or "advertise"
            r.secagg_step = STEPS[STEPS.index(step) + 1]
            r.step_deadline = clock() + secagg_config(fm.cfg).step_s
            log.info("federation %s: round %d's secure aggregation: %s -> %s", fed_id, r.round, step, r.secagg_step)
            return True

    def _due(self, s: Session, fed: Federation | None, clock: Callable[[], float]) -> bool:
        """Whether ``fed``'s current round is in a step that may end now."""
        if fed is None or fed.state != RoundState.COLLECTING:
            return False
        fm = self.store.model(fed)
        if not is_secure(fm):
            return False
        r = self.store.round(s, fed.id, fed.round)
        step = r.secagg_step or "advertise"
        if step == "done":
            return False
        have, want = self._progress(s, fed, fm, r)
        late = clock() >= (r.step_deadline or r.deadline)
        need = max(MIN_CLIENTS, fed.min_updates) if step == "advertise" else 0
        if step == "advertise":  # the federation's quorum, as a plain round's updates: the rest sit it out
            want = quorum_updates(fed.quorum, want)
        return (have >= want and have >= need) or (late and have >= need)

    def _progress(self, s: Session, fed: Federation, fm: FedModel, r: Round) -> tuple[int, int]:
        """(messages of the step that came, messages it waits for)."""
        step = r.secagg_step or "advertise"
        sent = self._slots(s, r, "keys")
        if step == "advertise":
            return len(sent), r.active
        if step == "share":
            return len(self._slots(s, r, "shares")), len(sent)
        survivors = self._survivors(s, r)
        if step == "input":
            return len(survivors), len(self._slots(s, r, "shares") - self._slots(s, r, "out"))
        answered = self._slots(s, r, "unmask") | self._slots(s, r, "named")
        return len(answered & set(survivors)), len(survivors)

    def unmasked(self, fed_id: str, t: int, fm: FedModel) -> list[tuple[np.ndarray, int]] | None:
        """Round ``t``'s unmasked sums, ``(sum, inputs it sums)`` per group, for the algorithm's aggregate to
        release (``Algorithm.aggregate``'s ``summed``, which checks each first); None where nothing can be
        released (module docstring). A group releases nothing with too few survivors, or a reconstruction the
        messages do not allow: a forged share that breaks it names its dealer and leaves the group out. Whatever
        the messages hold, this returns: the next round opens (it never leaves the round in ``closing``)."""
        from pfl_edge.secagg.aggregate import graph_seed
        from pfl_edge.secagg.rounds import stored_total
        from pfl_edge.secagg.verify import Forged

        out: list[tuple[np.ndarray, int]] = []
        named: list[Forged] = []
        with self.store.read() as s:
            r = self.store.round(s, fed_id, t)
            _, _, layout = self._layout(s, fm, r)
            survivors = self._survivors(s, r)
            keys, shares = self._bodies(s, r, "keys"), self._bodies(s, r, "shares")
            complaints, answers = self._bodies(s, r, "complain"), self._bodies(s, r, "unmask")
            for g, params, members in layout:
                mine = {i: survivors[i] for i in members if i in survivors}
                if len(mine) < MIN_CLIENTS:
                    log.warning("federation %s: round %d: %d masked inputs survived in group %d; it releases nothing",
                                fed_id, t, len(mine), g)
                    continue
                inputs = ((i, decode_masked(self.blobs.blobs.get(d), params.size)[1]) for i, d in mine.items())
                try:
                    out.append((stored_total(params, graph_seed(fm.cfg, t, g), members, keys, shares, complaints,
                                             inputs, answers), len(mine)))
                except (ConfigError, CodecError) as e:  # too few, forged or inconsistent shares: devices', not ours
                    log.error("federation %s: round %d: group %d cannot be unmasked (%s); it releases nothing",
                              fed_id, t, g, e)
                    if isinstance(e, Forged):
                        named.append(e)
        if named:
            with self.store.write() as s:
                r = self.store.round(s, fed_id, t)
                for f in named:
                    self._name(s, r, f.culprit, f.why, out=False)
        if not out:
            log.error("federation %s: round %d releases nothing; the base stays the round's start", fed_id, t)
        return out or None

    # ------------------------------------------------------------------------------------------- internals
    def _round(self, s: Session, dev: Device, t: int, *, lock: bool = False) -> tuple[Federation, FedModel, Round]:
        fed = self.store.locked(s, dev.federation) if lock else self.store.existing(s, dev.federation)
        fm = self.store.model(fed)
        if not is_secure(fm):
            raise Conflict(f"federation {fed.id!r} does not aggregate securely")
        r = s.get(Round, (fed.id, t))
        if r is None or t < 1 or r.secagg_step is None:
            raise Conflict(f"round {t} has no secure aggregation (the federation is in round {fed.round}, "
                           f"{fed.state})")
        return fed, fm, r

    @staticmethod
    def _slots(s: Session, r: Round, kind: str) -> set[int]:
        return set(s.scalars(select(SecAggMessage.slot).where(
            SecAggMessage.federation == r.federation, SecAggMessage.round == r.round, SecAggMessage.kind == kind)))

    @staticmethod
    def _bodies(s: Session, r: Round, kind: str, slots: frozenset[int] | None = None) -> dict[int, dict[str, Any]]:
        """The round's messages of ``kind`` by slot (``slots``: only theirs: a device's answer reads its
        neighbours' rows, not the round's)."""
        q = select(SecAggMessage.slot, SecAggMessage.body).where(
            SecAggMessage.federation == r.federation, SecAggMessage.round == r.round, SecAggMessage.kind == kind)
        if slots is not None:
            q = q.where(SecAggMessage.slot.in_(sorted(slots)))
        return {slot: body for slot, body in s.execute(q.order_by(SecAggMessage.slot))}

    def _survivors(self, s: Session, r: Round) -> dict[int, str]:
        """Slot -> digest of every accepted masked input of round ``r`` whose device is not out of the round."""
        out = self._slots(s, r, "out")
        rows = s.execute(select(Device.slot, Update.digest).join(Device, Device.id == Update.device).where(
            Update.federation == r.federation, Update.round == r.round)).all()
        return {slot: digest for slot, digest in rows if slot not in out}

    @staticmethod
    def _named(s: Session, r: Round, slot: int) -> bool:
        return any(s.get(SecAggMessage, (r.federation, r.round, slot, kind)) is not None for kind in ("out", "named"))

    def _name(self, s: Session, r: Round, slot: int, why: str, *, out: bool) -> None:
        """Name the device in ``slot`` for a forged message of round ``r`` (``out``: it leaves the round as a
        dropout), once: a row of its own, its refused count, the log."""
        kind = "out" if out else "named"
        if s.get(SecAggMessage, (r.federation, r.round, slot, kind)) is not None:
            return
        s.add(SecAggMessage(federation=r.federation, round=r.round, slot=slot, kind=kind, body={"why": why}))
        dev = s.scalars(select(Device).where(Device.federation == r.federation, Device.slot == slot)).first()
        if dev is not None:
            dev.refused_updates = (dev.refused_updates or 0) + 1
        log.warning("federation %s: round %d: device %s (slot %d) is named for a forged secure-aggregation message"
                    "%s: %s", r.federation, r.round, None if dev is None else dev.id, slot,
                    " and is out of the round" if out else "", why)

    def _layout(self, s: Session, fm: FedModel, r: Round) -> tuple[dict[int, Any], dict[int, frozenset[int]],
                                                                   list[tuple[int, Any, list[int]]]]:
        """Round ``r``'s groups as the advertisers fixed them (one unless ``min_group`` splits the round: each
        group one SecAgg+ round, ``pfl_edge.secagg.groups``): each slot's group's parameters, each slot's
        neighbours, and the groups (index, parameters, slots); none where the round is too small."""
        from pfl_edge.secagg import graph, groups
        from pfl_edge.secagg.aggregate import graph_seed, group_seed, secure_params

        ids = sorted(self._slots(s, r, "keys"))
        rid = round_id(r.federation, r.round)
        by_slot: dict[int, Any] = {}
        edges: dict[int, frozenset[int]] = {}
        out = []
        for g, members in enumerate(groups(ids, secagg_config(fm.cfg).min_group, group_seed(fm.cfg, r.round))):
            params = secure_params(fm.cfg, len(members), fm.secure_size(), rid)
            if params is None:
                continue
            out.append((g, params, members))
            by_slot.update(dict.fromkeys(members, params))
            edges.update(graph(members, params.degree, graph_seed(fm.cfg, r.round, g)))
        return by_slot, edges, out

    def _answer(self, s: Session, fed: Federation, fm: FedModel, r: Round, slot: int) -> SecAggStep:
        step = "done" if fed.round != r.round or fed.state != RoundState.COLLECTING else r.secagg_step or "advertise"
        out: dict[str, Any] = dict(round=r.round, step=step, deadline=r.step_deadline or r.deadline)
        if step in ("advertise", "done"):
            return SecAggStep(**out)
        by_slot, edges, _ = self._layout(s, fm, r)
        params = by_slot.get(slot)
        if params is not None:
            out["params"] = SecAggParams(degree=params.degree, threshold=params.threshold, size=params.size)
        mine = edges.get(slot, frozenset())
        keys = self._bodies(s, r, "keys")
        out["neighbours"] = [SecAggNeighbour(index=j, **keys[j]) for j in sorted(mine)]
        if step in ("input", "unmask"):
            out["inbox"] = [SecAggSealed(index=j, box=x["box"], commits=x["commits"])
                            for j, b in self._bodies(s, r, "shares", mine).items() for x in b["shares"]
                            if x["index"] == slot]
        if step == "unmask":
            survivors = set(self._survivors(s, r))
            out["survivors"] = sorted(survivors)
            out["dropped"] = sorted(self._slots(s, r, "shares") - survivors)
        return SecAggStep(**out)

    def _check(self, s: Session, fed: Federation, fm: FedModel, r: Round, slot: int,
               msg: Message) -> tuple[dict[int, str], list[int]]:
        """``msg`` fits the step, the graph and what the server asked (Unprocessable otherwise); the devices it
        names and why (``pfl_edge.secagg.verify``), and the neighbours whose shares in an unmask answer are not the
        ones they committed to: a complaint names each dealer at fault or its sender, such an answer its sender."""
        from pfl_edge.secagg import Advert, KeyPair
        from pfl_edge.secagg.verify import judge, matches

        if isinstance(msg, SecAggKeys):
            for key in (msg.c_public, msg.s_public):
                try:  # a low-order point would make every neighbour's agreement fail: refused here, not there
                    KeyPair().agree(bytes.fromhex(key), b"pfl-secagg:check")
                except CodecError as e:
                    raise Unprocessable(f"a public key of this device is unusable: {e}") from None
            return {}, []
        by_slot, edges, _ = self._layout(s, fm, r)
        params, mine = by_slot.get(slot), edges.get(slot)
        if params is None or mine is None:
            raise Conflict(f"this device advertised no keys in round {r.round}: it is not in the round's graph")
        if isinstance(msg, SecAggShares):
            to = [x.index for x in msg.shares]
            if sorted(to) != sorted(mine) or len(set(to)) != len(to):
                raise Unprocessable(f"a device sends one sealed pair to each of its {len(mine)} neighbours "
                                    f"{sorted(mine)}; got pairs for {sorted(to)}")
            return {}, []
        sharers = self._slots(s, r, "shares")
        dealt = {j: x for j, b in self._bodies(s, r, "shares", mine).items() for x in b["shares"] if x["index"] == slot}
        if isinstance(msg, SecAggComplaint):
            if slot not in sharers or not set(msg.accused) <= set(dealt) or len(set(msg.accused)) != len(msg.accused):
                raise Unprocessable(f"a complaint names dealers of pairs this device was sent ({sorted(dealt)}), "
                                    f"each once; got {msg.accused}")
            keys = self._bodies(s, r, "keys", mine | {slot})
            advert = {j: Advert(j, bytes.fromhex(keys[j]["c_public"]), bytes.fromhex(keys[j]["s_public"]))
                      for j in [slot, *msg.accused]}
            named: dict[int, str] = {}
            for j in msg.accused:
                who = judge(params, advert[slot], bytes.fromhex(msg.c_secret), advert[j],
                            bytes.fromhex(dealt[j]["box"]), bytes.fromhex(dealt[j]["commits"]))
                named[who] = (f"its pair for {slot} does not open or holds shares other than it committed to"
                              if who == j else f"a false complaint of {j}: that pair opens and checks, or the key "
                              "sent is not this device's")
            return named, []
        survivors = set(self._survivors(s, r))
        if slot not in survivors:
            raise Conflict(f"this device's masked input was not taken in round {r.round}: it is not a survivor")
        complained = set(self._bodies(s, r, "complain", frozenset({slot})).get(slot, {}).get("accused", ()))
        asked = {j: "b" if j in survivors else "s" for j in (mine & sharers) - complained}
        got = {x.about: x.kind for x in msg.shares}
        if got != asked or len(got) != len(msg.shares):
            raise Unprocessable(f"the unmask step asks this device for {sorted(asked.items())}; got "
                                f"{sorted(got.items())}")
        bad = [x.about for x in msg.shares if not matches(params, x.kind, x.about, slot, bytes.fromhex(x.share),
                                                          bytes.fromhex(dealt[x.about]["commits"]))]
        return ({slot: f"its shares of {bad} are not the ones their dealers committed to"} if bad else {}), bad
