"""``ModelSkeleton``: a model's skeleton from its card answers what the algorithms ask of the model itself, and a
card that describes no model a device could hold is refused before anything is allocated for it."""

from __future__ import annotations

import pytest

from pfl_edge.algorithms import get_algorithm
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig
from pfl_edge.modelcard import ModelCard, build_card
from pfl_edge.skeleton import ModelSkeleton
from pfl_edge.split import split_keys

CFG = dict(algorithm="dispfl", model="resnet18-gn", dataset="fashion-mnist", clients=4, rounds=2)


def _card(kp: int = 2) -> tuple[ModelCard, object]:
    spec = ModelSpec("resnet18-gn", 10, 1, 28)
    model = build_model(spec)
    cfg = FederationConfig.from_dict(CFG)
    keys = [k for k in model.state_dict()][: -4 if kp else None]
    return build_card(federation="f", cfg=cfg, spec=spec, model=model, profile="phone-low", kp=kp, density=0.5,
                      base_keys=keys, programs=[], layers=[]), model


def test_the_skeleton_answers_as_the_model_does() -> None:
    card, model = _card()
    sk = ModelSkeleton.from_card(card, max_bytes=1 << 30)
    assert sk.block_names == model.block_names  # type: ignore[attr-defined]
    assert sk.block_of() == model.block_of()  # type: ignore[attr-defined]
    assert {k: tuple(v.shape) for k, v in sk.state_dict().items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()}  # type: ignore[attr-defined]
    assert [k for k, _ in sk.named_buffers()] == [k for k, _ in model.named_buffers()]  # type: ignore[attr-defined]
    for kp in (0, 1, 3):
        assert split_keys(sk, kp) == split_keys(model, kp)  # type: ignore[arg-type]
    cfg = FederationConfig.from_dict(CFG)  # DisPFL's mask counts from the skeleton, as from the model
    assert get_algorithm(cfg, sk).mask_ones(0.5) == get_algorithm(cfg, model).mask_ones(0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["negative", "huge", "ndim", "block"])
def test_a_card_that_is_no_model_is_refused(bad: str) -> None:
    card, _ = _card()
    tensors = [t.model_dump() for t in card.tensors]
    blocks = [b.model_dump() for b in card.blocks]
    if bad == "negative":
        tensors[0]["shape"] = [-1, 3]
    elif bad == "huge":
        tensors[0]["shape"] = [1 << 20, 1 << 20]
    elif bad == "ndim":
        tensors[0]["shape"] = [1] * 9
    else:
        blocks[0]["tensors"] = blocks[0]["tensors"][1:]  # a tensor names a block that does not list it
    forged = ModelCard.model_validate({**card.model_dump(), "tensors": tensors, "blocks": blocks})
    with pytest.raises(ConfigError, match="card"):
        ModelSkeleton.from_card(forged, max_bytes=256 << 20)
