"""The program backends (OnnxBackend, ExecuTorchBackend) against TorchBackend (the simulator's code path): same
data, same generator, same weights. Every test of a program runs on both runtimes' programs (``RUNTIMES``)."""

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor

from device_profiles import get_profile
from edge_runtime import ExecuTorchBackend, TorchBackend, get_training_backend
from edge_runtime.training import OnnxBackend, ProgramBackend
from export import Lowered, Prepared, lower_executorch_training, lower_onnx_training, prepare
from pfl_edge.checkpoint import ModelSpec, build_model
from pfl_edge.errors import ConfigError
from pfl_edge.sparse import erk_densities, init_masks
from pfl_edge.split import split_keys
from pfl_edge.train import ClientTensors, TrainConfig, stack_states, train, unstack

SPEC = ModelSpec("cnn", 10, 1, 28)
B = 8
N = 21  # 3 batches per epoch, the last one partial (5 samples)
ATOL = 1e-5
ROUND_ATOL = 1e-4  # a float32 round against a float64 one: rounding plus a ReLU crossing (the fedper test)


@pytest.fixture(scope="module")
def prep() -> Prepared:
    return prepare(get_profile("phone-low"), spec=SPEC, seed=2)


RUNTIMES = {"executorch": (lower_executorch_training, ExecuTorchBackend), "onnxruntime": (lower_onnx_training,
                                                                                           OnnxBackend)}


