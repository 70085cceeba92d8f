import json
from pathlib import Path

import pytest
import torch

from pfl_edge.checkpoint import build_model, load_checkpoint, save_checkpoint
from pfl_edge.errors import ConfigError
from pfl_edge.sim import SimConfig, build_context, load_config_file, sample_participants, simulate, write_result

QUICK = dict(dataset="synthetic", partition="pathological:3", clients=4, rounds=3, samples_per_client=120,
             local_epochs=1, lr=0.05, batch_size=32)


def _run(**kw: object) -> dict:
    return simulate(SimConfig.from_dict({**QUICK, **kw}), progress=False)


def test_result_json_shape() -> None:
    r = _run(algorithm="fedper")
    assert [x["round"] for x in r["rounds"]] == [1, 2, 3]
    for x in r["rounds"]:
        assert len(x["client_acc"]) == 4 and all(0 <= a <= 1 for a in x["client_acc"])
        assert x["mean_acc"] == pytest.approx(sum(x["client_acc"]) / 4)
        mean = x["mean_acc"]
        assert x["std_acc"] == pytest.approx((sum((a - mean) ** 2 for a in x["client_acc"]) / 4) ** 0.5)
        assert x["bytes_up"] == sum(x["client_bytes_up"]) and x["bytes_down"] == sum(x["client_bytes_down"])
        assert x["busiest_node_bytes"] == x["bytes_up"] + x["bytes_down"]  # the server
        assert x["wall_s"] > 0
    assert r["final"]["client_acc"] == r["rounds"][-1]["client_acc"]
    json.dumps(r)  # serialisable


def test_fedper_uploads_only_the_base() -> None:
    r = _run(algorithm="fedper", kp=2)
    base_numel = sum(torch.Size(s).numel() for s in _shapes(r["meta"]["base_keys"]))
    up = r["rounds"][0]["client_bytes_up"]
    assert len(set(up)) == 1
    # float32 values plus the codec's header and checksum: a few hundred bytes
    assert 4 * base_numel < up[0] < 4 * base_numel + 1000
    assert not set(r["meta"]["personal_keys"]) & set(r["meta"]["base_keys"])
    assert {k.split(".")[0] for k in r["meta"]["personal_keys"]} == {"fc2", "head"}


def _shapes(keys: list[str]) -> list[tuple[int, ...]]:
    from pfl_edge.models import get_model

    sd = get_model("cnn", num_classes=10, in_channels=1).state_dict()
    return [tuple(sd[k].shape) for k in keys]


def test_kp_zero_is_exactly_fedavg() -> None:
    a = _run(algorithm="fedper", kp=0)
    b = _run(algorithm="fedavg")
    assert a["rounds"][-1]["client_acc"] == b["rounds"][-1]["client_acc"]
    assert a["rounds"][-1]["client_loss"] == b["rounds"][-1]["client_loss"]
    assert a["rounds"][-1]["bytes_up"] == b["rounds"][-1]["bytes_up"]


def test_local_sends_nothing_and_fedavg_clients_agree() -> None:
    loc = _run(algorithm="local")
    assert all(x["bytes_up"] == 0 and x["busiest_node_bytes"] == 0 for x in loc["rounds"])


def test_same_config_same_numbers() -> None:
    a, b = _run(algorithm="fedper-ft", seed=3), _run(algorithm="fedper-ft", seed=3)
    assert a["rounds"] == [dict(x, wall_s=y["wall_s"]) for x, y in zip(b["rounds"], a["rounds"], strict=True)]
    c = _run(algorithm="fedper-ft", seed=4)
    assert c["rounds"][-1]["client_acc"] != a["rounds"][-1]["client_acc"]


@pytest.mark.parametrize("alg", ["local", "fedavg", "fedavg-ft", "fedper", "fedper-ft"])
def test_every_algorithm_learns(alg: str) -> None:
    r = _run(algorithm=alg, rounds=4, partition="iid")
    assert r["final"]["mean_acc"] > 0.35  # 10 classes: chance is 0.1
    assert r["final"]["mean_acc"] > r["rounds"][0]["mean_acc"]


def test_linear_base_runs_and_has_one_base_block() -> None:
    r = _run(algorithm="fedper", base="linear", kp=2)
    assert r["meta"]["blocks"] == ["base", "fc2", "head"]
    assert {k.split(".")[0] for k in r["meta"]["base_keys"]} == {"base"}
    loc = _run(algorithm="local", base="linear", kp=2)  # the linear model trained alone
    assert loc["meta"]["blocks"] == ["base", "fc2", "head"] and loc["meta"]["base_keys"] == []


