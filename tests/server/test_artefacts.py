"""The model as an artefact: the model card and the programs it lists, served by a real app (one for the module;
its exports take seconds). Each claim of the card is held to an independent computation: the layer list run with
torch.nn.functional against the real module, the normalisation against pfl_edge.data's loaders, the ONNX program
in onnxruntime (with the device's own weights swapped in) and the training program's gradients against autograd."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient
from server_testkit import FEDPER, Dev, bearer, create

from edge_runtime.http import Http
from edge_runtime.programs import ProgramSource
from edge_runtime.training import ExecuTorchBackend, OnnxBackend
from export.worker import gradient_mismatches
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.data import get_dataset
from pfl_edge.errors import ConfigError
from pfl_edge.federation import FederationConfig, model_id
from pfl_edge.modelcard import Layer, ModelCard, dataset_normalisation, describe_layers, own_images_normalisation
from pfl_edge.models import get_model
from server.app import create_app
from server.fedmodel import fed_model
from server.routers.models import program_keys
from server.services.artefacts import Artefacts
from server.settings import Settings

ADMIN = "admin-token-artefacts"
CFG: dict[str, Any] = dict(FEDPER, algorithm="fedper-ft")  # cnn on synthetic data, K_P 2, batch 16
OTHER: dict[str, Any] = dict(FEDPER, batch_size=8)  # same model, other batch: other training programs
GN: dict[str, Any] = dict(FEDPER, model="mobilenet-v1")  # GroupNorm, 15 blocks, on synthetic 1x28x28 images


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[dict[str, Any]]:
    """Federation f (a phone-mid device d, which trains with ExecuTorch) and g (device e); f's card, fetched by d
    once its programs are exported (the first answer is kept: it must be a 503)."""
    tmp = tmp_path_factory.mktemp("artefacts")
    settings = Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}", broker_url=broker_url,
                        admin_token=ADMIN, programs_dir=tmp / "data" / "programs")  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        create(c, ADMIN, "f", CFG)
        create(c, ADMIN, "g", OTHER)
        d, e = Dev(c, "f"), Dev(c, "g")
        first = c.get("/v1/federations/f/model", headers=d.h)
        started = time.monotonic()
        r = first
        while r.status_code == 503 and time.monotonic() - started < 600:
            time.sleep(1.0)
            r = c.get("/v1/federations/f/model", headers=d.h)
        assert r.status_code == 200, r.text
        yield {"c": c, "d": d, "e": e, "first": first, "card": ModelCard.model_validate(r.json()),
               "root": settings.data_dir / "programs", "arts": c.app.state.artefacts}  # type: ignore[attr-defined]


def _program(app: dict[str, Any], kind: str, mode: str | None = None) -> tuple[Any, bytes]:
    card: ModelCard = app["card"]
    info = next(p for p in card.programs if p.kind == kind and p.mode == mode)
    r = app["c"].get(info.url, headers=app["d"].h)
    assert r.status_code == 200, r.text
    return info, r.content


def _against_autograd(backend: Any, state_seed: int, batch_seed: int, n: int) -> tuple[Any, ...]:
    """A program backend's loss and gradients on ``n`` random samples at random weights, and autograd's on the
    same (its loss, its model with ``.grad`` filled, the weights): (loss, grads, ref, model, state)."""
    model = build_model(fed_model(CFG).spec)
    state = _random_state(model, state_seed)
    backend.load(state)
    model.load_state_dict(state)
    gen = torch.Generator().manual_seed(batch_seed)
    x, y = torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    loss, grads = backend.gradients(x, y)
    ref = F.cross_entropy(model(x), y)
    ref.backward()
    return loss, grads, ref, model, state


def _random_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in model.state_dict().items()}


def forward_from_layers(layers: list[Layer], state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The card's layer list, run op by op with torch.nn.functional (no module of the model involved)."""
    env = {"input": x}
    for ly in layers:
        a = [env[i] for i in ly.inputs]
        w = state[ly.weight] if ly.weight else None
        b = state[ly.bias] if ly.bias else None
        if ly.type == "conv2d":
            y = F.conv2d(a[0], w, b, stride=ly.stride, padding=ly.padding, dilation=ly.dilation, groups=ly.groups)
        elif ly.type == "linear":
            y = F.linear(a[0], w, b)
        elif ly.type == "groupnorm":
            y = F.group_norm(a[0], ly.num_groups or 0, w, b, ly.eps or 0.0)
        elif ly.type == "relu":
            y = F.relu(a[0])
        elif ly.type == "flatten":
            assert ly.order == "NCHW"
            y = a[0].reshape(len(x), -1)
        elif ly.type == "mean":
            y = a[0].mean(dim=ly.dims)
        elif ly.type == "add":
            y = a[0] + a[1]
        elif ly.type == "reshape":
            y = a[0].reshape(len(x), *(ly.shape or []))
        elif ly.type == "identity":
            y = a[0]
        else:
            raise AssertionError(f"unexpected layer type {ly.type}")
        assert list(y.shape[1:]) == ly.output_shape, ly
        assert ly.name not in env
        env[ly.name] = y
    return env[layers[-1].name]


