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


# ------------------------------------------------------------------------------------------- in a federation

def test_a_simulated_round_under_secure_aggregation_is_the_quantized_mean() -> None:
    """``secure_mean`` runs a whole SecAgg+ round over the participants' quantized updates; its base equals the
    base plus the mean of the quantized updates worked out here in float64 (to the quantization's step, never
    more), and it is deterministic though every key is fresh (the masks cancel exactly)."""
    import torch

    from pfl_edge.federation import FederationConfig
    from pfl_edge.secagg.aggregate import secure_mean

    cfg = FederationConfig(dataset="synthetic", clients=8, secure_aggregation={"bound": 0.5, "bits": 20})
    g = torch.Generator().manual_seed(0)
    prev = {"w": torch.randn(40, 3, generator=g), "n": torch.tensor(3)}
    ups = [({"w": prev["w"] + torch.randn(40, 3, generator=g) * 0.2, "n": torch.tensor(9)}, 100.0) for _ in range(5)]
    got = secure_mean(cfg, prev, ups, 4)
    assert torch.equal(got["w"], secure_mean(cfg, prev, ups, 4)["w"]) and got["n"] is prev["n"]
    levels = (1 << 20) - 1
    q = [np.rint((np.clip((s["w"].double() - prev["w"].double()).numpy(), -0.5, 0.5) + 0.5) / 1.0 * levels)
         for s, _ in ups]
    want = prev["w"].double().numpy() + (np.sum(q, axis=0) * (1.0 / levels) - 5 * 0.5) / 5
    assert np.abs(got["w"].double().numpy() - want).max() < 1e-6  # float32 of the same float64 sum
    plain = prev["w"].double().numpy() + np.mean([np.clip((s["w"].double() - prev["w"].double()).numpy(), -0.5, 0.5)
                                                  for s, _ in ups], axis=0)
    assert np.abs(got["w"].double().numpy() - plain).max() <= 0.5 / levels + 1e-6  # half a step of 1/levels
    few = secure_mean(cfg, prev, ups[:2], 4)  # two could read each other's update from the sum: nothing moves
    assert torch.equal(few["w"], prev["w"])


def test_the_secure_aggregation_table_is_checked() -> None:
    from pfl_edge.federation import FederationConfig, check_device_config

    base = dict(dataset="synthetic", clients=8)
    with pytest.raises(ConfigError, match="bound"):
        FederationConfig(secure_aggregation={}, **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="distributed"):
        FederationConfig(secure_aggregation={}, privacy={"clip": 1.0, "noise_multiplier": 1.0},
                         **base)  # type: ignore[arg-type]
    FederationConfig(secure_aggregation={}, privacy={"clip": 1.0, "noise_multiplier": 1.0, "mode": "distributed"},
                     **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="wrap"):
        FederationConfig(secure_aggregation={"bound": 1.0, "bits": 31}, **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no key 'k'"):
        FederationConfig(secure_aggregation={"bound": 1.0, "k": 3}, **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a secure_aggregation table covers"):
        FederationConfig(algorithm="dispfl", secure_aggregation={"bound": 1.0}, **base)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step_s"):
        FederationConfig(secure_aggregation={"bound": 1.0, "step_s": 0}, **base)  # type: ignore[arg-type]
    check_device_config(FederationConfig(secure_aggregation={"bound": 1.0}, **base))  # type: ignore[arg-type]


def test_a_simulated_federation_under_secure_aggregation_trains_as_the_plain_mean_would(plain_mean: None) -> None:
    """FedPer with secure aggregation against the same run whose mean is plain but equal-weighted: the accuracy
    differs only by what 22-bit quantization moves (here: nothing a client's accuracy shows)."""
    from pfl_edge.sim import SimConfig, simulate

    quick = dict(algorithm="fedper", dataset="synthetic", partition="pathological:2", clients=6, rounds=2, kp=1,
                 samples_per_client=32, test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=2)
    secure = simulate(SimConfig(secure_aggregation={"bound": 1.0}, **quick), progress=False)  # type: ignore[arg-type]
    plain = simulate(SimConfig(**quick), progress=False)  # type: ignore[arg-type]
    assert [r["participants"] for r in secure["rounds"]] == [list(range(6))] * 2
    for a, b in zip(secure["rounds"], plain["rounds"], strict=True):  # equal data sizes: the same weights
        assert a["client_loss"] == pytest.approx(b["client_loss"], abs=1e-3)


def test_the_masked_payload_is_its_vectors() -> None:
    """docs/codec.md section 10: the worked example's bytes, written out by hand there, and the refusals."""
    from pathlib import Path

    from pfl_edge.errors import CodecError
    from pfl_edge.secagg import decode_masked, encode_masked

    vectors = Path(__file__).resolve().parents[2] / "docs" / "masked-vectors"
    want = bytes.fromhex("50464c4d 01 03000000 04000000 00000000 01000000 ffffffff 04030201".replace(" ", ""))
    y = np.array([0, 1, 2**32 - 1, 0x01020304], dtype=np.uint32)
    assert encode_masked(y, 3) == want == (vectors / "masked_round3.bin").read_bytes()
    t, back = decode_masked(want, 4)
    assert t == 3 and back.dtype == np.uint32 and back.tolist() == y.tolist()
    for name, why in (("masked_short", "this one says 4 in 25 bytes"), ("masked_bad_magic", "not a masked payload"),
                      ("masked_bad_version", "version 2")):
        with pytest.raises(CodecError, match=why):
            decode_masked((vectors / f"{name}.bin").read_bytes(), 4)
    with pytest.raises(CodecError, match="holds 5 values"):  # the right bytes for another round's size
        decode_masked(want, 5)


def test_an_unmasked_sum_no_honest_inputs_make_is_refused_before_release() -> None:
    """``check_sum``: 3 inputs of 4 bits sum to at most 45 per coordinate; 45 passes, 46 (an input out of range,
    or a sum made of a forged share) is refused and nothing is applied; ``apply_sum`` checks before it adds."""
    import torch

    from pfl_edge.federation import FederationConfig
    from pfl_edge.secagg.aggregate import SumOutOfRange, apply_sum, check_sum

    check_sum(np.array([0, 45, 7], dtype=np.uint32), 3, 4)
    with pytest.raises(SumOutOfRange, match="1 of 3 coordinates"):
        check_sum(np.array([0, 46, 7], dtype=np.uint32), 3, 4)
    cfg = FederationConfig.from_dict({"algorithm": "fedavg", "clients": 3,
                                      "secure_aggregation": {"bound": 0.5, "bits": 4}})
    prev = {"w": torch.zeros(2)}
    # honest: 3 inputs at 15 (each +0.5) and at 0 (each -0.5) -> the mean update is +0.5 and -0.5
    out = apply_sum(cfg, prev, [(np.array([45, 0], dtype=np.uint32), 3)])
    assert torch.allclose(out["w"], torch.tensor([0.5, -0.5]))
    with pytest.raises(SumOutOfRange):
        apply_sum(cfg, prev, [(np.array([2**31, 0], dtype=np.uint32), 3)])
