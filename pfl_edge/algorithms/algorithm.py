"""The interface each algorithm implements once, and the registry.

An algorithm is a class registered under its name. What the rest of pfl-edge needs to know about it before
there is a model (does it run on devices, how many blocks are personal, which config rules it adds, whether its
clients keep sparse masks) is on the class, so that the federation config, the simulator, the server and the
device ask it instead of comparing names. An algorithm object is built for a federation config and a model (and,
for FedPer, the K_P of the clients it serves). Its client side is a set of pure functions over stacks
(``Clients`` says whose rows they are); its coordinator side plans a round and aggregates. The device-level
methods (``device_*``) compose the client side for one device's round, so the agent runs a round without knowing
which algorithm it follows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from ..arrays import Array as Tensor
from ..errors import ConfigError, UnknownNameError
from ..privacy import secret_draw
from ..protocol import MAX_NEIGHBOURS
from ..split import Split, split_keys
from ..topology import in_degree, neighbours
from .base import Clients, Metrics, Participation, Received, Upload
from .options import DecentralOptions, NoOptions
from .participants import sample_participants, sampled_slots

if TYPE_CHECKING:  # the config asks its algorithm's class; the algorithms only read its fields
    import numpy

    from ..aggregate import AggregationRule, PartialAverage
    from ..federation import FederationConfig
    from ..models import BlockModel
    from .simulation import Simulation, World

__all__ = [
    "Algorithm",
    "Decentralised",
    "DeviceRound",
    "algorithm_class",
    "device_algorithms",
    "get_algorithm",
    "list_algorithms",
    "register_algorithm",
    "sample_participants",
]


@dataclass(frozen=True, eq=False)
class DeviceRound:
    """One device's round: its new state (everything it keeps, in one dict), what it uploads, the metrics it
    can report now, the model it deploys where that is not simply its state's model (DisPFL: the trained model
    of this round; FedPer: on the final step, its personal blocks on the last base), and its training's loss and
    steps."""

    state: dict[str, Tensor]
    upload: Upload | None
    metrics: list[Metrics] = field(default_factory=list)
    deployed: dict[str, Tensor] | None = None
    train_loss: float | None = None
    steps: int = 0
    dropped: tuple[int, ...] = ()  # the neighbours' slots it left out of this round (DisPFL's screen)


class Algorithm:
    #: the name it is registered under (``register_algorithm``) and a config names it by
    name: ClassVar[str] = ""
    #: its own options (a frozen dataclass that validates them), given as the config's ``options`` table
    Options: ClassVar[type[Any]] = NoOptions
    #: which blocks stay on a client: "kp" the config's K_P (FedPer), "none" (FedAvg, the decentralised ones:
    #: every tensor travels), "all" (local training)
    keeps: ClassVar[Literal["kp", "none", "all"]] = "kp"
    #: devices exchange models among themselves (through the server's relay); the server never averages
    decentral: ClassVar[bool] = False
    #: it runs on devices (the agent, the server's coordination), not only in the simulator
    on_devices: ClassVar[bool] = False
    #: each client keeps a personal sparse mask at its own density, sent with its model (DisPFL)
    sparse_masks: ClassVar[bool] = False
    #: it may run FedPer's control with a linear base (``base = "linear"``)
    linear_base: ClassVar[bool] = False
    #: its clients fine-tune their personal blocks for ``ft_epochs`` on every base they receive (FedPer-FT)
    finetunes_personal: ClassVar[bool] = False
    #: what a client deploys (and is evaluated on) is its model fine-tuned for ``ft_epochs``, not kept (-FT)
    deploys_finetuned: ClassVar[bool] = False
    #: the whole gradient is clipped before masks apply, when the config leaves ``clip_unmasked`` unset
    clips_unmasked: ClassVar[bool] = False
    #: differential privacy (``pfl_edge.privacy``) covers what it shares: a base a server averages
    private: ClassVar[bool] = False
    #: a device sends its initial model before round 1 (its first neighbours average it)
    sends_initial_model: ClassVar[bool] = False
    #: the server ends the federation with a final task on which every device evaluates (FedPer: its personal
    #: blocks on the last base); otherwise a device's last round is its last evaluation
    final_evaluation: ClassVar[bool] = False
    #: the on-device training program a device of this algorithm runs (``export.TRAINING_MODES``): the whole model
    #: (its personal blocks alone for -FT's fine-tuning), or DisPFL's masked program with the dense gradient
    program_mode: ClassVar[str] = "fedper"

    @classmethod
    def personal_blocks(cls, cfg: FederationConfig) -> int | None:
        """K_P as the config gives it to this algorithm: the blocks that stay personal (None: every block)."""
        return {"kp": cfg.kp, "none": 0, "all": None}[cls.keeps]

    @classmethod
    def kp_for(cls, cfg: FederationConfig, kp: int | None = None) -> int | None:
        """The K_P rule, once: the personal blocks of a client of capacity ``kp`` (a device's profile; None: the
        config's). None where every block is personal (local training), 0 where none is (FedAvg, the
        decentralised ones), the config's for the linear-base control (its model is built for one K_P)."""
        own = cls.personal_blocks(cfg)
        if own is None or own == 0:
            return own
        return own if kp is None or cfg.base == "linear" else kp

    @classmethod
    def split_kp(cls, cfg: FederationConfig, num_blocks: int, kp: int | None = None) -> int:
        """``kp_for`` as a block count of a ``num_blocks`` model."""
        k = cls.kp_for(cfg, kp)
        return num_blocks if k is None else k

    @classmethod
    def validate(cls, cfg: FederationConfig) -> None:
        """Every rule the algorithm puts on a federation config (ConfigError): its options, the linear-base
        control's, and ``check_config``'s."""
        cls.options_for(cfg)
        if cfg.base == "linear" and (not cls.linear_base or cfg.kp < 1):
            valid = ", ".join(n for n, c in _REGISTRY.items() if c.linear_base)
            raise ConfigError(f"base 'linear' is FedPer's control: use it with {valid} and kp >= 1")
        cls.check_config(cfg)

    @classmethod
    def check_config(cls, cfg: FederationConfig) -> None:
        """The rules this algorithm adds to the federation config's own (ConfigError)."""

    @classmethod
    def check_privacy(cls, cfg: FederationConfig) -> None:
        """ConfigError unless differential privacy (``pfl_edge.privacy``) covers what this algorithm shares."""
        if cls.private:
            return
        valid = ", ".join(n for n, c in _REGISTRY.items() if c.private)
        table = "privacy" if cfg.privacy is not None else "secure_aggregation"
        raise ConfigError(f"algorithm {cls.name!r}: a {table} table covers a base a server averages; "
                          f"valid: {valid} (docs/privacy.md says what applies to the decentralised ones)")

    @classmethod
    def check_devices(cls, cfg: FederationConfig) -> None:
        """The rules a federation of real devices adds (ConfigError). A device works only in the rounds that
        sample it, so an algorithm whose clients adapt to every round's base, sampled or not (FedPer-FT in the
        simulator), would not be the simulator's with ``participation`` < 1."""
        if cfg.participation != 1.0 and cls.finetunes_personal:
            raise ConfigError(f"participation {cfg.participation:g}: {cls.name} adapts every client's personal "
                              "blocks to every round's base, and a device that a round does not sample has no task "
                              "to do it in; use participation = 1 (or the simulator)")

    @classmethod
    def clip_order(cls, cfg: FederationConfig) -> bool:
        """Is the whole gradient clipped before masks apply? The config's ``clip_unmasked``, else the
        algorithm's way (DisPFL's reference clips first; without masks the order makes no difference)."""
        return cls.clips_unmasked if cfg.clip_unmasked is None else cfg.clip_unmasked

    @classmethod
    def keeps_config_kp(cls) -> bool:
        """Does the config's ``kp`` name blocks that stay on a client (FedPer and FedPer-FT)?"""
        return cls.keeps == "kp"

    @classmethod
    def has_masks(cls) -> bool:
        """Does each client keep a personal sparse mask at its own density (so a device's density matters)?"""
        return cls.sparse_masks

    @classmethod
    def mask_density(cls, density: float) -> float:
        """The density a device of capacity ``density`` trains at: its own where it keeps a mask, else dense."""
        return density if cls.sparse_masks else 1.0

    @classmethod
    def mask_schedule(cls, cfg: FederationConfig) -> dict[str, Any] | None:
        """How a client's mask changes round to round, for the model card (None without masks)."""
        return None

    @classmethod
    def finetune_epochs(cls, cfg: FederationConfig) -> int:
        """Epochs a device fine-tunes its personal blocks on each base it receives (FedPer-FT), else 0."""
        return cfg.ft_epochs if cls.finetunes_personal else 0

    @classmethod
    def options_for(cls, cfg: FederationConfig) -> Any:
        """The config's ``options`` as this algorithm's ``Options`` (ConfigError naming the valid keys)."""
        given = dict(cfg.options or {})
        known = [f.name for f in fields(cls.Options)]
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ConfigError(f"algorithm {cls.name!r} has no option {', '.join(map(repr, unknown))}; its options: "
                              f"{', '.join(known) or 'none'}")
        try:
            return cls.Options(**given)
        except TypeError as e:
            raise ConfigError(f"algorithm {cls.name!r}'s options: {e}") from None

    def device_programs(self) -> tuple[str, ...]:
        """Every training program a device of this algorithm may run, ``training_program()`` (the one the agent
        trains with) first: what the server exports and a model card lists."""
        return (self.program_mode,)

    def training_program(self) -> str:
        """The program mode a device trains with (``export.TRAINING_MODES``)."""
        return self.program_mode

    def __init__(self, cfg: FederationConfig, model: BlockModel, kp: int | None = None) -> None:
        self.cfg = cfg
        self.model = model
        self.options = self.options_for(cfg)
        k = self.split_kp(cfg, len(model.block_names), kp)
        self.split: Split = split_keys(model, k, local_norm_stats=cfg.local_norm_stats)

    # ------------------------------------------------------------------------------------------ coordinator
    def participants(self, t: int, key: bytes | None = None) -> Tensor:
        """``sampled(t, key)`` as the simulator takes it: the slots of round ``t``, sorted (all where all)."""
        return sample_participants(self.cfg.seed, t, self.cfg.clients, self.cfg.participation,
                                   poisson=self.cfg.privacy is not None, key=key)

    def sampled(self, t: int, key: bytes | None = None) -> frozenset[int] | None:
        """The slots that take part in round ``t`` (None: every client), cached: the server asks on every update.
        ``key``: the server's sampling key, where the draw is secret (``secret_draw``; without it the draw is the
        seed's, the simulator's default, not the server's: a device of such a federation never asks here)."""
        return sampled_slots(self.cfg.seed, t, self.cfg.clients, self.cfg.participation,
                             self.cfg.privacy is not None, key)

    def participation(self, t: int, key: bytes | None = None) -> Participation:
        """Who takes part in round ``t`` (0: the devices' initial models, where the algorithm takes them):
        the one definition the server and the devices read (``key``: as ``sampled``'s)."""
        if t == 0:
            return Participation(0, None if self.sends_initial_model else frozenset(), False)
        return Participation(t, self.sampled(t, key), self.sends_initial_model)

    def secret_draw(self) -> bool:
        """Whether the server draws the rounds under a key no device holds (``pfl_edge.privacy.secret_draw``): a
        device then asks the server, whose task says whether it was drawn."""
        return secret_draw(self.cfg)

    def neighbours(self, t: int) -> list[list[int]] | None:
        """Decentralised algorithms: each slot's in-neighbours in round ``t``; None where a server averages."""
        return None

    def partial_sum(self) -> PartialAverage | None:
        """An empty sum that a share of a round's updates folds into and that ``aggregate`` takes as ``start``
        (server replicas' partial sums, ``server.services.partials``); None where the aggregate needs every
        update at once, and the server reads them one by one."""
        return None

    def aggregate(self, prev: Mapping[str, Tensor], updates: Iterable[tuple[Mapping[str, Tensor], float]], *,
                  rule: AggregationRule | None = None, history: Sequence[float] = (),
                  bounds: Sequence[float | None] | None = None, norms: Sequence[float] | None = None,
                  start: PartialAverage | None = None, summed: Sequence[tuple[numpy.ndarray, int]] | None = None,
                  noise: numpy.random.Generator | None = None, t: int = 0,
                  ids: Sequence[int] | None = None) -> dict[str, Tensor] | None:
        """The coordinator's new shared model from the round's updates (weights: training samples), streamed
        one at a time, under the federation's ``rule`` (default: the mean; updates come clipped to its bound,
        a robust rule's unclipped, with the last round's norms in ``history``), after the updates already
        folded into ``start`` (``partial_sum``'s, under the mean only); None where nothing is shared through a
        server. Under differential privacy (``pfl_edge.privacy``): the private mean, its noise from ``noise``
        (the round's stream); under secure aggregation, round ``t``'s (``summed``: the sums a server unmasked,
        one per group, and how many inputs each holds; ``ids``: the updates' slots). ``bounds``/``norms``: each
        update's norm bound and norm where the caller knows them (the update-bound stage). The server always
        asks here: an algorithm composes the rule with its own step, and the server clips, averages and applies
        nothing itself."""
        return None

    def simulation(self, world: World) -> Simulation:
        """This algorithm over every client at once (the simulator's runner drives it): its clients' state, its
        round over every row, composed of the pieces a device's round calls, and what the round costs."""
        raise ConfigError(f"algorithm {self.name!r} cannot be simulated")

    # ------------------------------------------------------------------------------------------ server
    # What a coordinating server does differently per algorithm, asked of the algorithm (server/ reads no trait).
    def shared_digest(self, digest: str | None) -> str | None:
        """The server's shared model (``digest``: a round's base, what the round announces and what its
        updates are measured from) where the algorithm has one; None where devices average among themselves."""
        return None if self.decentral else digest

    def readable(self, t: int, slot: int | None = None) -> frozenset[int]:
        """The slots whose latest uploads the device at ``slot`` reads for round ``t`` (its in-neighbours'; None:
        any device's), which the server serves it and keeps; none where a server averages."""
        graph = self.neighbours(t) or []
        return frozenset(j for i, row in enumerate(graph) if slot is None or i == slot for j in row)

    def upload_keys(self) -> tuple[str, ...]:
        """The tensors a device of this algorithm (at its K_P) sends and receives; the rest never travel."""
        return self.split.base

    def describe_upload(self, kp: int, density: float) -> str:
        """What a device sends, in words, for the server's refusals."""
        return f"its base part only (kp={kp})" if self.split.personal else "its whole model"

    def mask_ones(self, density: float) -> dict[str, int] | None:
        """The most ones each tensor's mask may hold in an update of a device at ``density`` (None: updates carry
        no masks)."""
        return None

    def upload_norm_bound(self, others: Sequence[float]) -> float | None:
        """Where uploads are whole models that devices average among themselves: the largest L2 norm the server
        accepts of one, given ``others``, the norms of the uploads it already holds for the round (and the
        previous round's); None: no bound (a server that averages clips instead, ``AggregationRule``)."""
        return None

    def closing(self, t: int) -> Participation:
        """Who takes the federation's closing step after its last round ``t``: a final task on which each device
        evaluates and stops (FedPer: its personal blocks on the last base): every device (a late joiner of the
        last round too), or none where a device's last round is its last evaluation."""
        return Participation(t, None if self.final_evaluation else frozenset(), False)

    # ------------------------------------------------------------------------------------------ device
    def device_init(self, dev: Clients, init: Mapping[str, Tensor], density: float) -> dict[str, Tensor]:
        """A device's state before its first round, from the federation's initial model."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")

    def device_upload(self, state: Mapping[str, Tensor]) -> Upload:
        """What a device whose state is ``state`` (as its last round, or its initialisation, left it) sends."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")

    def device_round(self, dev: Clients, state: Mapping[str, Tensor], received: Received, t: int, *,
                     prev: int = 0, late: bool = False, final: bool = False) -> DeviceRound:
        """Round ``t`` of a device (``dev`` holds its one row) from what its task made it fetch. ``prev``: the
        round it last trained in (0: none yet); ``late``: it joined a running federation; ``final``: the
        federation's last step (evaluate, no training, nothing to send)."""
        raise ConfigError(f"algorithm {self.name!r} does not run on devices")


