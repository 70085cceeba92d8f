"""The -FT baselines' fine-tune as the DisPFL authors' code runs it (issue 37): ``ft_recipe = "reference"`` trains
for the local epoch count at ``lr * lr_decay ** -1`` (their ``client.train(w, -1)``), D-PSGD-FT from the uniform
mean of every client's trained model (their ``w_global``); and D-PSGD's curve as the paper draws it (that uniform
mean on each client's test set) beside what each client deploys. Checked by recording what the trainer is asked
to do, against an independent float64 mean."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pfl_edge.algorithms import FinetuneOptions
from pfl_edge.errors import ConfigError
from pfl_edge.parallel import Trainer
from pfl_edge.sim import SimConfig, simulate

QUICK: dict[str, Any] = dict(dataset="synthetic", partition="pathological:3", clients=4, rounds=2,
                             samples_per_client=64, local_epochs=3, ft_epochs=1, lr=0.05, lr_decay=0.9,
                             batch_size=32, workers=1, topology="random:1")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every ``Trainer.train`` call of a run: its config, and copies of its starting and trained stacks."""
    seen: list[dict[str, Any]] = []
    real = Trainer.train

    def train(self: Trainer, stack: Any, rows: Any, cfg: Any, gens: Any, **kw: Any) -> Any:
        seen.append({"cfg": cfg, "start": {k: v.clone() for k, v in stack.items()}})
        out = real(self, stack, rows, cfg, gens, **kw)
        seen[-1]["out"] = {k: v.clone() for k, v in out.stack.items()}
        return out

    monkeypatch.setattr(Trainer, "train", train)
    yield seen


def test_reference_recipe_trains_local_epochs_at_the_references_lr_from_the_uniform_mean(
        calls: list[dict[str, Any]]) -> None:
    opts = {"ft_every": 1, "ft_from": "uniform", "ft_recipe": "reference"}
    simulate(SimConfig.from_dict({**QUICK, "algorithm": "dpsgd-ft", "options": opts}), progress=False)
    assert len(calls) == 4  # each round: the training, then the fine-tune
    for t, (training, ft) in enumerate(zip(calls[::2], calls[1::2], strict=True), start=1):
        assert training["cfg"].epochs == 3 and training["cfg"].lr == pytest.approx(0.05 * 0.9 ** (t - 1))
        assert ft["cfg"].epochs == 3  # the local epoch count, not ft_epochs
        assert ft["cfg"].lr == 0.05 * 0.9 ** -1  # the reference's round -1, to the bit, whatever the round
        for k, trained in training["out"].items():  # every client starts from the uniform mean of the trained
            if not trained.is_floating_point():
                continue
            want = trained.double().mean(0)
            for i in range(4):
                torch.testing.assert_close(ft["start"][k][i].double(), want, rtol=0, atol=1e-6)
    # the mean of the clients' neighbourhood averages (ft_from "all") weights a client by how many neighbourhoods
    # hold it, and random:1's do not hold each client equally often: another start
    calls.clear()
    simulate(SimConfig.from_dict({**QUICK, "algorithm": "dpsgd-ft", "options": {**opts, "ft_from": "all"}}),
             progress=False)
    k = next(k for k, v in calls[0]["out"].items() if v.is_floating_point())
    assert not torch.allclose(calls[1]["start"][k][0].double(), calls[0]["out"][k].double().mean(0), atol=1e-5)
    # today's recipe, for contrast: ft_epochs at the round's lr, from each client's neighbourhood average
    calls.clear()
    simulate(SimConfig.from_dict({**QUICK, "algorithm": "dpsgd-ft", "options": {"ft_every": 1}}), progress=False)
    assert [c["cfg"].epochs for c in calls[1::2]] == [1, 1]
    assert calls[3]["cfg"].lr == pytest.approx(0.05 * 0.9)
    k = next(k for k, v in calls[0]["out"].items() if v.is_floating_point())
    assert not torch.allclose(calls[1]["start"][k][0], calls[0]["out"][k].double().mean(0).float(), atol=1e-6)


def test_fedavg_ft_under_the_reference_recipe_fine_tunes_once_at_the_end(calls: list[dict[str, Any]],
                                                                      plain_mean: None) -> None:
    opts = {"ft_every": 0, "ft_recipe": "reference"}
    res = simulate(SimConfig.from_dict({**QUICK, "algorithm": "fedavg-ft", "options": opts}), progress=False)
    ft = [c for c in calls if c["cfg"].lr == 0.05 * 0.9 ** -1]
    assert len(ft) == 1 and ft[0]["cfg"].epochs == 3 and len(calls) == 3  # two rounds' training, one fine-tune
    # its FLOPs count the fine-tune's 3 epochs in the last round: 3 (trained) + 3 (fine-tuned) against 3
    assert res["rounds"][1]["flops"] == pytest.approx(2 * res["rounds"][0]["flops"])
    with pytest.raises(ConfigError, match="ft_recipe"):
        FinetuneOptions(ft_recipe="paper")  # type: ignore[arg-type]


def test_dpsgd_reports_the_papers_curve_beside_what_clients_deploy() -> None:
    res = simulate(SimConfig.from_dict({**QUICK, "algorithm": "dpsgd"}), progress=False)
    for r in res["rounds"]:
        assert len(r["client_acc_global"]) == 4
        assert r["mean_acc_global"] == pytest.approx(sum(r["client_acc_global"]) / 4)
    # a neighbourhood's average is not the all-client mean: the two figures differ
    assert any(r["client_acc_global"] != r["client_acc"] for r in res["rounds"])
