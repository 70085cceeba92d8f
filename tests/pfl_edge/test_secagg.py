"""SecAgg+ (pfl_edge.secagg): Shamir sharing against the secret it shared, the sealed shares against tampering,
the round's graph, and whole rounds: the server's unmasked sum equals the plain sum of the survivors' inputs with
no dropout and with as many as the threshold allows, refuses (clearly) with more, and a client never reveals
both secrets of a neighbour; what the server stores of an input is indistinguishable from uniform noise."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pfl_edge.errors import CodecError, ConfigError
from pfl_edge.secagg import (
    KeyPair,
    Params,
    combine,
    dequantize_sum,
    graph,
    open_sealed,
    prg,
    quantize,
    run_round,
    seal,
    split,
)
from pfl_edge.secagg.protocol import Client


def test_any_threshold_shares_recover_the_secret_and_fewer_do_not() -> None:
    secret = bytes(range(32))
    shares = split(secret, [1, 2, 3, 4, 5], 3)
    for subset in itertools.combinations(shares, 3):
        assert combine({x: shares[x] for x in subset}, 3) == secret
    two = {1: shares[1], 2: shares[2]}
    with pytest.raises(ConfigError, match="2 shares, 3 needed"):
        combine(two, 3)
    # two shares and a guessed third: not the secret (a share is uniform without the others)
    forged = {**two, 3: (int.from_bytes(shares[3], "big") ^ 1).to_bytes(66, "big")}
    with pytest.raises(ConfigError):
        if combine(forged, 3) != secret:  # a wrong secret of 32 bytes is possible only with negligible odds
            raise ConfigError("wrong secret")
    with pytest.raises(ConfigError, match="distinct"):
        split(secret, [1, 1, 2], 2)


def test_sealed_shares_open_only_for_their_pair_and_round() -> None:
    a, b = KeyPair(), KeyPair()
    key = a.agree(b.public, b"info")
    assert key == b.agree(a.public, b"info") and key != a.agree(b.public, b"other")
    box = seal(key, b"share", b"aad")
    assert open_sealed(key, box, b"aad") == b"share"
    for bad_key, bad_box, aad in ((key, box[:-1] + bytes([box[-1] ^ 1]), b"aad"), (key, box, b"other"),
                                  (a.agree(KeyPair().public, b"info"), box, b"aad")):
        with pytest.raises(CodecError, match="does not open"):
            open_sealed(bad_key, bad_box, aad)
    assert np.array_equal(prg(key, 10), prg(key, 10)) and not np.array_equal(prg(key, 10), prg(bytes(32), 10))


def test_the_graph_is_symmetric_of_the_degree_and_drawn_from_the_seed() -> None:
    ids = list(range(3, 40))
    g = graph(ids, 6, 7)
    assert set(g) == set(ids) and all(len(nb) == 6 and i not in nb for i, nb in g.items())
    assert all(i in g[j] for i, nb in g.items() for j in nb)
    assert g == graph(ids, 6, 7) and g != graph(ids, 6, 8)
    assert graph([1, 2, 3], 4, 0) == {1: frozenset({2, 3}), 2: frozenset({1, 3}), 3: frozenset({1, 2})}


def _inputs(n: int, size: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 2**32, size, dtype=np.uint32) for i in range(n)}  # full range: sums wrap


def _plain(inputs: dict[int, np.ndarray], who: frozenset[int]) -> np.ndarray:
    return (sum(0 + inputs[i].astype(np.uint64) for i in who) % 2**32).astype(np.uint32)


def test_no_dropout_publishes_the_plain_sum() -> None:
    inputs = _inputs(10, 500)
    for degree, threshold in ((4, 3), (10, 6)):  # SecAgg+'s sparse graph; everyone (the 2017 protocol)
        total, survivors, _ = run_round(inputs, Params(degree, threshold, 500, b"r"), seed=3)
        assert survivors == frozenset(range(10)) and np.array_equal(total, _plain(inputs, survivors))


def _droppable(g: dict[int, frozenset[int]], most: int) -> set[int]:
    """As many clients as possible such that no client loses more than ``most`` of its neighbours."""
    out: set[int] = set()
    for c in sorted(g):
        if all(len(g[j] & (out | {c})) <= most for j in g if j not in out | {c}):
            out.add(c)
    return out


def test_threshold_many_dropouts_after_sharing_still_publish_the_survivors_sum() -> None:
    n, k, t = 16, 6, 4
    inputs = _inputs(n, 300, seed=1)
    params = Params(k, t, 300, b"round-9")
    drop = _droppable(graph(list(range(n)), k, 5), k - t)
    assert len(drop) >= 3  # every neighbourhood of a survivor loses exactly what the threshold allows, or less
    total, survivors, _ = run_round(inputs, params, seed=5, drop={"input": drop})
    assert survivors == frozenset(range(n)) - drop and np.array_equal(total, _plain(inputs, survivors))
    # dropping at each other step too: before sharing (never masked with), after sending (its shares not needed)
    before, after = 0, 1
    rest = _droppable(graph(list(range(n)), k, 5), k - t - 1)
    total, survivors, _ = run_round(inputs, params, seed=5,
                                    drop={"share": {before}, "input": rest - {before, after}, "unmask": {after}})
    assert before not in survivors and after in survivors
    assert np.array_equal(total, _plain(inputs, survivors))
    with pytest.raises(ConfigError, match="cannot be unmasked"):
        run_round(inputs, params, seed=5, drop={"input": set(range(1, 12))})


def test_a_client_never_reveals_both_secrets_of_a_neighbour() -> None:
    p = Params(2, 2, 4, b"r")
    a, b, c = Client(0, p), Client(1, p), Client(2, p)
    boxes = {x.cid: x.share_keys({y.cid: y.advertise() for y in (a, b, c) if y is not x}) for x in (a, b, c)}
    a.masked_input(np.zeros(4, np.uint32), {j: boxes[j][0] for j in (1, 2)})
    assert set(a.unmask(frozenset({0, 1}), frozenset({2}))) == {1, 2}
    with pytest.raises(ConfigError, match="revealed already"):  # 2 "dropped" before: now asked as a survivor
        a.unmask(frozenset({0, 1, 2}), frozenset())
    with pytest.raises(ConfigError, match="both ways"):
        a.unmask(frozenset({0, 1}), frozenset({1}))
    with pytest.raises(ConfigError, match="fewer survivors"):
        a.unmask(frozenset({0}), frozenset({1, 2}))


def _chi2_uniform(x: np.ndarray) -> float:
    """Pearson's statistic of the top byte of each uint32 against 256 equal bins."""
    counts = np.bincount((x >> 24).astype(np.int64), minlength=256)
    expected = len(x) / 256
    return float(((counts - expected) ** 2 / expected).sum())