class Decentralised(Algorithm):
    """Clients average with their in-neighbours of the round (its options' topology, drawn from the federation's
    seed); no server averages."""

    Options: ClassVar[type[Any]] = DecentralOptions
    decentral = True
    keeps = "none"  # every tensor travels (DisPFL's personalisation is its mask, not its blocks)

    @classmethod
    def topology_spec(cls, cfg: FederationConfig) -> str:
        """The federation's topology (its options', the default filled in)."""
        return str(cls.options_for(cfg).topology_spec(cfg.clients))

    @classmethod
    def check_config(cls, cfg: FederationConfig) -> None:
        spec = cls.topology_spec(cfg)
        degree = in_degree(spec, cfg.clients)  # the topology checked, then its in-degree
        if cfg.participation != 1.0:
            raise ConfigError("decentralized algorithms train every client every round: participation must be 1")
        # every round lists clients x degree edges, and each device fetches its degree
        if degree > MAX_NEIGHBOURS:
            raise ConfigError(f"topology {spec!r:.40} gives each of {cfg.clients:,} clients {degree:,} "
                              f"neighbours; at most {MAX_NEIGHBOURS:,} (random:K with a smaller K)")

    def neighbours(self, t: int) -> list[list[int]] | None:
        return neighbours(self.topology_spec(self.cfg), self.cfg.clients, t, self.cfg.seed)

    def upload_keys(self) -> tuple[str, ...]:
        return tuple(self.model.state_dict())

    def describe_upload(self, kp: int, density: float) -> str:
        return "its whole model"


_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound=type[Algorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Register an algorithm class under ``name`` (its ``name`` from then on); a name is registered once."""

    def deco(cls: A) -> A:
        if name in _REGISTRY:
            raise ConfigError(f"algorithm {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def list_algorithms() -> list[str]:
    """Every registered name, in registration order."""
    return list(_REGISTRY)


def device_algorithms() -> list[str]:
    """The algorithms that run on devices."""
    return [n for n, c in _REGISTRY.items() if c.on_devices]


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name``; an error listing the valid names if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError("algorithm", name, list_algorithms()) from None


def get_algorithm(cfg: FederationConfig, model: BlockModel, kp: int | None = None) -> Algorithm:
    """The algorithm ``cfg.algorithm`` for this config and model (``kp``: the K_P of the clients it serves; by
    default the config's)."""
    return algorithm_class(cfg.algorithm)(cfg, model, kp)
