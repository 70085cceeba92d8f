"""A federation's definition, in one place for the simulator, the server and every device: the config (one frozen
dataclass, validated on creation, saved into every result), how its data set is dealt to clients, the model it
trains (spec and id), the K_P and capacity rules, and the named random streams of a round."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from .algorithms.algorithm import algorithm_class, device_algorithms, list_algorithms
from .checkpoint import ModelSpec, build_model
from .compat import tomllib
from .config_bounds import Range, check_ranges, meta
from .config_migration import migrate
from .data import (
    ClientArrays,
    Dataset,
    Labels,
    Partition,
    client_arrays,
    get_dataset,
    get_labels,
    get_shape,
    list_partitioners,
    partition,
)
from .errors import ConfigError
from .privacy import PrivacyConfig, SecAggConfig, check_device_privacy
from .protocol import MAX_CLIENTS, MAX_ROUND
from .seeding import Stream, derive_seed, numpy_rng, stream
from .sgd import TrainConfig
from .typecheck import coerce, describe

if TYPE_CHECKING:  # torch is imported where a model is built (init_state): the config, the deal as numpy
    # (deal_arrays), the model spec and id import without it
    from torch import Tensor

__all__ = [
    "ALGORITHMS",
    "OWN_DATA",
    "OWN_DATA_SAMPLES",
    "FederationConfig",
    "SimConfig",
    "Stream",
    "check_device_algorithm",
    "check_device_config",
    "deal",
    "deal_arrays",
    "deal_labels",
    "device_capacity",
    "init_state",
    "input_spec",
    "load_config_file",
    "model_id",
    "model_spec",
    "stream",
]

ALGORITHMS = tuple(list_algorithms())  # every registered algorithm (pfl_edge.algorithms)
OWN_DATA = "device"
OWN_DATA_SAMPLES = 60_000  # the most samples one update of an own-data federation counts, unless samples_per_client
_MAX_TEXT = 4_096  # characters of a name, spec or path


@dataclass(frozen=True)
class FederationConfig:
    """Everything a run depends on, simulated or on devices; the same config gives the same numbers. Each key's
    meaning and the numbers it may hold are its field's metadata (``pfl_edge.config_bounds.meta``), which the
    checks below and docs/config.md read."""

    algorithm: str = field(default="fedper", metadata=meta("the algorithm (pfl_edge.algorithms)"))
    model: str = field(default="cnn", metadata=meta("the model (pfl_edge.models)"))
    dataset: str = field(default="fashion-mnist", metadata=meta(
        f'the data set dealt to the clients; with partition = "{OWN_DATA}", only the model\'s input (channels, size, '
        "classes)"))
    data_dir: str | None = field(default=None, metadata=meta("the data set's folder (null: where it is looked for "
                                                             "by default)"))
    partition: str = field(default="pathological:4", metadata=meta(
        f'how the data set is dealt to the clients, a partitioner\'s NAME or NAME:ARG; or "{OWN_DATA}": each device '
        "brings its own data (pfl-edge client --data-dir) and nothing is dealt"))
    clients: int = field(default=10, metadata=meta(
        "how many clients (slots) the federation has; a device enrols in one slot: its data, seeds, topology place",
        Range(1, MAX_CLIENTS)))
    rounds: int = field(default=30, metadata=meta("the training rounds", Range(1, MAX_ROUND)))
    local_epochs: int = field(default=2, metadata=meta("epochs of local SGD per round", Range(1, 1_000)))
    batch_size: int = field(default=32, metadata=meta("local SGD's batch size", Range(1, 65_536)))
    lr: float = field(default=0.01, metadata=meta("local SGD's learning rate in round 1", Range(0, 1e6, lo_open=True)))
    lr_decay: float = field(default=1.0, metadata=meta("the lr of round t is lr * lr_decay ** (t - 1)",
                                                       Range(0, 1, lo_open=True)))
    momentum: float = field(default=0.9, metadata=meta("local SGD's momentum (torch.optim.SGD's)",
                                                       Range(0, 1, hi_open=True)))
    weight_decay: float = field(default=0.0, metadata=meta("local SGD's weight decay (torch.optim.SGD's)",
                                                           Range(0, 1e6)))
    clip_norm: float | None = field(default=None, metadata=meta(
        "each step's gradient clipped to this L2 norm, per client over its trained tensors (null: no clipping)",
        Range(0, 1e12, lo_open=True)))
    clip_unmasked: bool | None = field(default=None, metadata=meta(
        "clip the whole (unmasked) gradient before masking it, as the DisPFL reference does (null: true for "
        "dispfl, false otherwise; no difference without masks)"))
    kp: int = field(default=2, metadata=meta(
        "K_P: the personal blocks, counted from the output end, that never leave a client (FedPer, FedPer-FT, "
        "FedRep)", Range(0, 1_000)))
    base: Literal["deep", "linear"] = field(default="deep", metadata=meta(
        "the shared base: the model's own blocks, or linear (FedPer's control: one linear layer; kp >= 1)"))
    participation: float = field(default=1.0, metadata=meta(
        "the fraction of the clients a round samples (under privacy: each client's chance of taking part)",
        Range(0, 1, lo_open=True)))
    samples_per_client: int | None = field(default=None, metadata=meta(
        "the most training samples a client is dealt (a random subset of its share; null: all); where devices "
        f"bring their own data, the most one update counts (null: {OWN_DATA_SAMPLES:,})", Range(1, 10_000_000)))
    test_per_client: int | None = field(default=None, metadata=meta(
        "each client's test samples (null: the test split's size / clients, rounded up, as DisPFL's)",
        Range(1, 10_000_000)))
    test_draw: Literal["disjoint", "shared"] | None = field(default=None, metadata=meta(
        "each client's test set: disjoint (no test sample in two clients) or shared (each drawn on its own from the "
        "whole split, the DisPFL reference's); null: shared for pathological-random and dirichlet-client, else "
        "disjoint"))
    ft_epochs: int = field(default=1, metadata=meta(
        "epochs of fine-tuning: FedPer-FT's personal blocks alone on each base (and a late joiner's in its first "
        "round), the -FT baselines' deployed model", Range(0, 1_000)))
    local_norm_stats: bool = field(default=False, metadata=meta(
        "the base blocks' normalisation statistics stay on the client (FedBN-style)"))
    density: float = field(default=0.5, metadata=meta(
        "DisPFL: a client's capacity where no device profile gives one, the fraction of weights its mask keeps",
        Range(0, 1, lo_open=True)))
    densities: tuple[float, ...] | None = field(default=None, metadata=meta(
        "capacities cycled over the clients, each as density (overrides it)", Range(0, 1, lo_open=True)))
    options: dict[str, Any] | None = field(default=None, metadata=meta(
        "the algorithm's own options (its Options dataclass); in TOML an [options] table"))
    privacy: dict[str, Any] | None = field(default=None, metadata=meta(
        "differential privacy of the shared part (pfl_edge.privacy.PrivacyConfig, docs/privacy.md); in TOML a "
        "[privacy] table; null: none"))
    secure_aggregation: dict[str, Any] | None = field(default=None, metadata=meta(
        "secure aggregation of the shared part (pfl_edge.secagg_config.SecAggConfig, docs/secagg.md); in TOML a "
        "[secure_aggregation] table; null: none"))
    engine: Literal["auto", "vmap", "loop"] = field(default="auto", metadata=meta(
        "the simulator's training: loop, vmap (every client's step in one torch.func.vmap; no BatchNorm), or auto"))
    workers: int | None = field(default=None, metadata=meta(
        "the simulator's training processes (null: one per core)", Range(1, 1_024)))
    seed: int = field(default=0, metadata=meta(
        "the seed of every random stream (the deal, the initial model, batches, draws)", Range(-(2**63), 2**63 - 1)))

    def __post_init__(self) -> None:
        _check_types(self)
        _check_bounds(self)  # before anything sized by a field (clients, rounds, samples) is built
        algo = algorithm_class(self.algorithm)  # UnknownNameError (a ConfigError) listing the valid names
        if self.densities is not None and not self.densities:
            raise ConfigError("densities must not be empty")
        algo.validate(self)  # the algorithm's own rules and options
        dp = self.dp
        if dp is not None:
            dp.check(self.clients)
            algo.check_privacy(self)
        sa = SecAggConfig.parse(self.secure_aggregation)
        if sa is not None:
            algo.check_privacy(self)  # what it covers: a base a server averages
            sa.check(self)
        self.train_config(1)  # lr, momentum, weight decay, clipping: TrainConfig's rules, so a bad file fails at once

    @property
    def dp(self) -> PrivacyConfig | None:
        """The ``privacy`` table, checked (None: no differential privacy)."""
        return PrivacyConfig.parse(self.privacy)

    @property
    def own_data(self) -> bool:
        """Each device brings its own data: nothing is dealt (``partition = "device"``)."""
        return self.partition == OWN_DATA

    @property
    def effective_kp(self) -> int | None:
        """K_P as the algorithm uses it (``Algorithm.personal_blocks``): 0 for FedAvg and the decentralised ones,
        every block for local (None), else kp."""
        return algorithm_class(self.algorithm).personal_blocks(self)

    def client_density(self, i: int) -> float:
        """Client i's capacity: ``densities`` cycled over clients, else ``density``."""
        return self.densities[i % len(self.densities)] if self.densities else self.density

    def lr_at(self, t: int) -> float:
        return self.lr * self.lr_decay ** (t - 1)

    def train_config(self, t: int, epochs: int | None = None) -> TrainConfig:
        """Local SGD of round ``t`` (1-based; round 0, a late joiner's first fine-tuning, uses round 1's lr)."""
        return TrainConfig(epochs=self.local_epochs if epochs is None else epochs, batch_size=self.batch_size,
                           lr=self.lr_at(max(t, 1)), momentum=self.momentum, weight_decay=self.weight_decay,
                           clip_norm=self.clip_norm,
                           clip_unmasked=algorithm_class(self.algorithm).clip_order(self))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FederationConfig:
        """A config from a table of keys (a TOML file, a run's JSON, a stored federation's, a CLI's flags), with
        keys that became an algorithm's options moved there (``migrate``)."""
        d = migrate(d)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"unknown config keys {sorted(unknown)}; valid keys: {', '.join(sorted(known))}")
        return cls(**d)

    def replace(self, **changes: Any) -> FederationConfig:
        return dataclasses.replace(self, **changes)