# ------------------------------------------------------------------------------------------- the card


def test_the_card_describes_the_federations_model_for_the_device(app: dict[str, Any]) -> None:
    card: ModelCard = app["card"]
    cfg = FederationConfig.from_dict(CFG)
    fm = fed_model(CFG)
    assert app["first"].status_code == 503 and int(app["first"].headers["retry-after"]) >= 1
    assert card.model_id == model_id(fm.spec) and card.model == "cnn" and card.num_classes == fm.spec.num_classes
    assert card.profile == "phone-mid" and card.federation == "f" and card.kp == app["d"].e["kp"] == 2
    assert card.input.shape == [1, 28, 28] and card.input.dtype == "f32" and card.input.layout == "NCHW"
    state = fm.model.state_dict()
    assert [t.name for t in card.tensors] == list(state) and all(list(state[t.name].shape) == t.shape
                                                                 for t in card.tensors)
    assert [b.name for b in card.blocks] == fm.model.block_names
    assert [b.name for b in card.blocks if b.personal] == ["fc2", "head"]  # K_P 2: the last two blocks
    assert card.base_keys == list(fm.base_keys(2)) and set(card.personal_keys) == set(state) - set(card.base_keys)
    tr = card.training
    assert (tr.lr, tr.momentum, tr.batch_size, tr.local_epochs, tr.ft_epochs) == (
        cfg.lr_at(1), cfg.momentum, cfg.batch_size, cfg.local_epochs, cfg.ft_epochs)
    assert eval(tr.lr_schedule.formula, {}, {"lr": 0.1, "lr_decay": 0.5, "t": 3}) == pytest.approx(
        FederationConfig.from_dict({**CFG, "lr": 0.1, "lr_decay": 0.5}).lr_at(3))
    kinds = sorted((p.kind, p.runtime, p.mode) for p in card.programs)
    assert kinds == [("inference", "onnxruntime", None), ("training", "executorch", "fedper"),
                     ("training", "executorch", "personal")]


@pytest.mark.parametrize("spec", [ModelSpec("cnn", 10, 1, 28), ModelSpec("cnn", 10, 1, 28, "linear", 2)])
def test_the_layer_list_reproduces_the_model(app: dict[str, Any], spec: ModelSpec) -> None:
    """The served card's layers (and those of FedPer's linear-base control) run with F.* give the model's logits."""
    model = build_model(spec)
    layers = app["card"].layers if spec.base == "deep" else describe_layers(model, (1, 28, 28))
    state = _random_state(model, 1)
    model.load_state_dict(state)
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(forward_from_layers(layers, state, x), model(x), atol=1e-5)


def test_residual_and_depthwise_models_are_described_as_graphs() -> None:
    for name, kw in (("resnet18-gn", {"width": 8}), ("mobilenet-v1", {"width_mult": 0.25})):
        model = get_model(name, num_classes=10, in_channels=3, image_size=16, **kw)
        layers = describe_layers(model, (3, 16, 16))
        assert any(ly.type == "add" for ly in layers) == (name == "resnet18-gn")
        assert any(ly.type == "conv2d" and (ly.groups or 1) > 1 for ly in layers) == (name == "mobilenet-v1")
        state = _random_state(model, 2)
        model.load_state_dict(state)
        x = torch.randn(3, 3, 16, 16)
        with torch.no_grad():
            assert torch.allclose(forward_from_layers(layers, state, x), model(x), atol=1e-4)