def test_participation_samples_a_fraction() -> None:
    p = sample_participants(0, 1, 100, 0.1)
    assert len(p) == 10 and len(set(p.tolist())) == 10
    assert torch.equal(p, sample_participants(0, 1, 100, 0.1))
    assert not torch.equal(p, sample_participants(0, 2, 100, 0.1))
    r = _run(algorithm="fedavg", participation=0.5)
    for x in r["rounds"]:
        assert len(x["participants"]) == 2
        assert sum(b > 0 for b in x["client_bytes_up"]) == 2


def test_devices_sample_what_the_simulator_samples() -> None:
    """A device federation samples by slot with the simulator's draw (``Algorithm.sampled``); FedPer-FT, whose
    clients adapt to every round's base sampled or not, is refused on devices with a reason."""
    from pfl_edge.algorithms import get_algorithm
    from pfl_edge.federation import FederationConfig, check_device_config

    cfg = SimConfig.from_dict({**QUICK, "algorithm": "fedper", "clients": 10, "participation": 0.3})
    algo = get_algorithm(cfg, build_model(build_context(cfg)[1]), cfg.kp)
    for t in (1, 2, 3):
        assert algo.sampled(t) == frozenset(sample_participants(cfg.seed, t, 10, 0.3).tolist())
    assert len(algo.sampled(1) or ()) == 3
    full = get_algorithm(SimConfig.from_dict({**QUICK, "algorithm": "fedper"}), algo.model, cfg.kp)
    assert full.sampled(1) is None  # everyone: no filter
    dev = dict(dataset="synthetic", clients=10, rounds=2, participation=0.3)
    check_device_config(FederationConfig.from_dict({**dev, "algorithm": "fedper"}))
    with pytest.raises(ConfigError, match=r"participation 0\.3: fedper-ft adapts"):
        check_device_config(FederationConfig.from_dict({**dev, "algorithm": "fedper-ft"}))


def test_participation_says_who_takes_part_in_each_round() -> None:
    """``Algorithm.participation(t)``: the draw by slot; round 0 takes initial models only where the algorithm
    wants them (DisPFL), and DisPFL's later rounds only devices whose initial model is in."""
    from pfl_edge.algorithms import get_algorithm

    cfg = SimConfig.from_dict({**QUICK, "algorithm": "fedper", "clients": 10, "participation": 0.3})
    model = build_model(build_context(cfg)[1])
    fedper = get_algorithm(cfg, model, cfg.kp)
    p = fedper.participation(2)
    assert p.slots == frozenset(sample_participants(cfg.seed, 2, 10, 0.3).tolist()) and not p.after_initial
    inside, outside = min(p.slots), min(set(range(10)) - p.slots)
    assert p.refusal(inside, has_initial=False) is None
    # its own draw only, neither the count nor the others' (docs/privacy.md)
    assert p.refusal(outside, has_initial=True) == (f"round 2 did not draw this device's slot ({outside}): it has "
                                                   "no task this round")
    assert "round 0 takes no updates" in (fedper.participation(0).refusal(inside, has_initial=False) or "")
    dis = get_algorithm(SimConfig.from_dict({**QUICK, "algorithm": "dispfl", "clients": 10}), model)
    assert dis.participation(0).refusal(7, has_initial=False) is None  # its initial model, whenever it enrols
    assert dis.participation(1).slots is None and dis.participation(1).after_initial
    assert "initial model" in (dis.participation(1).refusal(7, has_initial=False) or "")
    assert dis.participation(1).refusal(7, has_initial=True) is None


