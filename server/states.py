"""The federation's round state machine, as data and one pure decision.

Round 0 is enrolment (state ``open``). Round t >= 1 goes ``open`` (its tasks are being prepared) ->
``collecting`` (tasks published, updates accepted) -> ``closing`` (the server aggregates) -> ``published`` (its
result stored) -> round t+1 ``open``, or ``finished`` after the last round. :data:`TRANSITIONS` is the whole
table; :func:`next_state` says which transition is due from plain values (no database, no clock of its own), and
:func:`check_transition` refuses any move the table does not hold. States are stored in the database as the
enum's values, the strings the protocol announces.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from types import MappingProxyType

from pfl_edge import protocol
from pfl_edge.compat import StrEnum
from pfl_edge.errors import InternalError

__all__ = [
    "ENROLMENT_ROUND",
    "TRANSITIONS",
    "RoundState",
    "Transition",
    "check_transition",
    "next_state",
    "quorum_reached",
]

ENROLMENT_ROUND = 0


class RoundState(StrEnum):
    OPEN = "open"
    COLLECTING = "collecting"
    CLOSING = "closing"
    PUBLISHED = "published"
    FINISHED = "finished"


# the protocol announces these strings: the two lists must never drift apart
if tuple(RoundState) != typing.get_args(protocol.RoundState):
    raise InternalError(f"server states {[s.value for s in RoundState]} differ from the protocol's "
                        f"{list(typing.get_args(protocol.RoundState))}")

#: state -> {next state: how far the round number moves}. OPEN -> OPEN is enrolment's end only (round 0 -> 1).
TRANSITIONS: typing.Mapping[RoundState, typing.Mapping[RoundState, int]] = MappingProxyType({
    RoundState.OPEN: MappingProxyType({RoundState.COLLECTING: 0, RoundState.OPEN: 1}),
    RoundState.COLLECTING: MappingProxyType({RoundState.CLOSING: 0}),
    RoundState.CLOSING: MappingProxyType({RoundState.PUBLISHED: 0}),
    RoundState.PUBLISHED: MappingProxyType({RoundState.OPEN: 1, RoundState.FINISHED: 0}),
    RoundState.FINISHED: MappingProxyType({}),
})


@dataclass(frozen=True)
class Transition:
    """A move from ``source`` in round ``source_round`` to ``target`` in round ``round``."""

    source: RoundState
    source_round: int
    target: RoundState
    round: int


def _state(value: RoundState | str) -> RoundState:
    try:
        return RoundState(value)
    except ValueError:
        raise InternalError(f"unknown round state {value!r}; states: {', '.join(RoundState)}") from None


def check_transition(source: RoundState | str, source_round: int, target: RoundState | str,
                     target_round: int) -> Transition:
    """The transition, if the table allows it; InternalError otherwise (a bug: nothing may skip a state)."""
    src, dst = _state(source), _state(target)
    step = TRANSITIONS[src].get(dst)
    enrolment = source_round == ENROLMENT_ROUND
    legal = (step is not None and target_round == source_round + step and source_round >= 0
             # round 0 only ends enrolment, and only enrolment's end moves from open to open
             and enrolment == (src == dst == RoundState.OPEN))
    if not legal:
        raise InternalError(f"illegal round transition {src} (round {source_round}) -> {dst} (round {target_round})")
    return Transition(src, source_round, dst, target_round)


def quorum_reached(updates: int, active: int, quorum: float) -> bool:
    """Every device given a task has sent, or the fraction ``quorum`` of them has (rounded up)."""
    return updates >= protocol.quorum_updates(quorum, active)


def next_state(state: RoundState | str, round: int, *, updates: int, active: int, quorum: float,
               deadline: float | None, now: float, min_updates: int, more_rounds: bool,
               enrolment_ready: bool, secure: bool | None = None) -> Transition | None:
    """The transition due now, or None. ``updates``/``active``: accepted updates of the round and devices given
    its task; a collecting round closes at quorum, or past ``deadline`` with at least ``min_updates``.
    ``more_rounds``: the federation has rounds after ``round``; ``enrolment_ready``: enough devices have
    enrolled (and, where the algorithm asks, sent their initial model) for round 1. ``secure``: None for a plain
    round; for a round under secure aggregation, whether its unmasking is done (it closes then, and only then:
    its steps have their own deadlines, server.services.secure)."""
    src = _state(state)
    if round < 0:
        raise InternalError(f"round {round} < 0")
    if round == ENROLMENT_ROUND:
        if src is not RoundState.OPEN:
            raise InternalError(f"round 0 is enrolment, always {RoundState.OPEN}; found {src}")
        return check_transition(src, round, RoundState.OPEN, round + 1) if enrolment_ready else None
    if src is RoundState.COLLECTING:
        if secure is not None:
            return check_transition(src, round, RoundState.CLOSING, round) if secure else None
        late = deadline is not None and now >= deadline and updates >= min_updates
        if not (quorum_reached(updates, active, quorum) or late):
            return None
        return check_transition(src, round, RoundState.CLOSING, round)
    target = {
        RoundState.OPEN: RoundState.COLLECTING,
        RoundState.CLOSING: RoundState.PUBLISHED,
        RoundState.PUBLISHED: RoundState.OPEN if more_rounds else RoundState.FINISHED,
    }.get(src)
    if target is None:  # finished: nothing is ever due
        return None
    return check_transition(src, round, target, round + TRANSITIONS[src][target])