def test_the_normalisation_is_what_the_loaders_apply(tmp_path: Path) -> None:
    from PIL import Image

    from pfl_edge.data.folder import read_image_folder
    from pfl_edge.data.sources import FASHION_MNIST_DIRS, load_idx

    assert dataset_normalisation("synthetic", 1).statistics == "none"
    if (FASHION_MNIST_DIRS[0] / "train-images-idx3-ubyte.gz").exists():
        n = dataset_normalisation("fashion-mnist", 1)
        raw = load_idx(FASHION_MNIST_DIRS[0] / "t10k-images-idx3-ubyte.gz")[:50].astype(np.float32)
        mine = (raw[:, None] * n.scale - n.mean[0]) / n.std[0]
        assert np.allclose(mine, get_dataset("fashion-mnist").test_x[:50].numpy(), atol=1e-5)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(6, 8, 8, 3), dtype=np.uint8)
    for i, p in enumerate(pixels):
        (tmp_path / str(i % 2)).mkdir(exist_ok=True)
        Image.fromarray(p).save(tmp_path / str(i % 2) / f"{i}.png")
    x, _ = read_image_folder(tmp_path, 3, 8, 2)
    own = own_images_normalisation()
    scaled = torch.from_numpy(pixels.transpose(0, 3, 1, 2).astype(np.float32)) * own.scale
    order = [0, 2, 4, 1, 3, 5]  # the folder reader's order: class 0's files, then class 1's
    scaled = scaled[order]
    mean = scaled.mean(dim=(0, 2, 3), keepdim=True)
    std = scaled.std(dim=(0, 2, 3), keepdim=True).clamp_min(own.std_floor or 0.0)
    assert torch.allclose((scaled - mean) / std, x, atol=1e-5)


# ------------------------------------------------------------------------------------------- the programs


def test_programs_download_as_the_card_says(app: dict[str, Any]) -> None:
    for info in app["card"].programs:
        r = app["c"].get(info.url, headers=app["d"].h)
        assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
        assert len(r.content) == info.bytes and hashlib.sha256(r.content).hexdigest() == info.sha256
        assert r.headers["etag"] == f'"{info.sha256}"'


def test_the_onnx_program_runs_the_model_with_the_devices_weights(app: dict[str, Any]) -> None:
    import onnxruntime as ort

    info, data = _program(app, "inference")
    model = build_model(fed_model(CFG).spec)
    state = _random_state(model, 3)  # not the program's own weights: a device's, swapped in by name
    model.load_state_dict(state)
    assert info.details["weights"] == list(state)  # every tensor is an input: the program holds no weights
    assert [i["name"] for i in info.details["inputs"]] == ["input", *state]
    assert info.bytes < sum(4 * v.numel() for v in state.values()) / 10
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    weights = {k: v.numpy() for k, v in state.items()}
    x = torch.randn(7, 1, 28, 28)
    got = sess.run(["logits"], {"input": x.numpy(), **weights})[0]
    with torch.no_grad():
        assert np.allclose(got, model(x).numpy(), atol=1e-4)


@pytest.mark.parametrize("mode", ["fedper", "personal"])
def test_the_training_programs_gradients_are_autograds(app: dict[str, Any], mode: str) -> None:
    info, data = _program(app, "training", mode)
    # 11 real samples, padded to the program's 16 at weight 0
    loss, grads, ref, model, state = _against_autograd(ExecuTorchBackend(data, info.details), 4, 5, 11)
    trained = app["card"].personal_keys if mode == "personal" else list(state)
    assert sorted(grads) == sorted(trained) == sorted(info.details["trainable"])
    assert loss == pytest.approx(float(ref.detach()), abs=1e-5)
    for k, g in grads.items():
        p = dict(model.named_parameters())[k]
        assert p.grad is not None and torch.allclose(g, p.grad, atol=1e-5), k