def test_finetune_cadence_is_selectable() -> None:
    """-FT baselines fine-tune on their cadence (``FinetuneOptions``): FedAvg-FT at the end (the reference's) is
    FedAvg, to the bit, in every round but the last; D-PSGD-FT every 2 rounds fine-tunes in rounds 2 and 3 (the
    last) only, from the all-client average if asked, and counts FT FLOPs only in those rounds."""
    from pfl_edge.algorithms import FinetuneOptions

    assert [FinetuneOptions(ft_every=0).due(t, 5) for t in range(1, 6)] == [False] * 4 + [True]
    assert [FinetuneOptions(ft_every=2).due(t, 5) for t in range(1, 6)] == [False, True, False, True, True]
    with pytest.raises(ConfigError, match="ft_every"):
        SimConfig.from_dict({**QUICK, "algorithm": "fedavg-ft", "options": {"ft_every": -1}})
    with pytest.raises(ConfigError, match="ft_from"):
        SimConfig.from_dict({**QUICK, "algorithm": "dpsgd-ft", "options": {"ft_from": "some"}})
    plain = _run(algorithm="fedavg")
    end = _run(algorithm="fedavg-ft", options={"ft_every": 0})
    every = _run(algorithm="fedavg-ft")
    for t in (0, 1):
        assert end["rounds"][t]["client_acc"] == plain["rounds"][t]["client_acc"]
    assert end["rounds"][2]["client_acc"] == every["rounds"][2]["client_acc"]  # both fine-tune the same model
    assert every["rounds"][0]["client_acc"] != plain["rounds"][0]["client_acc"]
    dec = dict(algorithm="dpsgd-ft", topology="ring")
    d = _run(**dec, options={"ft_every": 2})
    base = _run(algorithm="dpsgd", topology="ring")
    assert d["rounds"][0]["client_acc"] == base["rounds"][0]["client_acc"]
    assert d["rounds"][1]["client_acc"] != base["rounds"][1]["client_acc"]
    assert d["rounds"][0]["flops"] < d["rounds"][1]["flops"] == d["rounds"][2]["flops"]
    # a fine-tune feeds nothing back: after one, D-PSGD-FT deploys D-PSGD's models again, to the bit (the long
    # run reads D-PSGD's curve from D-PSGD-FT's rounds between fine-tunes: bench/dispfl_long.py)
    d4 = _run(**dec, rounds=4, options={"ft_every": 2, "ft_from": "all"})
    base4 = _run(algorithm="dpsgd", topology="ring", rounds=4)
    assert [r["client_acc"] for r in d4["rounds"][::2]] == [r["client_acc"] for r in base4["rounds"][::2]]
    assert d4["rounds"][3]["client_acc"] != base4["rounds"][3]["client_acc"]
    every_all = _run(**dec, options={"ft_every": 2, "ft_from": "all"})
    assert every_all["rounds"][1]["client_acc"] != d["rounds"][1]["client_acc"]  # a ring's neighbourhood is not all