def test_a_stored_input_is_indistinguishable_from_noise() -> None:
    """What the server holds of a client: y = x + masks. For x all zeros and x all 2^31 (and a skewed x), the top
    byte of y passes Pearson's chi-square test of uniformity over 256 bins (255 degrees of freedom: the 1e-6 upper
    quantile is about 370), as the masks' keystream does on its own; x itself fails it by orders of magnitude."""
    size = 1 << 16
    p = Params(4, 3, size, b"r")
    for x in (np.zeros(size, np.uint32), np.full(size, 2**31, np.uint32),
              (np.arange(size) % 7).astype(np.uint32) * 1000):
        clients = [Client(i, p) for i in range(5)]
        adv = {c.cid: c.advertise() for c in clients}
        g = graph(list(adv), 4, 0)
        boxes = {c.cid: c.share_keys({j: adv[j] for j in g[c.cid]}) for c in clients}
        y = clients[0].masked_input(x, {j: boxes[j][0] for j in g[0]})
        assert _chi2_uniform(y) < 370, _chi2_uniform(y)
        assert _chi2_uniform(x) > 10_000 or not x.any() or _chi2_uniform(x) > 370


def test_quantized_sums_give_the_mean_within_the_rounding() -> None:
    rng = np.random.default_rng(2)
    xs = {i: rng.normal(0, 0.3, 200) for i in range(8)}
    bound, bits = 1.0, 20
    q = {i: quantize(x, bound, bits) for i, x in xs.items()}
    total, survivors, _ = run_round(q, Params(4, 3, 200, b"q"), seed=1)
    assert np.array_equal(total, _plain(q, survivors))  # exact on the integers
    got = dequantize_sum(total, 8, bound, bits) / 8
    want = np.mean([np.clip(x, -bound, bound) for x in xs.values()], axis=0)
    assert np.abs(got - want).max() <= (2 * bound / ((1 << bits) - 1)) / 2 + 1e-12
    with pytest.raises(ConfigError, match="wrap around"):
        dequantize_sum(total, 8192, bound, bits)