def test_an_onnx_runtime_devices_card_lists_onnx_training_programs_exported_with_the_inference_one(
        app: dict[str, Any]) -> None:
    """?training_backend=onnxruntime: the card lists ONNX training programs (one file per mode, .onnx, other names
    than the ExecuTorch ones), served by the same URL rule, and their gradients are autograd's; they are exported
    in the ONNX batch (seconds), not behind ExecuTorch's training exports."""
    c, d = app["c"], app["d"]
    r = c.get("/v1/federations/f/model?training_backend=onnxruntime", headers=d.h)
    started = time.monotonic()
    while r.status_code == 503 and time.monotonic() - started < 300:
        time.sleep(0.5)
        r = c.get("/v1/federations/f/model?training_backend=onnxruntime", headers=d.h)
    assert r.status_code == 200, r.text
    card = ModelCard.model_validate(r.json())
    train = [p for p in card.programs if p.kind == "training"]
    assert sorted((p.runtime, p.mode) for p in train) == [("onnxruntime", "fedper"), ("onnxruntime", "personal")]
    assert all(p.file.endswith(".onnx") and p.details["runtime"] == "onnxruntime" for p in train)
    assert not {p.file for p in train} & {p.file for p in app["card"].programs}  # not the ExecuTorch ones' names
    info = next(p for p in train if p.mode == "fedper")
    got = c.get(info.url, headers=d.h)
    assert got.status_code == 200 and hashlib.sha256(got.content).hexdigest() == info.sha256
    loss, grads, ref, model, _ = _against_autograd(OnnxBackend(got.content, info.details), 6, 7, 5)
    assert loss == pytest.approx(float(ref.detach()), abs=1e-5)
    assert not gradient_mismatches(grads, {k: p.grad for k, p in model.named_parameters()})
    keys = program_keys(fed_model(CFG), kp=2, training_backend="onnxruntime")
    assert [k.runtime for k in keys] == ["onnxruntime"] * 3  # one batch with the inference program


# ------------------------------------------------------------------------------------------- access and caching


def test_refused_without_a_token_or_from_another_federation(app: dict[str, Any]) -> None:
    c, d, e = app["c"], app["d"], app["e"]
    url = app["card"].programs[0].url
    assert c.get("/v1/federations/f/model").status_code == 401
    assert c.get(url).status_code == 401
    assert c.get("/v1/federations/f/model", headers=e.h).status_code == 403  # g's device
    assert c.get(url, headers=e.h).status_code == 403
    g_train = [k.file for k in program_keys(fed_model(OTHER), kp=2, training_backend="executorch")
               if k.kind == "training"]
    foreign = c.get(f"/v1/federations/f/programs/{g_train[0]}", headers=d.h)
    unknown = c.get("/v1/federations/f/programs/cnn-train-fedper-b16-000000000000.pte", headers=d.h)
    traversal = c.get("/v1/federations/f/programs/..%2Fstate.db", headers=d.h)
    assert foreign.status_code == unknown.status_code == traversal.status_code == 404
    assert c.get("/v1/federations/f/model", params={"profile": "toaster"}, headers=bearer(ADMIN)).status_code == 422
    assert c.get("/v1/federations/f/model", headers=bearer(ADMIN)).status_code == 422  # the admin names a profile
    torch_card = c.get("/v1/federations/f/model", params={"profile": "jetson-nano"}, headers=bearer(ADMIN))
    assert [p.kind for p in ModelCard.model_validate(torch_card.json()).programs] == ["inference"]


def test_a_cache_hit_exports_nothing_even_after_a_restart(app: dict[str, Any]) -> None:
    arts: Artefacts = app["arts"]
    before = arts.exports
    r = app["c"].get("/v1/federations/f/model", headers=app["d"].h)
    assert r.status_code == 200 and arts.exports == before >= 1
    fresh = Artefacts(app["root"])  # a restarted server: the records on disk, nothing in memory
    keys = program_keys(fed_model(CFG), kp=2, training_backend="executorch")
    assert [rec.sha256 for rec in fresh.ensure(keys)] == [p.sha256 for p in app["card"].programs]
    assert fresh.exports == 0


