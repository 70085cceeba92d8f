"""The protocol between the server and its devices, defined once: HTTP paths, MQTT topics and every message.

Both ``server/`` and ``edge_runtime/`` import this module and nothing of each other. Messages are pydantic
models with ``extra="forbid"``: an unknown or mistyped field is an error, not silently dropped. Weights never
travel over MQTT: control messages carry sha256 digests of blobs, which devices fetch over HTTP.

Topics (MQTT 3.1.1, QoS 1; ``fed`` is the federation id, ``dev`` a device id):

- ``pfl/<fed>/round`` (retained): :class:`RoundAnnouncement`, the federation's current round and state.
- ``pfl/<fed>/device/<dev>/task`` (retained): :class:`Task`, what this device must do in the current round.
- ``pfl/<fed>/device/<dev>/status`` (retained): :class:`DeviceStatus`, ``online`` from the device on connect,
  ``offline`` as its last will.

HTTP (JSON unless said; every call but enrolment and the health check carries ``Authorization: Bearer
<token>``):

- ``POST /v1/federations`` (admin token): :class:`FederationCreate` -> :class:`FederationInfo`
- ``GET /v1/federations/{fed}``: :class:`FederationInfo`
- ``POST /v1/devices``: :class:`EnrolRequest` -> :class:`Enrolment`
- ``GET /v1/devices/me/broker``: :class:`BrokerInfo` (where the broker is now, for a device that cannot reach it)
- ``PUT /v1/blobs/{sha256}`` (raw bytes) and ``GET /v1/blobs/{sha256}``
- ``POST /v1/rounds/{t}/updates``: :class:`UpdateRequest` -> :class:`UpdateAccepted`
- ``POST /v1/rounds/{t}/metrics``: :class:`MetricsReport`
- ``GET /v1/federations/{fed}/metrics``: every round's metrics per device
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "API_PREFIX",
    "DIGEST_RE",
    "MAX_CLIENTS",
    "MAX_DEADLINE_S",
    "MAX_ROUND",
    "PROTOCOL_VERSION",
    "AggregationSettings",
    "BrokerInfo",
    "DeviceStatus",
    "EnrolRequest",
    "Enrolment",
    "FederationCreate",
    "FederationInfo",
    "MetricsReport",
    "Neighbour",
    "RoundAnnouncement",
    "RoundState",
    "Task",
    "UpdateAccepted",
    "UpdateRequest",
    "mqtt_client_id",
    "round_topic",
    "status_topic",
    "task_topic",
]

PROTOCOL_VERSION = 1
API_PREFIX = "/v1"
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_ID_RE = r"^[A-Za-z0-9_-]{1,64}$"

RoundState = Literal["open", "collecting", "closing", "published", "finished"]


def round_topic(fed: str) -> str:
    return f"pfl/{fed}/round"


def task_topic(fed: str, device: str) -> str:
    return f"pfl/{fed}/device/{device}/task"


def status_topic(fed: str, device: str) -> str:
    return f"pfl/{fed}/device/{device}/status"


def mqtt_client_id(device: str) -> str:
    """A device's MQTT client id: its broker identity may connect with no other (``pfl-<device id>``)."""
    return f"pfl-{device}"


MAX_ROUND = 1_000_000
MAX_COUNT = 2**53  # byte and sample counts: what JSON numbers carry exactly
MAX_CLIENTS = 100_000  # slots (devices) of one federation; pfl_edge.federation bounds its config by it too
MAX_DEADLINE_S = 7 * 86_400  # a round's deadline
MAX_SECONDS = 1e9  # a duration a device measured (train_s), or a unix time (deadlines): finite and sane
_MAX_KP = 1_000  # personal blocks
_NAME = 256  # a label, profile, algorithm or credential
_MAX_CONFIG_KEYS, _MAX_CONFIG_DEPTH, _MAX_CONFIG_TEXT = 64, 4, 4_096
_CONFIG_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


class _Msg(BaseModel):
    # NaN/Inf are refused in every message: a metric or loss must be a number a database can keep
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _digest(v: str) -> str:
    if not DIGEST_RE.match(v):
        raise ValueError("must be a sha256 digest: 64 lowercase hex characters")
    return v