@pytest.fixture(scope="module", params=list(RUNTIMES))
def runtime(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def fedper(prep: Prepared, runtime: str) -> Lowered:
    return RUNTIMES[runtime][0](prep, mode="fedper", batch_size=B)


@pytest.fixture(scope="module")
def personal(prep: Prepared, runtime: str) -> Lowered:
    return RUNTIMES[runtime][0](prep, mode="personal", batch_size=B, kp=2)


def _backend(low: Lowered) -> ProgramBackend:
    return (OnnxBackend if low.format == "onnx" else ExecuTorchBackend).from_lowered(low)


@pytest.fixture(scope="module")
def data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    # learnable labels (a function of the input), so that training moves the weights far from the start
    x = torch.randn(N, 1, 28, 28, generator=gen)
    return x, (x.mean(dim=(1, 2, 3)) * 40).long().clamp(0, 9)


def _pair(prep: Prepared, low: Lowered) -> tuple[TorchBackend, ProgramBackend]:
    tb, eb = TorchBackend(build_model(SPEC)), _backend(low)
    tb.load(prep.model.state_dict())
    eb.load(prep.model.state_dict())
    return tb, eb


def _max_diff(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    assert list(a) == list(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CFG = TrainConfig(epochs=2, batch_size=B, lr=0.05, momentum=0.9, weight_decay=1e-3)


def test_torch_backend_is_exactly_the_simulators_training(prep: Prepared, data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    tb = TorchBackend(build_model(SPEC))
    tb.load(prep.model.state_dict())
    stats = tb.train(x, y, CFG, torch.Generator().manual_seed(3))
    # the simulator: several clients in one stack; this device is client 1 with the same generator seed
    other = torch.randn_like(x)
    ct = ClientTensors.build(torch.cat([other, x]), [torch.arange(N), torch.arange(N, 2 * N)],
                             [y.flip(0), y])
    start = {k: v.detach() for k, v in prep.model.state_dict().items()}
    res = train(build_model(SPEC), stack_states([start, start]), ct, torch.tensor([0, 1]), CFG,
                [torch.Generator().manual_seed(9), torch.Generator().manual_seed(3)], engine="loop")
    assert all(torch.equal(v, unstack(res.stack, 1)[k]) for k, v in tb.state().items())
    assert stats.steps == 6 == int(res.steps[1]) and stats.samples == 2 * N


def test_fedper_whole_model_matches_torch(prep: Prepared, fedper: Lowered, data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    tb, eb = _pair(prep, fedper)
    s_t = tb.train(x, y, CFG, torch.Generator().manual_seed(5))
    s_e = eb.train(x, y, CFG, torch.Generator().manual_seed(5))
    assert s_e.steps == s_t.steps == 6 and s_e.samples == s_t.samples
    assert abs(s_e.loss - s_t.loss) < 1e-5
    assert _max_diff(tb.state(), eb.state()) < ATOL
    moved = _max_diff(eb.state(), prep.model.state_dict())
    assert moved > 100 * ATOL  # the comparison is not between two untouched models
    # a second round on the same loaded program, from where its first left it. Held to a float64 run of the
    # same steps: a float32 run drifts from it by rounding, and now and then by a jump where a pre-activation near
    # 0 lands on the other side of a ReLU in float32 (measured on an AVX-only EPYC: 3.3e-5 for whichever float32
    # run crosses, eager or the program, depending on the start's last bits; 2e-8 for the one that does not; on
    # an earlier machine of this kind both 2e-5 to 7e-5), so neither float32 run can judge the other below that.
    # Round 1 above, at 1e-5 against eager, catches a wrong step (weight decay ignored: 2.2e-4 over its 6 steps).
    cfg = TrainConfig(epochs=1, batch_size=B, lr=0.05, momentum=0.9, weight_decay=1e-3)
    t64 = TorchBackend(build_model(SPEC).double())
    t64.load({k: v.double() for k, v in eb.state().items()})
    tb.load(eb.state())
    for b, xb in ((t64, x.double()), (tb, x), (eb, x)):
        b.train(xb, y, cfg, torch.Generator().manual_seed(6))

    def off(b: TorchBackend | ProgramBackend) -> float:
        return _max_diff({k: v.double() for k, v in b.state().items()}, t64.state())

    assert off(eb) < max(ROUND_ATOL, 3 * off(tb)), (off(eb), off(tb))
    assert off(eb) < 1e-3  # and the bound itself is no excuse for a program that trains something else


def test_clipping_matches_clip_grad_norm(prep: Prepared, fedper: Lowered, data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    cfg = TrainConfig(epochs=1, batch_size=B, lr=0.1, momentum=0.5, clip_norm=0.05)  # small: every step clips
    tb, eb = _pair(prep, fedper)
    tb.train(x, y, cfg, torch.Generator().manual_seed(1))
    eb.train(x, y, cfg, torch.Generator().manual_seed(1))
    assert _max_diff(tb.state(), eb.state()) < ATOL
    unclipped = TorchBackend(build_model(SPEC))
    unclipped.load(prep.model.state_dict())
    unclipped.train(x, y, TrainConfig(epochs=1, batch_size=B, lr=0.1, momentum=0.5), torch.Generator().manual_seed(1))
    assert _max_diff(unclipped.state(), eb.state()) > 100 * ATOL  # clipping changed the result


@pytest.mark.parametrize("clip_unmasked", [False, True])
def test_masked_dispfl_training_matches_torch_and_keeps_zeros(prep: Prepared, data: tuple[Tensor, Tensor],
                                                              clip_unmasked: bool, runtime: str) -> None:
    x, y = data
    shapes = {k: p.shape for k, p in prep.model.named_parameters() if p.dim() > 1}
    masks = init_masks(shapes, erk_densities(shapes, 0.5), torch.Generator().manual_seed(4))
    low = (lower_executorch_training(prep, mode="dispfl", batch_size=B, mask=masks) if runtime == "executorch"
           else lower_onnx_training(prep, mode="dispfl", batch_size=B))
    tb, eb = _pair(prep, low)  # dense start: training itself must apply the mask first
    # a small clip norm, so that clipping the whole or the masked gradient makes a difference
    cfg = TrainConfig(epochs=2, batch_size=B, lr=0.05, momentum=0.9, weight_decay=1e-3, clip_norm=0.5,
                      clip_unmasked=clip_unmasked)
    tb.train(x, y, cfg, torch.Generator().manual_seed(8), mask=masks)
    eb.train(x, y, cfg, torch.Generator().manual_seed(8), mask=masks)
    state = eb.state()
    assert _max_diff(tb.state(), state) < ATOL
    for k, m in masks.items():
        assert torch.equal(state[k][m == 0], torch.zeros(int((m == 0).sum())))  # exactly zero, not small
        assert (state[k][m == 1] != 0).float().mean() > 0.99
    # the regrowth screen on the trained sparse weights: the dense gradient, nonzero off the mask too
    g_t = tb.dense_gradients(x, y, B, torch.Generator().manual_seed(2))
    g_e = eb.dense_gradients(x, y, B, torch.Generator().manual_seed(2))
    assert _max_diff(g_t, g_e) < ATOL
    assert (g_e["fc1.1.weight"][masks["fc1.1.weight"] == 0] != 0).float().mean() > 0.3


def test_dense_gradients_match_torch(prep: Prepared, fedper: Lowered, data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    tb, eb = _pair(prep, fedper)
    for bs in (5, B, 20):  # a short batch, the program's batch, and one larger than it (summed in chunks)
        g_t = tb.dense_gradients(x, y, bs, torch.Generator().manual_seed(bs))
        g_e = eb.dense_gradients(x, y, bs, torch.Generator().manual_seed(bs))
        assert list(g_e) == [k for k, _ in prep.model.named_parameters()]
        assert _max_diff(g_t, g_e) < 1e-6, bs
    assert eb.state().keys() == prep.model.state_dict().keys()


def test_personal_only_training_matches_torch(prep: Prepared, personal: Lowered, fedper: Lowered,
                                              data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    assert isinstance(prep.model, torch.nn.Sequential)
    keys = list(split_keys(prep.model, 2).personal)  # type: ignore[arg-type]
    for low in (personal, fedper):  # the personal program, and the whole-model one asked to train a subset
        tb, eb = _pair(prep, low)
        tb.train(x, y, CFG, torch.Generator().manual_seed(3), trainable=keys)
        eb.train(x, y, CFG, torch.Generator().manual_seed(3), trainable=None if low is personal else keys)
        got = eb.state()
        assert _max_diff(tb.state(), got) < ATOL
        for k, v in prep.model.state_dict().items():
            assert torch.equal(got[k], v) != (k in keys), k  # the base exactly as loaded, the head trained


def test_personal_program_refuses_what_it_cannot_do(prep: Prepared, personal: Lowered,
                                                    data: tuple[Tensor, Tensor]) -> None:
    x, y = data
    eb = _backend(personal)
    with pytest.raises(ConfigError, match="load a state"):
        eb.state()
    eb.load(prep.model.state_dict())
    with pytest.raises(ConfigError, match="cannot train"):
        eb.train(x, y, CFG, torch.Generator(), trainable=["conv1.0.weight"])
    with pytest.raises(ConfigError, match="dense gradients need every parameter"):
        eb.dense_gradients(x, y, B, torch.Generator())
    with pytest.raises(ConfigError, match="batch size 16 > the program's 8"):
        eb.train(x, y, TrainConfig(batch_size=16), torch.Generator())
    with pytest.raises(ConfigError, match="state lacks"):
        eb.load({"head.weight": torch.zeros(10, 64)})


def test_backend_registry() -> None:
    assert get_training_backend("torch") is TorchBackend
    assert get_training_backend("executorch") is ExecuTorchBackend
    assert get_training_backend("onnxruntime") is OnnxBackend
    with pytest.raises(ConfigError, match="valid: executorch, onnxruntime, torch"):
        get_training_backend("tflite")


def test_profiler_measures_a_step_of_the_training_program(tmp_path: Path, fedper: Lowered) -> None:
    # the profiler's measuring process, as profile_devices runs it for an executorch profile (the whole command
    # is exercised by test_runtime.py's profile test on phone-low)
    from dataclasses import asdict

    from edge_runtime import measure
    from export import package

    if fedper.format != "executorch":
        pytest.skip("the profiler measures ExecuTorch programs (executorch profiles)")
    program = package(fedper, tmp_path).path
    args = {"threads": 1, "input_shape": (1, 28, 28), "repeats": 2, "batch": B, "spec": asdict(SPEC),
            "training_backend": "executorch", "program": str(program)}
    m = measure("train", "train step", args)
    assert m.backend == "executorch" and m.batch == B and 0 < m.median_ms <= m.p95_ms
    assert program.name == "cnn-phone-low-fresh-train-fedper.pte"
    assert json.loads((tmp_path / "manifest.json").read_text())[0]["kind"] == "training"


def test_the_proximal_term_matches_torch(prep: Prepared, fedper: Lowered, data: tuple[Tensor, Tensor]) -> None:
    """Ditto's personal training on the program (ProgramSGD adds lam (w - anchor) to the program's gradients)
    against the simulator's loop, and against the same training without the pull."""
    x, y = data
    torch.manual_seed(3)
    anchor = {k: v + 0.3 * torch.randn_like(v) for k, v in prep.model.state_dict().items()}
    cfg = TrainConfig(epochs=1, batch_size=B, lr=0.05, momentum=0.9, prox=0.8)
    tb, eb = _pair(prep, fedper)
    tb.train(x, y, cfg, torch.Generator().manual_seed(4), anchor=anchor)
    eb.train(x, y, cfg, torch.Generator().manual_seed(4), anchor=anchor)
    assert _max_diff(tb.state(), eb.state()) < ATOL
    _, free = _pair(prep, fedper)
    free.train(x, y, cfg, torch.Generator().manual_seed(4))
    assert _max_diff(free.state(), eb.state()) > 100 * ATOL


def test_numpy_arrays_and_mt_streams_train_as_torch_tensors_and_generators(prep: Prepared, fedper: Lowered,
                                                                          data: tuple[Tensor, Tensor]) -> None:
    """A device without torch feeds the same program numpy arrays and draws its batches from seeding.MT: the same
    batches, the same weights (to the last bit: the same program, the same numpy SGD), numpy in and out."""
    from pfl_edge.seeding import MT

    x, y = data
    cfg = TrainConfig(epochs=2, batch_size=B, lr=0.05, momentum=0.9, weight_decay=1e-3, clip_norm=1.0)
    state = prep.model.state_dict()
    last = [k for k, p in prep.model.named_parameters() if p.dim() > 1][-1]
    mask = {last: (torch.rand(state[last].shape, generator=torch.Generator().manual_seed(3)) < 0.5).float()}
    on_torch = _backend(fedper)
    on_torch.load(state)
    st_t = on_torch.train(x, y, cfg, torch.Generator().manual_seed(11), mask=mask)
    on_numpy = _backend(fedper)
    on_numpy.load({k: v.numpy() for k, v in state.items()})
    st_n = on_numpy.train(x.numpy(), y.numpy(), cfg, MT(11), mask={k: m.numpy() for k, m in mask.items()})
    assert (st_t.steps, st_t.samples) == (st_n.steps, st_n.samples) and st_t.loss == st_n.loss
    got_t, got_n = on_torch.state(), on_numpy.state()
    assert all(isinstance(v, Tensor) for v in got_t.values())
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in got_n.values())
    for k in got_t:
        assert np.array_equal(got_t[k].numpy(), got_n[k]), k
    assert _max_diff(got_t, state) > 1e-3  # it trained
    g_t = on_torch.dense_gradients(x, y, 20, torch.Generator().manual_seed(5))
    g_n = on_numpy.dense_gradients(x.numpy(), y.numpy(), 20, MT(5))
    assert all(np.array_equal(g_t[k].numpy(), g_n[k]) for k in g_t)
