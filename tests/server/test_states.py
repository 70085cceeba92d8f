"""The round state machine without a server: every transition of the table, the quorum, deadline and
min_updates rules at their edges, and illegal moves refused with the project's internal error."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from pfl_edge import protocol
from pfl_edge.errors import InternalError
from server.services import RoundMachine
from server.states import TRANSITIONS, RoundState, Transition, check_transition, next_state, quorum_reached

S = RoundState
NOW = 1000.0


def due(state: RoundState | str, t: int, **facts: Any) -> Transition | None:
    """next_state with neutral facts (nothing collected, no deadline) unless given."""
    base: dict[str, Any] = dict(updates=0, active=3, quorum=1.0, deadline=None, now=NOW, min_updates=1,
                                more_rounds=True, enrolment_ready=False)
    return next_state(state, t, **{**base, **facts})


def test_states_are_the_protocols_strings() -> None:
    assert [s.value for s in RoundState] == list(typing.get_args(protocol.RoundState))
    assert RoundState("collecting") is S.COLLECTING  # as stored in the database
    assert S.PUBLISHED == "published"


def test_enrolment_opens_round_1_only_when_ready() -> None:
    assert due(S.OPEN, 0) is None
    assert due(S.OPEN, 0, enrolment_ready=True) == Transition(S.OPEN, 0, S.OPEN, 1)
    # enrolment readiness means nothing once round 1 is open
    assert due(S.OPEN, 1, enrolment_ready=False) == Transition(S.OPEN, 1, S.COLLECTING, 1)
    with pytest.raises(InternalError, match="round 0 is enrolment"):
        due(S.COLLECTING, 0, enrolment_ready=True)


def test_every_transition_of_the_table_is_due_somewhere() -> None:
    got = {
        due(S.OPEN, 0, enrolment_ready=True),
        due(S.OPEN, 2),
        due(S.COLLECTING, 2, updates=3),
        due(S.CLOSING, 2),
        due(S.PUBLISHED, 2),
        due(S.PUBLISHED, 3, more_rounds=False),
    }
    assert got == {Transition(S.OPEN, 0, S.OPEN, 1), Transition(S.OPEN, 2, S.COLLECTING, 2),
                   Transition(S.COLLECTING, 2, S.CLOSING, 2), Transition(S.CLOSING, 2, S.PUBLISHED, 2),
                   Transition(S.PUBLISHED, 2, S.OPEN, 3), Transition(S.PUBLISHED, 3, S.FINISHED, 3)}
    table = {(src, dst) for src, moves in TRANSITIONS.items() for dst in moves}
    assert {(tr.source, tr.target) for tr in got if tr is not None} == table
    assert due(S.FINISHED, 3, more_rounds=False) is None
    assert TRANSITIONS[S.FINISHED] == {}


def test_the_round_machine_makes_exactly_the_tables_transitions() -> None:
    table = {(src, dst) for src, moves in TRANSITIONS.items() for dst in moves}
    machine = RoundMachine(None, None, None, None)  # type: ignore[arg-type]  # only its table is read
    assert machine.transitions == table


@pytest.mark.parametrize(("updates", "active", "quorum", "closes"), [
    (2, 3, 1.0, False),
    (3, 3, 1.0, True),
    (4, 3, 1.0, True),  # a late joiner's extra update counts too
    (1, 4, 0.5, False),
    (2, 4, 0.5, True),
    (1, 3, 0.3, True),  # ceil(0.9) = 1
    (6, 10, 0.7, False),
    (7, 10, 0.7, True),  # 0.7 * 10 is 7.000000000000001 in floating point: still 7 updates, not 8
    (0, 0, 1.0, True),  # a round nobody was given a task in closes at once
])
def test_quorum(updates: int, active: int, quorum: float, closes: bool) -> None:
    assert quorum_reached(updates, active, quorum) is closes
    want = Transition(S.COLLECTING, 1, S.CLOSING, 1) if closes else None
    assert due(S.COLLECTING, 1, updates=updates, active=active, quorum=quorum) == want


@pytest.mark.parametrize(("now", "updates", "min_updates", "closes"), [
    (NOW - 0.001, 1, 1, False),  # before the deadline: only the quorum closes
    (NOW, 1, 1, True),  # at the deadline
    (NOW + 5, 1, 2, False),  # past it, but fewer than min_updates: the round waits
    (NOW + 5, 2, 2, True),
    (NOW + 5, 0, 1, False),
])
def test_deadline_and_min_updates(now: float, updates: int, min_updates: int, closes: bool) -> None:
    got = due(S.COLLECTING, 2, updates=updates, active=5, deadline=NOW, now=now, min_updates=min_updates)
    assert got == (Transition(S.COLLECTING, 2, S.CLOSING, 2) if closes else None)


def test_no_deadline_never_closes_by_time() -> None:
    assert due(S.COLLECTING, 2, updates=2, active=5, deadline=None, now=1e12) is None


@pytest.mark.parametrize(("src", "t", "dst", "t2"), [
    (S.COLLECTING, 1, S.PUBLISHED, 1),  # skips closing
    (S.OPEN, 1, S.CLOSING, 1),
    (S.FINISHED, 2, S.OPEN, 3),
    (S.PUBLISHED, 1, S.OPEN, 1),  # the next round must be t + 1
    (S.PUBLISHED, 1, S.OPEN, 3),
    (S.OPEN, 1, S.OPEN, 2),  # open -> open is enrolment's end only
    (S.OPEN, 0, S.COLLECTING, 0),  # round 0 collects nothing
    (S.PUBLISHED, 0, S.OPEN, 1),
    (S.CLOSING, 1, S.OPEN, 2),
    (S.OPEN, -1, S.OPEN, 0),
])
def test_illegal_transitions_are_refused(src: RoundState, t: int, dst: RoundState, t2: int) -> None:
    with pytest.raises(InternalError, match="illegal round transition"):
        check_transition(src, t, dst, t2)


def test_legal_transitions_accept_stored_strings() -> None:
    assert check_transition("published", 4, "open", 5) == Transition(S.PUBLISHED, 4, S.OPEN, 5)
    assert check_transition("open", 0, "open", 1) == Transition(S.OPEN, 0, S.OPEN, 1)


def test_unknown_states_and_rounds_are_internal_errors() -> None:
    with pytest.raises(InternalError, match="unknown round state 'aggregating'"):
        due("aggregating", 1)
    with pytest.raises(InternalError, match="unknown round state"):
        check_transition(S.OPEN, 1, "done", 1)
    with pytest.raises(InternalError, match="round -1"):
        due(S.OPEN, -1)
