"""Verifiable shares (pfl_edge/secagg/verify.py): every forged message of a SecAgg+ round that only its sender
could have forged names its sender, and the round goes on without it with the exact sum of the others."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from pfl_edge.errors import ConfigError
from pfl_edge.secagg import Client, Params, Server, graph, seal
from pfl_edge.secagg.shamir import PRIME, SHARE_BYTES, split
from pfl_edge.secagg.verify import Forged, commitment, consistent, pair_key

N, K, T, SIZE = 8, 6, 5, 64
P = Params(K, T, SIZE, b"verify")


def _inputs(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 1 << 16, SIZE, dtype=np.uint32) for i in range(N)}


def _plain(inputs: dict[int, np.ndarray], who: set[int] | frozenset[int]) -> np.ndarray:
    return sum((inputs[i] for i in who), np.zeros(SIZE, np.uint32))


def _round(inputs: dict[int, np.ndarray], *,
           deal: Callable[[Client, dict[int, tuple[bytes, bytes]]], dict[int, tuple[bytes, bytes]]] | None = None,
           dealer: int = -1, complainer: int = -1, false_of: int = -1,
           reveal: Callable[[dict[int, tuple[str, bytes]]], dict[int, tuple[str, bytes]]] | None = None,
           revealer: int = -1) -> tuple[Server, set[int]]:
    """One round in this process with one hostile client: ``dealer`` deals through ``deal``, ``complainer``
    falsely accuses ``false_of``, ``revealer`` reveals through ``reveal``. Returns the server and who it named."""
    clients = {i: Client(i, P) for i in inputs}
    srv = Server(P, seed=3)
    nbrs = srv.advertised([c.advertise() for c in clients.values()])
    for i, c in clients.items():
        dealt = c.share_keys(nbrs[i])
        srv.route(i, deal(c, dealt) if i == dealer and deal else dealt)
    named: set[int] = set()
    masked = {}
    for i, c in clients.items():
        masked[i] = c.masked_input(inputs[i], srv.inbox(i))
        if i == complainer:
            c.accused.add(false_of)
            c.held.pop(false_of, None)
            masked[i] = c.masked_input(inputs[i], {j: v for j, v in srv.inbox(i).items() if j != false_of})
        if c.accused:
            named |= srv.complain(i, *c.complaint())
    for i, y in masked.items():
        if i not in srv.excluded:
            srv.receive(i, y)
    survivors, dropped = srv.unmask_request()
    for i in sorted(survivors):
        shares = clients[i].unmask(survivors, dropped)
        assert set(shares) == set(srv.asked(i))
        try:
            srv.collect(i, reveal(shares) if i == revealer and reveal else shares)
        except Forged as e:
            named.add(e.culprit)
    return srv, named


def test_an_honest_round_names_nobody_and_unmasks_the_sum() -> None:
    inputs = _inputs()
    srv, named = _round(inputs)
    assert named == set() and np.array_equal(srv.total(), _plain(inputs, set(inputs)))


def test_a_forged_unmask_share_names_its_revealer_and_the_rest_unmask_the_exact_sum() -> None:
    """The attack of issue 48: a share of a neighbour's seed revealed as y + delta (interpolation is linear, so
    the seed would come out moved by delta x its Lagrange weight). Before: the server interpolated it."""
    inputs = _inputs(1)

    def forge(shares: dict[int, tuple[str, bytes]]) -> dict[int, tuple[str, bytes]]:
        j = min(shares)
        kind, y = shares[j]
        return {**shares, j: (kind, ((int.from_bytes(y, "big") + 12345) % PRIME).to_bytes(SHARE_BYTES, "big"))}

    srv, named = _round(inputs, reveal=forge, revealer=4)
    assert named == {4}
    # the forged share is discarded; each secret still has t of its other neighbours' shares (k - t = 1 spare)
    assert np.array_equal(srv.total(), _plain(inputs, set(inputs)))


@pytest.mark.parametrize("how", ["random bytes", "other shares than committed"])
def test_a_dealer_whose_pair_does_not_open_or_check_is_named_on_its_neighbours_complaint(how: str) -> None:
    """Before, a pair of random bytes made every honest neighbour leave the round: nothing was released. Now the
    neighbour complains, the server opens the pair with the neighbour's sealing key, names the dealer and treats
    it as a dropout: the round sums the others exactly."""
    inputs = _inputs(2)
    victim = 0

    def deal(c: Client, dealt: dict[int, tuple[bytes, bytes]]) -> dict[int, tuple[bytes, bytes]]:
        j = victim if victim in dealt else min(dealt)
        box, commits = dealt[j]
        if how == "random bytes":
            return {**dealt, j: (bytes(np.random.default_rng(0).integers(0, 256, len(box), dtype=np.uint8)), commits)}
        return {**dealt, j: (box, commitment(P, "b", c.cid, j, b"\x01" * SHARE_BYTES) + commits[32:])}

    dealer = next(i for i in inputs if victim in graph(list(inputs), K, 3)[i])
    srv, named = _round(inputs, deal=deal, dealer=dealer)
    assert named == {dealer} and dealer in srv.excluded
    assert np.array_equal(srv.total(), _plain(inputs, set(inputs) - {dealer}))


def test_a_false_complaint_names_the_complainer() -> None:
    inputs = _inputs(3)
    accused = min(graph(list(inputs), K, 3)[5])
    srv, named = _round(inputs, complainer=5, false_of=accused)
    assert named == {5} and srv.excluded == {5}
    assert np.array_equal(srv.total(), _plain(inputs, set(inputs) - {5}))


def test_a_complaint_with_a_key_not_its_own_names_the_complainer() -> None:
    clients = {i: Client(i, P) for i in range(N)}
    srv = Server(P, seed=3)
    nbrs = srv.advertised([c.advertise() for c in clients.values()])
    for i, c in clients.items():
        srv.route(i, c.share_keys(nbrs[i]))
    j = min(nbrs[0])
    assert srv.complain(0, clients[1].c.secret, [j]) == {0}  # another device's key: the pair cannot open
    with pytest.raises(ConfigError, match="not dealers"):
        srv.complain(1, clients[1].c.secret, [1])


def test_a_dealer_whose_committed_shares_are_not_one_polynomial_is_named_at_unmasking() -> None:
    """A dealer may commit to whatever it deals; shares off its polynomial, each matching its own commitment,
    pass every holder's check but not the server's consistency check over more than t shares."""
    inputs = _inputs(4)

    def deal(c: Client, dealt: dict[int, tuple[bytes, bytes]]) -> dict[int, tuple[bytes, bytes]]:
        xs = [j + 1 for j in sorted(dealt)]
        sb, ss = split(c.b, xs, T), split(c.s.secret, xs, T)
        j = max(dealt)
        sb[j + 1] = ((int.from_bytes(sb[j + 1], "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big")
        out = {}
        for k, adv in c.neighbours.items():
            body = c.cid.to_bytes(4, "big") + k.to_bytes(4, "big") + sb[k + 1] + ss[k + 1]
            aad = b"pfl-secagg:" + P.round_id + c.cid.to_bytes(4, "big") + k.to_bytes(4, "big")
            out[k] = (seal(pair_key(P, c.c, adv.c_public), body, aad),
                      commitment(P, "b", c.cid, k, sb[k + 1]) + commitment(P, "s", c.cid, k, ss[k + 1]))
        return out

    srv, named = _round(inputs, deal=deal, dealer=2)
    assert named == set()  # every pair opened and matched its commitments
    with pytest.raises(Forged) as e:
        srv.total()
    assert e.value.culprit == 2


def test_consistency_against_a_hand_worked_polynomial() -> None:
    # f(x) = 7 + 3x over the field: shares at 1, 2, 3 are 10, 13, 16
    share = {x: (7 + 3 * x).to_bytes(SHARE_BYTES, "big") for x in (1, 2, 3)}
    assert consistent(share, 2) and consistent({1: share[1], 2: share[2]}, 2)
    assert not consistent({**share, 3: (17).to_bytes(SHARE_BYTES, "big")}, 2)


def test_the_commitment_vector_of_the_protocol_doc() -> None:
    """docs/protocol.md, "Secure aggregation": the vector a device written from the docs checks itself against."""
    from pathlib import Path

    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8").split())
    p = Params(2, 2, 1, b"fed:3")
    for kind in ("b", "s"):
        got = commitment(p, kind, 1, 0, bytes(range(66))).hex()
        assert f"`{kind}` gives `{got}`" in doc


def test_the_evaluator_is_lagrange_interpolation() -> None:
    """``shamir.evaluator`` (barycentric weights, one inversion in all) against the polynomial itself, evaluated
    term by term with Python integers, at points inside and outside the ones it was built from."""
    import random

    from pfl_edge.secagg.shamir import evaluator

    rng = random.Random(7)
    for t in (1, 2, 5, 21):
        coeffs = [rng.randrange(PRIME) for _ in range(t)]

        def f(x: int, coeffs: list[int] = coeffs) -> int:
            return sum(a * pow(x, k, PRIME) for k, a in enumerate(coeffs)) % PRIME

        xs = rng.sample(range(1, 2**31), t + 5)
        at = evaluator([(x, f(x)) for x in xs[:t]])
        assert all(at(x) == f(x) for x in [0, *xs])
