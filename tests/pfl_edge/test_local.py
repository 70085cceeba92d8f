"""pfl_edge.local, the device's side of a round, against the in-process simulator: devices that each run their
own round functions (and a server that averages their uploads) end with the simulator's models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pfl_edge.aggregate import weighted_average
from pfl_edge.checkpoint import load_checkpoint
from pfl_edge.codec import decode
from pfl_edge.local import (
    base_payload,
    decode_model,
    device_split,
    dispfl_average,
    dispfl_init,
    dispfl_payload,
    dispfl_update_mask,
    evaluate_local,
    init_state,
    load_local_data,
    personal_finetune,
    train_local,
)
from pfl_edge.sim import SimConfig, simulate
from pfl_edge.split import take
from pfl_edge.topology import neighbours

QUICK = dict(dataset="synthetic", partition="pathological:2", clients=4, rounds=2, samples_per_client=48,
             test_per_client=32, local_epochs=1, batch_size=16, lr=0.05, workers=1, seed=3)


def _sim(cfg: SimConfig, tmp: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    res = simulate(cfg, save_dir=tmp, progress=False)
    return res, [load_checkpoint(tmp / f"client_{i:03d}.safetensors")[0] for i in range(cfg.clients)]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same numbers, bit for bit: devices run the simulator's arithmetic in the simulator's order."""
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("algorithm", ["fedper", "fedper-ft", "fedavg"])
def test_fedper_devices_match_simulator(tmp_path: Path, algorithm: str) -> None:
    cfg = SimConfig(algorithm=algorithm, kp=2, **QUICK)
    res, want = _sim(cfg, tmp_path)
    data = [load_local_data(cfg, i) for i in range(cfg.clients)]
    init = init_state(cfg, data[0].spec)
    splits = [device_split(d.model, cfg, cfg.kp) for d in data]
    states = [dict(init) for _ in data]
    base = take(init, splits[0].base)
    ft = algorithm == "fedper-ft"
    if ft:
        states = [personal_finetune(data[i], states[i], splits[i], cfg, 0, i) for i in range(cfg.clients)]
    for t in range(1, cfg.rounds + 1):
        uploads, weights = [], []
        for i, d in enumerate(data):
            states[i], _, _ = train_local(d, {**states[i], **base}, cfg, t, i)
            payload = base_payload(states[i], splits[i], d.spec, t)
            # nothing personal in what leaves the device
            assert set(decode(payload).tensors) == set(splits[i].base)
            uploads.append(decode(payload).tensors)
            weights.append(d.n_train)
        base = weighted_average(uploads, weights)
        states = [{**s, **base} for s in states]
        if ft:
            states = [personal_finetune(data[i], states[i], splits[i], cfg, t, i) for i in range(cfg.clients)]
        accs = [evaluate_local(d, s)[0] for d, s in zip(data, states, strict=False)]
        assert accs == pytest.approx(res["rounds"][t - 1]["client_acc"], abs=1e-6)
    for i in range(cfg.clients):
        _close(states[i], want[i])


@pytest.mark.parametrize("regrow", ["gradient", "random"])
def test_dispfl_devices_match_simulator(tmp_path: Path, regrow: str) -> None:
    cfg = SimConfig(algorithm="dispfl", densities=(0.3, 0.6, 1.0), topology="random:2", regrow=regrow, **QUICK)
    res, want = _sim(cfg, tmp_path)
    data = [load_local_data(cfg, i) for i in range(cfg.clients)]
    init = init_state(cfg, data[0].spec)
    w, m = zip(*(dispfl_init(d, cfg, i, cfg.client_density(i), init) for i, d in enumerate(data)), strict=True)
    weights, masks = list(w), list(m)
    payloads = [dispfl_payload(weights[i], masks[i], d.spec, 0) for i, d in enumerate(data)]
    for t in range(1, cfg.rounds + 1):
        nbrs = neighbours(cfg.topology_spec, cfg.clients, t, cfg.seed)
        new_payloads = []
        for i, d in enumerate(data):
            others = [(j, decode_model(payloads[j], d, max_bytes=1 << 26)) for j in nbrs[i]]
            start = dispfl_average(weights[i], masks[i], i, others)
            trained, _, _ = train_local(d, start, cfg, t, i, masks=masks[i])
            acc, _ = evaluate_local(d, trained)
            assert acc == pytest.approx(res["rounds"][t - 1]["client_acc"][i], abs=1e-6)
            if t == cfg.rounds:
                _close(trained, want[i])  # the simulator deploys the trained model, before the mask update
            weights[i], masks[i] = dispfl_update_mask(d, trained, masks[i], cfg, t, i)
            for k, mk in masks[i].items():
                assert bool((weights[i][k][mk == 0] == 0).all())
            new_payloads.append(dispfl_payload(weights[i], masks[i], d.spec, t))
        payloads = new_payloads