@pytest.mark.parametrize("alg", ["fedper", "ditto", "local"])
def test_training_in_chunks_changes_nothing(alg: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A centralised round trains TRAIN_CHUNK clients at a time as the average asks for them; with chunks of one
    client or of all, the round's results and every client's model are the same to the bit."""
    from pfl_edge.algorithms import central

    opts = {"lam": 0.5} if alg == "ditto" else None
    whole = simulate(SimConfig.from_dict({**QUICK, "algorithm": alg, "options": opts}), save_dir=tmp_path / "a",
                     progress=False)
    monkeypatch.setattr(central, "TRAIN_CHUNK", 1)
    chunked = simulate(SimConfig.from_dict({**QUICK, "algorithm": alg, "options": opts}), save_dir=tmp_path / "b",
                       progress=False)
    for a, b in zip(whole["rounds"], chunked["rounds"], strict=True):
        assert {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}
    for f in sorted((tmp_path / "a").glob("*.safetensors")):
        x, y = load_checkpoint(f)[0], load_checkpoint(tmp_path / "b" / f.name)[0]
        assert all(torch.equal(x[k], y[k]) for k in x), f.name


def test_checkpoints_round_trip(tmp_path: Path) -> None:
    cfg = SimConfig.from_dict({**QUICK, "algorithm": "fedper"})
    r = simulate(cfg, save_dir=tmp_path, progress=False)
    state, spec, extra = load_checkpoint(tmp_path / "client_002.safetensors")
    assert extra["client"] == 2 and extra["kind"] == "client"
    model = build_model(spec)
    model.load_state_dict(state)  # strict: every tensor present, shapes right
    base, _, _ = load_checkpoint(tmp_path / "base.safetensors")
    assert set(base) == set(r["meta"]["base_keys"])
    for k, v in base.items():
        assert torch.equal(state[k], v)  # a client deploys the final base
    # and the personal blocks differ between clients
    other, _, _ = load_checkpoint(tmp_path / "client_000.safetensors")
    assert not torch.equal(other["head.weight"], state["head.weight"])
    # the saved model reproduces the reported accuracy of client 2 on its own test set
    from pfl_edge.sim import build_context
    from pfl_edge.train import evaluate

    ctx, _ = build_context(cfg)
    acc, _ = evaluate(model, {k: v[None] for k, v in state.items()}, ctx.test_data, torch.tensor([2]))
    assert acc.item() == pytest.approx(r["final"]["client_acc"][2])


def test_checkpoint_rejects_foreign_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ConfigError):
        load_checkpoint(bad)
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(1)}, str(bad))
    with pytest.raises(ConfigError, match="not a pfl-edge checkpoint"):
        load_checkpoint(bad)


def test_save_checkpoint_is_not_pickle(tmp_path: Path) -> None:
    from pfl_edge.checkpoint import ModelSpec

    p = save_checkpoint(tmp_path / "m.safetensors", {"w": torch.ones(2)}, ModelSpec("cnn", 10, 1, 28))
    assert not p.read_bytes().startswith(b"\x80")  # pickle's PROTO opcode


def test_config_rerun_from_json_and_toml(tmp_path: Path) -> None:
    r = _run(algorithm="fedavg", rounds=2)
    out = write_result(r, tmp_path / "run.json", plot=True)
    assert out.with_suffix(".png").stat().st_size > 1000
    again = simulate(SimConfig.from_dict(load_config_file(out)), progress=False)
    assert again["final"] == r["final"]
    toml = tmp_path / "c.toml"
    toml.write_text('algorithm = "fedavg"\ndataset = "synthetic"\nsamples-per-client = 120\n')
    cfg = SimConfig.from_dict(load_config_file(toml))
    assert cfg.samples_per_client == 120 and cfg.algorithm == "fedavg"


@pytest.mark.parametrize("kw,match", [
    (dict(algorithm="fedsgd"), "valid algorithms"),
    (dict(participation=0.0), "participation"),
    (dict(clients=0), "clients"),
    (dict(base="linear", algorithm="fedavg"), "linear"),
    (dict(base="linear", kp=0), "linear"),
    (dict(lr=-1.0), "lr"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(rounds="5"), "rounds must be an integer"),
    (dict(clients=2.5), "clients must be an integer"),
    (dict(densities=0.5), "densities must be"),
    (dict(algorithm="dispfl", clients=1), "at least 2 clients"),
    (dict(algorithm="dispfl", options={"topology": "random:10"}, clients=10), "random:K"),
    (dict(algorithm="dispfl", options={"topology": 7}), "topology must be"),
])
def test_bad_config(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kw)


def test_unknown_config_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config keys"):
        SimConfig.from_dict({"rounds": 3, "roudns": 4})


def test_fedper_base_is_the_sample_weighted_average_of_trained_bases(plain_mean: None) -> None:
    from pfl_edge.aggregate import weighted_average
    from pfl_edge.algorithms.central import CentralSimulation
    from pfl_edge.seeding import derive_seed
    from pfl_edge.sim import Runner
    from pfl_edge.split import take
    from pfl_edge.train import unstack

    cfg = SimConfig.from_dict({**QUICK, "algorithm": "fedper", "partition": "dirichlet:0.5", "samples_per_client": None,
                       "workers": 1})
    ctx, _ = build_context(cfg)
    n = ctx.train_data.n
    assert len(set(n.tolist())) > 1  # unequal sizes, so equal weights would give another answer
    runner = Runner(ctx)
    algo = runner.sim
    assert isinstance(algo, CentralSimulation)
    rows = torch.arange(4)
    # an independent replay of the round's training from the same start and generators
    gens = [torch.Generator().manual_seed(derive_seed(cfg.seed, "train", 1, i)) for i in range(4)]
    res = ctx.trainer.train(algo.clients, rows, cfg.train_config(1), gens)
    runner.run_round(1, rows)
    bases = [take(unstack(res.stack, i), ctx.split.base) for i in range(4)]
    expected = weighted_average(bases, n.tolist())
    equal = weighted_average(bases, [1.0] * 4)
    for k in ctx.split.base:
        assert algo.base is not None and torch.allclose(algo.base[k], expected[k], atol=1e-6)
    assert any(not torch.allclose(expected[k], equal[k], atol=1e-4) for k in ctx.split.base)
    ctx.trainer.close()


def test_fedper_ft_trains_personal_blocks_on_a_frozen_base() -> None:
    from pfl_edge.algorithms.central import CentralSimulation
    from pfl_edge.sim import Runner

    ctx, _ = build_context(SimConfig.from_dict({**QUICK, "algorithm": "fedper-ft", "workers": 1}))
    algo = Runner(ctx).sim  # fine-tunes the personal blocks on the initial base at once
    assert isinstance(algo, CentralSimulation)
    for k, v in ctx.init_state.items():
        moved = [not torch.equal(algo.clients[k][i], v) for i in range(4)]
        assert all(moved) if k in ctx.split.personal else not any(moved), k
    ctx.trainer.close()