def test_the_device_refuses_a_card_of_another_model_and_downloads_once(app: dict[str, Any], tmp_path: Path) -> None:
    http = Http("http://testserver", 5.0)
    http.client, http.token = app["c"], app["d"].e["token"]
    wrong = ProgramSource(http, "f", tmp_path, model_id="cnn/10/3x32/deep0", max_bytes=1 << 30)
    with pytest.raises(ConfigError, match="refusing"):
        wrong.training("fedper")
    src = ProgramSource(http, "f", tmp_path, model_id=app["card"].model_id, max_bytes=1 << 30)
    data, details = src.training("fedper")
    assert details["mode"] == "fedper" and (tmp_path / next(
        p.file for p in app["card"].programs if p.mode == "fedper")).read_bytes() == data
    path = next(tmp_path.glob("*.pte"))
    path.write_bytes(b"x" * len(data))  # damaged on disk: fetched again, never used
    assert src.training("fedper")[0] == data


def test_a_dispfl_card_shares_every_tensor_and_carries_the_devices_density() -> None:
    from server_testkit import DISPFL

    from pfl_edge.modelcard import build_card

    fm = fed_model(DISPFL)
    keys = program_keys(fm, kp=0, training_backend="executorch")
    assert [(k.kind, k.mode) for k in keys] == [("inference", None), ("training", "dispfl")]
    card = build_card(federation="x", cfg=fm.cfg, spec=fm.spec, model=fm.model, profile="phone-low", kp=0,
                      density=0.3, base_keys=fm.base_keys(0), programs=[])
    assert card.base_keys == list(fm.model.state_dict()) and card.personal_keys == []
    assert card.density == 0.3 and not any(b.personal for b in card.blocks)
    assert card.training.clip_unmasked is True  # DisPFL clips the whole gradient before masking it
    sched = card.training.mask_schedule
    opts = fm.algorithm().options
    assert sched is not None and (sched.alpha0, sched.rounds, sched.regrow) == (opts.alpha0, fm.cfg.rounds,
                                                                                opts.regrow)
    assert sched.regrow_just_pruned is True and "first batch_size samples" in sched.regrow_batch
    # the card's formula, as a device would code it from the text, against the simulator's own rate
    import math

    from pfl_edge.sparse import prune_rate

    assert "alpha0 / 2 * (1 + cos(pi * (t - 1) / T))" in (ModelCard.model_json_schema()["$defs"]["MaskSchedule"]
                                                           ["properties"]["anneal"]["description"])
    for t in range(1, fm.cfg.rounds + 1):
        card_alpha = sched.alpha0 / 2 * (1 + math.cos(math.pi * (t - 1) / sched.rounds))
        assert card_alpha == pytest.approx(prune_rate(opts.alpha0, t - 1, fm.cfg.rounds), abs=1e-12)
    fedper = build_card(federation="x", cfg=fed_model(FEDPER).cfg, spec=fm.spec, model=fm.model, profile="phone-low",
                        kp=0, density=1.0, base_keys=fm.base_keys(0), programs=[])
    assert fedper.training.mask_schedule is None


# ------------------------------------------------------------------------------------------- a GroupNorm model


def _card(c: TestClient, h: dict[str, str], params: dict[str, str] | None = None) -> ModelCard:
    """The card, once the programs it names are exported (waiting up to 10 minutes)."""
    started, r = time.monotonic(), c.get("/v1/federations/m/model", params=params, headers=h)
    while r.status_code == 503 and "failed" not in r.text and time.monotonic() - started < 600:
        time.sleep(1.0)
        r = c.get("/v1/federations/m/model", params=params, headers=h)
    assert r.status_code == 200, r.text
    return ModelCard.model_validate(r.json())


@pytest.fixture(scope="module")
def gn(tmp_path_factory: pytest.TempPathFactory, broker_url: str) -> Iterator[dict[str, Any]]:
    """A federation of mobilenet-v1 and its card for a jetson-orin-nano (ONNX only), as the admin asks for it:
    the ONNX export takes seconds. A phone-mid device's card (ONNX + ExecuTorch training) is the slow tests'."""
    tmp = tmp_path_factory.mktemp("gn")
    settings = Settings(data_dir=tmp / "data", database_url=f"sqlite:///{tmp / 'state.db'}", broker_url=broker_url,
                        admin_token=ADMIN)  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        create(c, ADMIN, "m", GN)
        d = Dev(c, "m")
        yield {"c": c, "d": d, "jetson": _card(c, bearer(ADMIN), {"profile": "jetson-orin-nano"})}