SimConfig = FederationConfig  # the name the simulator's users know

# ------------------------------------------------------------------------------------------- data and model


def input_spec(cfg: FederationConfig, *, data_dir: str | None = None) -> tuple[ModelSpec, int]:
    """The model spec a coordinator builds and the most training samples one client may count (``largest
    share``), from the data set's labels alone: the deal's for a dealt federation; for one whose devices bring
    their own data the data set's registered shape and classes, and ``samples_per_client`` (default
    ``OWN_DATA_SAMPLES``)."""
    if cfg.own_data:  # the data set's registered shape: its files need not be here
        shape = get_shape(cfg.dataset, data_dir=data_dir or cfg.data_dir)
        share = cfg.samples_per_client if cfg.samples_per_client is not None else OWN_DATA_SAMPLES
        return model_spec(cfg, shape.num_classes, shape.in_channels, shape.image_size), share
    part, spec = _deal(cfg, get_labels(cfg.dataset, data_dir=data_dir or cfg.data_dir))
    return spec, max(len(c.train_idx) for c in part.clients)


def deal(cfg: FederationConfig, *, data_dir: str | None = None) -> tuple[Dataset, Partition, ModelSpec]:
    """``cfg``'s data set, dealt to its clients, and the model spec it implies: the one place the simulator,
    the server and every device deal a federation's data (so they deal it identically)."""
    ds = get_dataset(cfg.dataset, data_dir=data_dir or cfg.data_dir)
    return (ds, *_deal(cfg, Labels.of(ds)))