def _bounded_config(v: dict[str, object]) -> dict[str, object]:
    """A federation's config as it travels: at most 64 keys named like identifiers, values nested at most 4 deep,
    strings of at most 4,096 characters, lists of at most MAX_CLIENTS items, finite numbers. What the keys mean
    is ``pfl_edge.federation.FederationConfig``'s to check."""
    if len(v) > _MAX_CONFIG_KEYS:
        raise ValueError(f"config has {len(v)} keys; at most {_MAX_CONFIG_KEYS}")
    for key in v:
        if not _CONFIG_KEY_RE.match(key):
            raise ValueError(f"config key {key!r:.80} is not a name (letters, digits, _ and -; at most 64)")
    _check_json(v, _MAX_CONFIG_DEPTH)
    return v


def _check_json(x: object, depth: int) -> None:
    if isinstance(x, str):
        if len(x) > _MAX_CONFIG_TEXT:
            raise ValueError(f"config holds a string of {len(x)} characters; at most {_MAX_CONFIG_TEXT}")
    elif isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError("config holds NaN or Infinity; numbers must be finite")
    elif isinstance(x, list | tuple | dict):
        if depth <= 0:
            raise ValueError(f"config is nested more than {_MAX_CONFIG_DEPTH} levels deep")
        if len(x) > MAX_CLIENTS:
            raise ValueError(f"config holds a collection of {len(x)} items; at most {MAX_CLIENTS}")
        for item in x.values() if isinstance(x, dict) else x:
            _check_json(item, depth - 1)
    elif not (x is None or isinstance(x, bool | int)):
        raise ValueError(f"config holds a {type(x).__name__}; only JSON values are allowed")


class AggregationSettings(_Msg):
    """How the server bounds and combines a round's updates (``pfl_edge.aggregate.AggregationRule``): each
    update's difference from the round's start model is clipped to ``max_update_norm`` (absolute) or, unset, to
    ``norm_multiple`` times the round's median update norm (both null: unclipped); then ``rule``. A device's
    sample count (the mean's weight) is clamped to what it declared at enrolment and to ``max_samples`` (unset:
    the largest training share the federation's data set deals a client)."""

    rule: Literal["mean", "clipped-mean", "median", "trimmed-mean"] = "mean"
    max_update_norm: float | None = Field(default=None, gt=0, le=1e12)
    norm_multiple: float | None = Field(default=3.0, ge=1, le=1e6)
    trim: float = Field(default=0.2, ge=0, lt=0.5)  # trimmed-mean: the fraction dropped from each end
    max_samples: int | None = Field(default=None, ge=1, le=2**31 - 1)


class FederationCreate(_Msg):
    """A federation from a config. ``config`` holds the simulator's config keys (``pfl_edge.sim.SimConfig``:
    algorithm, model, dataset, partition, clients, rounds, local epochs, lr, kp, density, topology, seed, ...);
    ``clients`` is the number of devices the federation waits for before round 1."""

    id: str = Field(pattern=_ID_RE)
    enrol_secret: str = Field(min_length=8, max_length=256)
    config: dict[str, object]
    quorum: float = Field(default=1.0, gt=0, le=1)  # fraction of enrolled devices that closes a round early
    # after this, a round closes with whatever quorum it has
    deadline_s: float = Field(default=600.0, gt=0, le=MAX_DEADLINE_S)
    min_updates: int = Field(default=1, ge=1, le=MAX_CLIENTS)  # a round past its deadline with fewer stays open
    # round 1 opens once this many devices have enrolled (None: all ``clients`` slots); the others may join
    # later, into free slots, and take part from the round after they join
    min_devices: int | None = Field(default=None, ge=1, le=MAX_CLIENTS)
    profile_capacity: bool = False  # density and K_P from each device's profile instead of the config
    aggregation: AggregationSettings | None = None  # None: the weighted mean, the default norm bound

    _config = field_validator("config")(_bounded_config)

    @model_validator(mode="after")
    def _within_clients(self) -> FederationCreate:
        clients = self.config.get("clients")
        if isinstance(clients, int) and not isinstance(clients, bool):
            for name in ("min_updates", "min_devices"):
                v = getattr(self, name)
                if v is not None and v > clients:
                    raise ValueError(f"{name} ({v}) is more than the config's clients ({clients})")
        return self


class FederationInfo(_Msg):
    id: str = Field(pattern=_ID_RE)
    config: dict[str, object]
    round: int = Field(ge=0, le=MAX_ROUND)
    state: RoundState
    devices: int = Field(ge=0, le=MAX_CLIENTS)
    quorum: float
    deadline_s: float  # not bounded here: a row written before the bounds existed must still be readable
    profile_capacity: bool