def test_a_groupnorm_models_onnx_program_takes_every_weight_as_an_input(gn: dict[str, Any]) -> None:
    import onnx
    import onnxruntime as ort

    jetson = gn["jetson"]
    assert jetson.model == "mobilenet-v1"
    assert [(p.kind, p.runtime) for p in jetson.programs] == [("inference", "onnxruntime")]
    r = gn["c"].get(jetson.programs[0].url, headers=gn["d"].h)  # a device reads the program its federation uses
    assert r.status_code == 200, r.text
    info, data = jetson.programs[0], r.content
    model = build_model(fed_model(GN).spec)
    state = _random_state(model, 6)  # a device's weights: every GroupNorm weight differs from the fresh all-ones
    model.load_state_dict(state)
    proto = onnx.load_from_string(data)
    assert [i.name for i in proto.graph.input] == ["input", *state] == [i["name"] for i in info.details["inputs"]]
    assert not {i.name for i in proto.graph.initializer} & set(state)  # nothing baked in, GroupNorm's included
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for n in (4, 1):
        x = torch.randn(n, 1, 28, 28, generator=torch.Generator().manual_seed(n))
        got = sess.run(["logits"], {"input": x.numpy(), **{k: v.numpy() for k, v in state.items()}})[0]
        with torch.no_grad():
            ref = model(x).numpy()
        assert np.abs(got - ref).max() <= 1e-5 + 1e-4 * np.abs(ref).max()