def deal_labels(cfg: FederationConfig, *, data_dir: str | None = None) -> tuple[Partition, ModelSpec]:
    """What ``deal`` gives a coordinator, the partition and the model spec, from the data set's labels alone
    (``pfl_edge.data.get_labels``): the same deal, without loading (or holding) a single image."""
    return _deal(cfg, get_labels(cfg.dataset, data_dir=data_dir or cfg.data_dir))


def deal_arrays(cfg: FederationConfig, index: int, *, data_dir: str | None = None) -> ClientArrays:
    """Client ``index``'s share of ``deal`` as numpy arrays (``pfl_edge.data.client_arrays``: the same samples,
    order and float32 bits), without torch; its model spec is ``model_spec(cfg, a.num_classes, a.in_channels,
    a.image_size)``."""
    return client_arrays(cfg.dataset, cfg.partition, cfg.clients, index, _partition_rng(cfg),
                         data_dir=data_dir or cfg.data_dir, samples_per_client=cfg.samples_per_client,
                         test_per_client=cfg.test_per_client, test_draw=cfg.test_draw)


def _partition_rng(cfg: FederationConfig) -> np.random.Generator:
    """The deal's draws, fresh at every deal: ``deal``, ``deal_labels`` and ``deal_arrays`` deal alike."""
    return numpy_rng(cfg.seed, Stream.PARTITION.value)


def _deal(cfg: FederationConfig, lab: Labels) -> tuple[Partition, ModelSpec]:
    if cfg.own_data:
        raise ConfigError(f"partition {OWN_DATA!r}: every device brings its own data (pfl-edge client --data-dir), "
                          "so there is nothing to deal; the simulator, and a device without its own data, need a "
                          f"dealt partition ({', '.join(list_partitioners())})")
    part = partition(cfg.partition, lab.train_y, lab.test_y, cfg.clients, lab.num_classes, _partition_rng(cfg),
                     samples_per_client=cfg.samples_per_client, test_per_client=cfg.test_per_client,
                     test_draw=cfg.test_draw)
    return part, model_spec(cfg, part.num_classes, lab.in_channels, lab.image_size)


