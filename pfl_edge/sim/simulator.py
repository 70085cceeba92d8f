"""The in-process simulator: every client in one process, rounds run to completion, results as JSON."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, cast

import torch
from tqdm import tqdm

from ..algorithms import get_algorithm, sample_participants
from ..checkpoint import ModelSpec, build_model, save_checkpoint
from ..errors import ConfigError
from ..federation import FederationConfig, deal, init_state
from ..flops import forward_flops
from ..parallel import Trainer
from ..privacy import epsilon, noise_multiplier
from ..privacy_spent import achieved_epsilon, realised_multiplier
from ..seeding import seed_everything
from ..train import ClientTensors, unstack
from .algorithms import Context, RoundStats, Runner
from .ray_backend import RayTrainer, TrainerLike, import_ray

__all__ = ["BACKENDS", "build_context", "sample_participants", "simulate"]

# where the clients train: forked worker processes on this machine (pfl_edge.parallel), or Ray actors
# (sim.ray_backend). Not part of the FederationConfig: the results do not depend on it.
BACKENDS = ("fork", "ray")


def _check_backend(backend: str, ray_address: str | None) -> None:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; valid backends: {', '.join(BACKENDS)}")
    if ray_address is not None and backend != "ray":
        raise ConfigError("a Ray address needs the ray backend (--backend ray)")
    if backend == "ray":
        import_ray()  # before the data is dealt: a missing Ray says what to install at once


def build_context(cfg: FederationConfig, *, backend: str = "fork",
                  ray_address: str | None = None) -> tuple[Context, ModelSpec]:
    """What a run shares (``Context``), its clients trained by ``backend`` (``BACKENDS``); ``ray_address``: the
    Ray cluster to join (``sim.ray_backend.RayTrainer``). Close ``ctx.trainer`` when done."""
    _check_backend(backend, ray_address)
    seed_everything(cfg.seed)
    ds, part, spec = deal(cfg)
    init = init_state(cfg, spec)
    model = build_model(spec)
    split = get_algorithm(cfg, model).split  # the algorithm's K_P rule (Algorithm.split_kp)
    train_data = ClientTensors.build(ds.train_x, [c.train_idx for c in part.clients],
                                     [c.train_y for c in part.clients])
    test_data = ClientTensors.build(ds.test_x, [c.test_idx for c in part.clients],
                                    [c.test_y for c in part.clients])
    flops = forward_flops(model, (ds.in_channels, ds.image_size, ds.image_size))
    trainer: TrainerLike  # last: forks, or starts actors
    if backend == "ray":
        trainer = RayTrainer(model, train_data, test_data, workers=cfg.workers, engine=cfg.engine,
                             address=ray_address)
    else:
        trainer = Trainer(model, train_data, test_data, workers=cfg.workers, engine=cfg.engine)
    # Context.trainer is annotated as parallel.Trainer; any TrainerLike serves (the runners call its methods)
    return Context(cfg, model, split, train_data, test_data, init, cast(Trainer, trainer), flops,
                   part.num_classes), spec


def _pstd(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def simulate(cfg: FederationConfig, *, save_dir: str | Path | None = None, progress: bool | None = None,
             backend: str = "fork", ray_address: str | None = None,
             sampling_key: bytes | None = None) -> dict[str, Any]:
    """Run ``cfg`` and return the result: ``config``, ``rounds`` (one dict per round), ``final``, ``meta``.

    ``progress``: a bar on stderr; ``None`` shows it only on a terminal. ``backend``: where the clients train,
    ``fork`` (worker processes on this machine) or ``ray`` (actors on the Ray cluster at ``ray_address``; see
    ``sim.ray_backend.RayTrainer``); the same config gives the same numbers on either (bit for bit where the
    arithmetic is the same: docs/simulation.md). ``sampling_key``: a server's secret sampling key of a federation
    with a privacy table (``pfl_edge.privacy.secret_draw``): the rounds draw the server's slots; without one, the
    seed's draw. Never part of the config (a device receives the config), nor of the result.
    """
    if sampling_key is not None and cfg.privacy is None:
        raise ConfigError("a sampling key draws a private federation's rounds: this config has no privacy table")
    t0 = time.perf_counter()
    ctx, spec = build_context(cfg, backend=backend, ray_address=ray_address)
    try:
        return _run(cfg, ctx, spec, t0, save_dir, progress, backend, sampling_key)
    finally:
        ctx.trainer.close()


def _run(cfg: FederationConfig, ctx: Context, spec: ModelSpec, t0: float, save_dir: str | Path | None,
         progress: bool | None, backend: str, key: bytes | None) -> dict[str, Any]:
    algo = Runner(ctx)
    setup_s = time.perf_counter() - t0
    rounds: list[dict[str, Any]] = []
    bar = tqdm(range(1, cfg.rounds + 1), desc=cfg.algorithm, unit="round", disable=None if progress is None
               else not progress, leave=False)
    dp = cfg.dp
    z = noise_multiplier(cfg) if dp is not None else None  # a target epsilon no noise reaches fails now
    counts: list[int | None] = []  # each round's participants: every one's update is in the round's sum
    for t in bar:
        start = time.perf_counter()
        participants = algo.algo.participants(t, key)
        st = algo.run_round(t, participants)
        wall = time.perf_counter() - start
        rounds.append(_record(t, st, wall))
        if dp is not None:  # the privacy spent after this round, at the config's delta, as the round ran
            counts.append(len(participants))
            rounds[-1]["epsilon"] = achieved_epsilon(cfg, counts)
            if dp.mode == "distributed":  # the noise its participants' shares made (privacy_spent)
                rounds[-1]["noise_multiplier"] = realised_multiplier(cfg, len(participants))
        bar.set_postfix(acc=f"{rounds[-1]['mean_acc']:.3f}")
    bar.close()
    last = rounds[-1]
    result: dict[str, Any] = {
        # the resolved worker count, so that --config re-runs on the same number of processes
        "config": {**cfg.to_dict(), "workers": ctx.trainer.workers},
        "rounds": rounds,
        "final": {k: last[k] for k in ("mean_acc", "std_acc", "client_acc")},
        "meta": {
            "pfl_edge_version": _version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "backend": backend,
            "workers": ctx.trainer.workers,
            **_nodes(ctx.trainer),
            "num_classes": spec.num_classes,
            "blocks": ctx.model.block_names,
            "base_keys": list(ctx.split.base),
            "personal_keys": list(ctx.split.personal),
            "client_train_samples": ctx.train_data.n.tolist(),
            "client_test_samples": ctx.test_data.n.tolist(),
            "setup_s": setup_s,
            "total_s": time.perf_counter() - t0,
        },
    }
    if dp is not None:
        result["privacy"] = {"noise_multiplier": z, "delta": dp.delta, "epsilon": last["epsilon"],
                             "clip": dp.clip, "mode": dp.mode, "sample_rate": cfg.participation,
                             "accountant": "opacus RDP (sampled Gaussian)",
                             "draw": "the server's sampling key" if key is not None else "the seed"}
        if dp.mode == "distributed":  # the figure had every round drawn q N: what the config was calibrated for
            result["privacy"]["nominal_epsilon"] = epsilon(cfg, cfg.rounds)
            result["privacy"]["accountant"] += ", each round at the noise its participants added"
    analysis = algo.analysis()
    if analysis:
        result["mask_analysis"] = analysis
    if save_dir is not None:
        _save(Path(save_dir), cfg, spec, algo.deployed(), algo.shared())
    return result


def _nodes(trainer: object) -> dict[str, int]:
    """For the ray backend, how many nodes its actors ran on."""
    if isinstance(trainer, RayTrainer):
        return {"ray_nodes": len(set(trainer.node_ids()))}
    return {}


def _record(t: int, st: RoundStats, wall: float) -> dict[str, Any]:
    """One round of the result JSON."""
    accs = st.client_acc
    return {
        "round": t,
        "mean_acc": sum(accs) / len(accs),
        "std_acc": _pstd(accs),
        "client_acc": accs,
        "client_loss": st.client_loss,
        # null where the round trained nobody (differential privacy's Poisson draw may draw nobody)
        "train_loss": st.train_loss if math.isfinite(st.train_loss) else None,
        "bytes_up": sum(st.client_bytes_up),
        "bytes_down": sum(st.client_bytes_down),
        "client_bytes_up": st.client_bytes_up,
        "client_bytes_down": st.client_bytes_down,
        "busiest_node_bytes": st.busiest_node_bytes,
        "busiest_node_received": st.busiest_node_received,
        "participants": st.participants,
        # per participating client (a centralised round trains a sample of the clients)
        "flops": sum(st.client_flops[i] for i in st.participants) / max(1, len(st.participants)),
        "client_flops": st.client_flops,
        "client_density": st.client_density,
        **st.extra,
        "wall_s": wall,
    }


def _save(d: Path, cfg: FederationConfig, spec: ModelSpec, deployed: dict[str, torch.Tensor],
          shared: dict[str, torch.Tensor] | None) -> None:
    d.mkdir(parents=True, exist_ok=True)
    extra = {"algorithm": cfg.algorithm, "round": cfg.rounds, "config": cfg.to_dict()}
    n = next(iter(deployed.values())).shape[0]
    for i in range(n):
        save_checkpoint(d / f"client_{i:03d}.safetensors", unstack(deployed, i), spec,
                        {**extra, "kind": "client", "client": i})
    if shared is not None:
        save_checkpoint(d / "base.safetensors", shared, spec, {**extra, "kind": "base"})


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pfl-edge")
    except PackageNotFoundError:
        return "unknown"