@pytest.mark.slow  # mobilenet-v1's training export: ~4-5 minutes on this 2-core machine
def test_a_groupnorm_models_training_gradients_are_autograds_within_the_bound(gn: dict[str, Any]) -> None:
    card = _card(gn["c"], gn["d"].h)  # the phone-mid device's own card: ONNX and its training program
    assert sorted((p.kind, p.mode) for p in card.programs) == [("inference", None), ("training", "fedper")]
    assert next(p for p in card.programs if p.kind == "inference").sha256 == gn["jetson"].programs[0].sha256
    info = next(p for p in card.programs if p.kind == "training")
    r = gn["c"].get(info.url, headers=gn["d"].h)
    assert r.status_code == 200, r.text
    data = r.content
    backend = ExecuTorchBackend(data, info.details)
    model = build_model(fed_model(GN).spec)
    state = _random_state(model, 7)
    backend.load(state)
    model.load_state_dict(state)
    gen = torch.Generator().manual_seed(8)
    x, y = torch.randn(11, 1, 28, 28, generator=gen), torch.randint(0, 10, (11,), generator=gen)
    loss, grads = backend.gradients(x, y)  # 11 real samples, padded to the program's 16 at weight 0

    def eager(m: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
        m.zero_grad()
        ref = F.cross_entropy(m(xs), ys)
        ref.backward()
        return float(ref.detach()), {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}

    ref_loss, ref = eager(model, x, y)
    assert sorted(grads) == sorted(ref) == sorted(info.details["trainable"])
    assert loss == pytest.approx(ref_loss, abs=1e-5)
    assert gradient_mismatches(grads, dict(ref)) == []
    # what the bound refuses: a program that counts a padded sample (12 samples, the 12th all zeros), one run at
    # other weights (one mid-network tensor moved by a tenth of its spread), and one wrong element in one tensor
    pad = eager(model, torch.cat([x, torch.zeros(1, 1, 28, 28)]), torch.cat([y, torch.zeros(1, dtype=y.dtype)]))[1]
    assert len(gradient_mismatches(grads, dict(pad))) > len(pad) // 2
    other = build_model(fed_model(GN).spec)
    noise = torch.randn(state["dw7.3.weight"].shape, generator=gen) * 0.1 * float(state["dw7.3.weight"].std())
    other.load_state_dict({**state, "dw7.3.weight": state["dw7.3.weight"] + noise})
    assert gradient_mismatches(grads, dict(eager(other, x, y)[1]))
    wrong = {k: g.clone() for k, g in grads.items()}
    wrong["head.1.weight"].view(-1)[3] += 0.1 * float(ref["head.1.weight"].abs().max())
    assert [b.split(":")[0] for b in gradient_mismatches(wrong, dict(ref))] == ["head.1.weight"]


# ------------------------------------------------------------------------------------------- export order


class _Recording(Artefacts):
    """Exports nothing: records each child's batch and installs a record for it, so readiness is observable."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.batches: list[list[str]] = []
        self.release = threading.Event()

    def _export(self, batch: list[Any]) -> dict[str, str]:
        self.release.wait(30)  # the test queues everything before the worker takes its first batch
        self.batches.append([k.file for k in batch])
        for k in batch:
            (self.root / k.file).write_bytes(b"x")
            (self.root / (k.file + ".json")).write_text('{"sha256": "0", "bytes": 1, "details": {}}')
        return {}


def test_onnx_is_exported_first_and_each_training_program_on_its_own(tmp_path: Path) -> None:
    from server.routers.models import creation_keys

    fm = fed_model(CFG)  # fedper-ft: fedper and personal training programs
    keys = creation_keys(fm, profile_capacity=False, scope="all")
    assert keys[0].kind == "inference" and {k.mode for k in keys[1:]} == {"fedper", "personal"}
    assert creation_keys(fm, profile_capacity=False, scope="inference") == keys[:1]
    assert creation_keys(fm, profile_capacity=False, scope="none") == []
    arts = _Recording(tmp_path)
    # queued training first, as a card for an ExecuTorch device would, then the ONNX program
    assert arts.prefetch(keys[1:] + keys[:1]) == len(keys)
    assert arts.prefetch(keys) == 0  # queued already: nothing twice
    arts.release.set()
    onnx = arts.wait(keys[:1], 30)  # a torch device's card: the ONNX program alone
    assert onnx[0].file == keys[0].file
    arts.wait(keys, 30)
    assert arts.batches[0] == [keys[0].file]  # ONNX first, alone, though it was queued last
    assert sorted(arts.batches[1:]) == sorted([k.file] for k in keys[1:])  # then one training program a child
    assert arts.prefetch(keys) == 0  # exported: nothing scheduled again


def test_a_new_federation_schedules_its_programs(tmp_path: Path, broker_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    scheduled: list[list[str]] = []
    monkeypatch.setattr(Artefacts, "prefetch", lambda self, keys: scheduled.append([k.file for k in keys]) or 0)
    settings = Settings(data_dir=tmp_path / "data", database_url=f"sqlite:///{tmp_path / 'state.db'}",
                        broker_url=broker_url, admin_token=ADMIN, export_on_create="all")  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as c:
        create(c, ADMIN, "p", CFG)
    fm = fed_model(CFG)
    assert scheduled == [[k.file for k in creation_keys_of(fm)]]


def creation_keys_of(fm: Any) -> list[Any]:
    from server.routers.models import creation_keys

    return creation_keys(fm, profile_capacity=False, scope="all")


def test_each_device_is_served_the_card_in_its_protocol_version(app: dict[str, Any]) -> None:
    """A device of an earlier release (version 1) is sent no card field it does not know; this release's device
    (version 2) every field (pfl_edge.modelcard.card_wire; tests/server/test_card_versions.py checks both against
    the two releases' schemas)."""
    c = app["c"]
    old = Dev(c, "f", keyed=False)  # the second of f's three slots: round 1 does not open
    got_old = c.get("/v1/federations/f/model", headers=old.h)
    got_new = c.get("/v1/federations/f/model", headers=app["d"].h)
    assert got_old.status_code == 200 and got_new.status_code == 200, (got_old.text, got_new.text)
    old_training, new_training = got_old.json()["training"], got_new.json()["training"]
    assert not {"fedrep", "ditto", "mask_schedule"} & set(old_training)  # FedPer-FT's: all three null
    assert {k: new_training[k] for k in ("fedrep", "ditto", "mask_schedule")} == dict.fromkeys(
        ("fedrep", "ditto", "mask_schedule"))
    assert {k: v for k, v in new_training.items() if k not in ("fedrep", "ditto", "mask_schedule")} == old_training
    assert got_new.json()["density"] == 1.0  # FedPer-FT keeps no mask (its enrolment says 1 too)