class EnrolRequest(_Msg):
    federation: str = Field(pattern=_ID_RE)
    enrol_secret: str = Field(max_length=256)
    profile: str = Field(max_length=64)
    name: str = Field(default="", max_length=64)  # a label for tables; not an identity
    index: int | None = Field(default=None, ge=0, lt=MAX_CLIENTS)  # the data partition it holds, if it wants it
    # chosen by the device and kept before it asks: the same nonce again (a retry whose answer was lost) gets
    # the same device back, with a fresh token, instead of a second device in another slot
    nonce: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    # its training samples (FedPer's averaging weight is clamped to this and to the federation's maximum)
    n_samples: int | None = Field(default=None, ge=1, le=2**31 - 1)


class Enrolment(_Msg):
    device_id: str = Field(pattern=_ID_RE)
    token: str = Field(max_length=_NAME)
    index: int = Field(ge=0, lt=MAX_CLIENTS)  # its slot in the federation: seeds, partition, topology
    federation: str = Field(pattern=_ID_RE)
    config: dict[str, object]
    density: float = Field(gt=0, le=1)
    kp: int = Field(ge=0, le=_MAX_KP)
    broker_url: str = Field(max_length=2_048)
    mqtt_username: str = Field(max_length=_NAME)
    mqtt_password: str = Field(max_length=_NAME)
    round: int = Field(ge=0, le=MAX_ROUND)  # the federation's round; a device joining late takes part from the next
    init_digest: str  # the model every device starts from (FedPer: its base; DisPFL: the dense init)

    _config = field_validator("config")(_bounded_config)
    _check = field_validator("init_digest")(_digest)


class Neighbour(_Msg):
    index: int = Field(ge=0, lt=MAX_CLIENTS)
    device_id: str = Field(pattern=_ID_RE)
    digest: str

    _check = field_validator("digest")(_digest)


class Task(_Msg):
    """Round ``round`` for one device. FedPer: load ``base`` (the server's latest average), train, upload the
    base part. DisPFL: average ``neighbours``' latest sparse models with its own, train, prune and regrow,
    upload its sparse model. ``final``: no training; evaluate on ``base`` and report (FedPer's last step)."""

    federation: str = Field(pattern=_ID_RE)
    round: int = Field(ge=0, le=MAX_ROUND)
    algorithm: str = Field(max_length=_NAME)
    base: str | None = None
    neighbours: list[Neighbour] = Field(default_factory=list, max_length=MAX_CLIENTS)
    deadline: float = Field(ge=0, le=1e11)  # unix time
    final: bool = False

    @field_validator("base")
    @classmethod
    def _base(cls, v: str | None) -> str | None:
        return None if v is None else _digest(v)


class RoundAnnouncement(_Msg):
    federation: str = Field(pattern=_ID_RE)
    round: int = Field(ge=0, le=MAX_ROUND)
    state: RoundState
    base: str | None = None
    deadline: float | None = Field(default=None, ge=0, le=1e11)  # unix time

    @field_validator("base")
    @classmethod
    def _base(cls, v: str | None) -> str | None:
        return None if v is None else _digest(v)


class BrokerInfo(_Msg):
    """The MQTT broker as devices reach it now: a device that cannot reach the one its enrolment named asks
    again (the operator may have moved it)."""

    broker_url: str = Field(max_length=2_048)


class DeviceStatus(_Msg):
    device_id: str = Field(pattern=_ID_RE)
    state: Literal["online", "offline"]


class UpdateRequest(_Msg):
    """A device's result of round ``t``: the digest of the blob it uploaded (its base part, or its sparse
    model), its sample count (FedPer's weight) and what it measured."""

    digest: str
    n_samples: int = Field(ge=1, le=2**31 - 1)
    train_loss: float | None = None  # finite, as every float here
    train_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
    bytes_down: int = Field(default=0, ge=0, le=MAX_COUNT)

    _check = field_validator("digest")(_digest)


class UpdateAccepted(_Msg):
    round: int = Field(ge=0, le=MAX_ROUND)
    accepted: bool  # False: an identical update was already accepted (idempotent retry)
    updates: int = Field(ge=0, le=MAX_CLIENTS)  # accepted so far this round


class MetricsReport(_Msg):
    """Evaluation of the model a device deploys after round ``t`` on its own test data."""

    accuracy: float = Field(ge=0, le=1)
    loss: float  # finite (no upper bound: a diverged model's loss is still worth reporting)
    n_test: int = Field(ge=0, le=2**31 - 1)
    bytes_up: int = Field(default=0, ge=0, le=MAX_COUNT)
    bytes_down: int = Field(default=0, ge=0, le=MAX_COUNT)
    step_ms: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
    train_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS)