def model_spec(cfg: FederationConfig, num_classes: int, in_channels: int, image_size: int) -> ModelSpec:
    # a linear base keeps cfg.kp personal blocks behind one "base" block
    return ModelSpec(cfg.model, num_classes, in_channels, image_size, cfg.base, cfg.kp if cfg.base == "linear" else 0)


def model_id(spec: ModelSpec) -> str:
    """The id in every payload's header: a device refuses weights of another model."""
    return f"{spec.model}/{spec.num_classes}/{spec.in_channels}x{spec.image_size}/{spec.base}{spec.kp}"


def init_state(cfg: FederationConfig, spec: ModelSpec) -> dict[str, Tensor]:
    """The model every client starts from (the simulator's and every device's)."""
    import torch

    torch.manual_seed(derive_seed(cfg.seed, Stream.INIT.value))
    return {k: v.detach().clone() for k, v in build_model(spec).state_dict().items()}


# ------------------------------------------------------------------------------------------- devices

def check_device_algorithm(name: str) -> None:
    """ConfigError unless ``name`` runs on devices (an unknown name: UnknownNameError, listing them all). Asked
    of the registry at each call: an algorithm registered after import (a plug-in's) counts."""
    algorithm_class(name)  # an unknown name: UnknownNameError, listing every algorithm
    valid = device_algorithms()
    if name not in valid:
        raise ConfigError(f"algorithm {name!r} does not run on devices; valid: {', '.join(valid)}")


def check_device_config(cfg: FederationConfig) -> None:
    """What a federation of real devices can run: its algorithm, and the rules its algorithm adds for devices
    (the server samples each round's participants as the simulator does, by slot)."""
    check_device_algorithm(cfg.algorithm)
    algorithm_class(cfg.algorithm).check_devices(cfg)
    check_device_privacy(cfg)


def device_capacity(cfg: FederationConfig, slot: int, *, profile_density: float | None = None,
                    profile_kp: int | None = None) -> tuple[float, int]:
    """A device's (density, K_P): its profile's where the federation takes capacities from profiles (both given),
    else the config's for its slot. The density is 1 where the algorithm keeps no mask (FedPer, FedAvg, Ditto:
    what the card says and the device trains at); K_P is 0 where nothing is personal (FedAvg, the decentralised
    algorithms), and the config's for the linear-base control (its model is built for one K_P)."""
    if profile_density is not None and profile_kp is not None:
        density, kp = float(profile_density), int(profile_kp)
    else:
        density, kp = cfg.client_density(slot), cfg.kp
    algo = algorithm_class(cfg.algorithm)
    k = algo.kp_for(cfg, kp)  # the algorithm's K_P rule
    return algo.mask_density(density), kp if k is None else k


# A federation's config arrives from the network (an admin's request), and a field that sizes something (clients,
# rounds, samples) must be refused before anything that size is allocated: its ``Range`` is checked first.
def _check_bounds(cfg: FederationConfig) -> None:
    check_ranges(cfg)
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, str) and len(v) > _MAX_TEXT:
            raise ConfigError(f"{f.name} must be at most {_MAX_TEXT} characters, got {len(v)}")
    for name in ("privacy", "secure_aggregation"):
        table = getattr(cfg, name)
        if table is not None and len(table) > 16:
            raise ConfigError(f"{name} must hold at most 16 entries, got {len(table):,}")
    if cfg.options is not None:
        if len(cfg.options) > 64:
            raise ConfigError(f"options must hold at most 64 entries, got {len(cfg.options):,}")
        for k, v in cfg.options.items():
            if len(k) > 64 or (isinstance(v, str) and len(v) > _MAX_TEXT):
                raise ConfigError(f"option {k!r:.70} is too long (names at most 64 characters, texts {_MAX_TEXT})")
    if cfg.densities is not None and len(cfg.densities) > MAX_CLIENTS:
        raise ConfigError(f"densities must list at most {MAX_CLIENTS:,} values, got {len(cfg.densities):,}")


def _check_types(cfg: FederationConfig) -> None:
    """Every field has its declared type (a config file can hold anything); ints are accepted for floats
    and lists for tuples, and converted."""
    hints = typing.get_type_hints(FederationConfig)
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        ok, converted = coerce(value, hints[f.name])
        if not ok:
            raise ConfigError(f"{f.name} must be {describe(hints[f.name])}, got {value!r}")
        if converted is not value:
            object.__setattr__(cfg, f.name, converted)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A TOML file of config keys, or the JSON of an earlier run (its ``config``), as a dict."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e}") from e
    try:
        if p.suffix == ".toml":
            data: Any = tomllib.loads(text)
        else:
            data = json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p} is not valid {'TOML' if p.suffix == '.toml' else 'JSON'}: {e}") from e
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        data = data["config"]
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a table of config keys")
    return {k.replace("-", "_"): v for k, v in data.items()}
