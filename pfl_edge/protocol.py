"""The protocol between the server and its devices, defined once: HTTP paths, MQTT topics and every message.

Both ``server/`` and ``edge_runtime/`` import this module and nothing of each other. Weights never travel over
MQTT: control messages carry sha256 digests of blobs, which devices fetch over HTTP. Topics (MQTT 3.1.1, QoS 1):
``pfl/<fed>/round`` (retained :class:`RoundAnnouncement`), ``pfl/<fed>/device/<dev>/task`` (retained
:class:`Task`), ``pfl/<fed>/device/<dev>/status`` (retained :class:`DeviceStatus`, ``online``; ``offline`` as the
will). The HTTP routes and which message each takes and answers: docs/protocol.md, "HTTP API".

Versions (docs/protocol.md, "Versions"; every change: docs/protocol-changes.md): a device says which it speaks
(``EnrolRequest.protocols``; absent: 1), the server answers in the highest both speak (:func:`negotiate`). What a
device sends is strict (``extra="forbid"``); what it is sent (an :class:`_Answer`) a device of version 2 reads
tolerantly; a device of version 1 refuses unknown fields, so it is sent none that version 1 did not have.
Refusals are :class:`ErrorBody`; JSON Schemas: ``pfl_edge.schemas`` (docs/schemas, ``GET /v1/schemas``).
"""
from __future__ import annotations

import re
import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .config_bounds import bounded_config, config_field
from .device_info import Platform
from .device_key import KeyProof, TokenRotation
from .topics import mqtt_client_id, quorum_updates, round_topic, status_topic, task_topic

__all__ = [
    "API_PREFIX",
    "COSTS",
    "COSTS_SINCE",
    "DEFAULT_NORM_MULTIPLE",
    "DIGEST_RE",
    "MAX_CLIENTS",
    "MAX_DEADLINE_S",
    "MAX_NEIGHBOURS",
    "MAX_ROUND",
    "MIN_ENROL_SECRET",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "AggregationSettings",
    "BlobStored",
    "BrokerInfo",
    "DeviceStatus",
    "Digest",
    "EnrolRequest",
    "Enrolment",
    "ErrorBody",
    "FederationCreate",
    "FederationInfo",
    "KeyProof",
    "MetricsReport",
    "MetricsStored",
    "Neighbour",
    "Platform",
    "RoundAnnouncement",
    "RoundState",
    "Task",
    "TokenIssued",
    "TokenRotation",
    "UpdateAccepted",
    "UpdateRequest",
    "ValidationIssue",
    "mqtt_client_id",
    "negotiate",
    "quorum_updates",
    "round_topic",
    "status_topic",
    "task_topic",
]

PROTOCOL_VERSION = 3  # the newest this release speaks
PROTOCOL_VERSIONS = (1, 2, 3)  # every version this release's server answers in (docs/protocol.md, "Versions")
#: what a device sends a server answering it in version 3 or later, and not before (an earlier server refuses it):
#: ``MetricsReport``'s costs
COSTS_SINCE = 3
COSTS = ("round_s", "transfer_s", "peak_rss_mb")  # those fields
API_PREFIX = "/v1"
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_ID_RE = r"^[A-Za-z0-9_-]{1,64}$"

RoundState = Literal["open", "collecting", "closing", "published", "finished"]


MAX_ROUND = 1_000_000
MAX_COUNT = 2**53  # byte and sample counts: what JSON numbers carry exactly
MAX_CLIENTS = 100_000  # slots (devices) of one federation; pfl_edge.federation bounds its config by it too
# in-neighbours of a client in one round (DisPFL's paper uses 10): the federation config refuses a topology with
# more, and it keeps the largest Task (~180 KB of JSON) under the embedded broker's 256 KiB packet limit
MAX_NEIGHBOURS = 1_000
MAX_DEADLINE_S = 7 * 86_400  # a round's deadline
MAX_SECONDS = 1e9  # a duration a device measured (train_s), or a unix time (deadlines): finite and sane
_MAX_KP = 1_000  # personal blocks
_NAME = 256  # a label, profile, algorithm or credential
#: ``AggregationSettings``' and ``pfl_edge.aggregate.AggregationRule``'s (the simulator's) default: 3 before issue 49
DEFAULT_NORM_MULTIPLE = 1.0
_MAX_FLOAT = sys.float_info.max  # "finite": a bound NaN and Infinity fail, in pydantic and in JSON Schema
Digest = Annotated[str, Field(pattern=DIGEST_RE.pattern, description="sha256, 64 lowercase hex characters")]
#: a new federation's (or rotation's) shortest enrolment secret: 8 characters fell to guessing in 160 s (issue 49)
MIN_ENROL_SECRET = 16


class _Msg(BaseModel):
    # NaN/Inf are refused in every message: a metric or loss must be a number a database can keep
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _Answer(_Msg):
    # sent to a device: read tolerantly (fields added later ignored); ``_since_v2``: fields a version-1 device does
    # not know, left off the wire while unset (it refuses them, even as null)
    model_config = ConfigDict(extra="ignore", frozen=True, allow_inf_nan=False)
    _since_v2: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _wire(self, nxt: Any) -> dict[str, Any]:  # nxt: pydantic's SerializerFunctionWrapHandler
        return {k: v for k, v in nxt(self).items() if v is not None or k not in self._since_v2}


def negotiate(device: list[int] | None, server: tuple[int, ...] = PROTOCOL_VERSIONS) -> int | None:
    """The version a device that speaks ``device`` (None: an earlier release, which speaks 1) and a server that
    speaks ``server`` talk in: the highest both know; None if they share none."""
    common = set(device or [1]) & set(server)
    return max(common) if common else None


class AggregationSettings(_Msg):
    """How the server bounds and combines a round's updates (``pfl_edge.aggregate.AggregationRule``): each
    update's difference from the round's start model is clipped to ``max_update_norm`` (absolute) or, unset, to
    ``norm_multiple`` times the low median of the round's other updates' norms (both null: unclipped); then
    ``rule``. A device's sample count (the mean's weight) is clamped to what it declared at enrolment, to the share
    the server dealt its slot and to ``max_samples``; where devices bring their own data, to ``max_samples`` or
    else the config's ``samples_per_client``, and with neither every update counts 1 (server/services/updates.py)."""

    rule: Literal["mean", "clipped-mean", "median", "trimmed-mean"] = Field(default="mean", description=(
        "mean: weighted by counted samples; clipped-mean: equal weights; median, trimmed-mean: per coordinate"))
    max_update_norm: float | None = Field(default=None, gt=0, le=1e12,
                                          description="absolute L2 bound of an update's difference; null: relative")
    norm_multiple: float | None = Field(default=DEFAULT_NORM_MULTIPLE, ge=1, le=1e6, description=(
        "bound = this times the low median of the round's other updates' norms"))
    trim: float = Field(default=0.2, ge=0, lt=0.5, description="trimmed-mean: fraction dropped from each end")
    max_samples: int | None = Field(default=None, ge=1, le=2**31 - 1, description="cap of one update's weight")


class FederationCreate(_Msg):
    """A federation from a config. ``config`` holds the simulator's config keys (``pfl_edge.sim.SimConfig``:
    algorithm, model, dataset, partition, clients, rounds, local epochs, lr, kp, density, seed, the algorithm's
    ``options`` ...); ``clients`` is the number of devices the federation waits for before round 1."""

    id: str = Field(pattern=_ID_RE, description="federation id, 1-64 of A-Z a-z 0-9 _ -")
    enrol_secret: str = Field(min_length=MIN_ENROL_SECRET, max_length=256,
                              description="what a device must show to enrol (at least 16 characters)")
    config: dict[str, object] = config_field("FederationConfig keys: algorithm, model, dataset, ...")
    quorum: float = Field(default=1.0, gt=0, le=1, description="fraction of a round's devices that closes it early")
    deadline_s: float = Field(default=600.0, gt=0, le=MAX_DEADLINE_S, description=(
        "seconds a round collects at most; then it closes with whatever it has (at least min_updates)"))
    min_updates: int = Field(default=1, ge=1, le=MAX_CLIENTS,
                             description="a round past its deadline with fewer updates stays open")
    min_devices: int | None = Field(default=None, ge=1, le=MAX_CLIENTS, description=(
        "round 1 opens once this many devices have enrolled (null: all clients); later ones join free slots "
        "and take part from the round after they join"))
    profile_capacity: bool = Field(default=False, description=(
        "density and K_P from each device's profile instead of the config"))
    aggregation: AggregationSettings | None = Field(default=None, description=(
        f"null: the weighted mean, each update clipped to {DEFAULT_NORM_MULTIPLE:g}x the others' low median norm"))

    _config = field_validator("config")(bounded_config(MAX_CLIENTS))

    @model_validator(mode="after")
    def _within_clients(self) -> FederationCreate:
        clients = self.config.get("clients")
        if isinstance(clients, int) and not isinstance(clients, bool):
            for name in ("min_updates", "min_devices"):
                v = getattr(self, name)
                if v is not None and v > clients:
                    raise ValueError(f"{name} ({v}) is more than the config's clients ({clients})")
        return self


class FederationInfo(_Answer):
    """A federation as it is now (``GET /v1/federations/{fed}``); a device reads ``state`` to learn it ended."""

    id: str = Field(pattern=_ID_RE, description="federation id")
    config: dict[str, object] = Field(description="its config, every key filled in (FederationConfig)")
    round: int = Field(ge=0, le=MAX_ROUND, description="current round; 0 while enrolling, rounds when finished")
    state: RoundState = Field(description="state of that round")
    devices: int = Field(ge=0, le=MAX_CLIENTS, description="devices enrolled")
    quorum: float = Field(description="fraction of a round's devices that closes it early")
    # not bounded here: a row written before the bounds existed must still be readable
    deadline_s: float = Field(description="seconds a round collects at most")
    profile_capacity: bool = Field(description="density and K_P come from each device's profile")


class EnrolRequest(_Msg):
    """A device asks to join federation ``federation`` (``POST /v1/devices``; no token: the secret is the proof)."""

    federation: str = Field(pattern=_ID_RE, description="the federation to join")
    enrol_secret: str = Field(max_length=256, description="the federation's enrolment secret")
    profile: str = Field(max_length=64, description="<name> of device_profiles/profiles/<name>.toml, e.g. 'phone-mid'")
    name: str = Field(default="", max_length=64, description="a label for tables; not an identity")
    index: int | None = Field(default=None, ge=0, lt=MAX_CLIENTS, description=(
        "the slot (data partition) it asks for; null: the lowest free one; ignored where rounds sample"))
    nonce: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description=(
        "32 lowercase hex chosen and stored by the device before asking: the same nonce again (a retry whose "
        "answer was lost) gets the same device and slot back with a fresh token"))
    n_samples: int | None = Field(default=None, ge=1, le=2**31 - 1, strict=True, description=(
        "its training samples (a JSON integer: not \"100\", 1.0 or true); an update's weight counts as at most this"))
    platform: Platform | None = Field(default=None, description=(
        "what the device says it is (reported, not verified; devices of earlier releases send none)"))
    public_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", description=(
        "its Ed25519 public key (raw, hex; with nonce and proof): once kept, re-enrolling needs a proof by it"))
    proof: KeyProof | None = Field(default=None, description="signature of device_key.enrol_message by the key")
    protocols: list[Annotated[int, Field(ge=1, le=1000, strict=True)]] | None = Field(
        default=None, min_length=1, max_length=16, description=(
        "the protocol versions it speaks; null: 1 only (an earlier release)"))

    @model_validator(mode="after")
    def _key_whole(self) -> EnrolRequest:
        if (self.public_key is None) != (self.proof is None) or (self.public_key is not None and self.nonce is None):
            raise ValueError("public_key, proof and nonce go together: a key is proved, and names a nonce's device")
        return self


class Enrolment(_Answer):
    """The answer to an enrolment (201): who the device is now and what it needs to take part."""

    device_id: str = Field(pattern=_ID_RE, description="its id, in topics and its MQTT username")
    token: str = Field(max_length=_NAME, description="bearer token for every later HTTP call")
    index: int = Field(ge=0, lt=MAX_CLIENTS, description="its slot: data partition, seeds, topology position")
    federation: str = Field(pattern=_ID_RE, description="the federation joined")
    config: dict[str, object] = config_field("the federation's whole config (FederationConfig keys)")
    density: float = Field(gt=0, le=1, description="DisPFL: fraction of weights its sparse model keeps")
    kp: int = Field(ge=0, le=_MAX_KP, description="FedPer: its personal blocks, counted from the output end")
    broker_url: str = Field(max_length=2_048, description="mqtt://host:port or mqtts://host:port")
    mqtt_username: str = Field(max_length=_NAME, description="MQTT username (its device id)")
    mqtt_password: str = Field(max_length=4_096, description="MQTT password (or a broker's token)")
    round: int = Field(ge=0, le=MAX_ROUND, description=(
        "the federation's round now; a device enrolling in round r > 0 takes part from round r + 1"))
    init_digest: Digest = Field(description=(
        "sha256 of the initial model (FedPer: the base for its kp; DisPFL: the dense init)"))
    mqtt_client_id: str | None = Field(default=None, pattern=r"^pfl-[0-9a-f]{32}$", description=(
        "its MQTT client id, which no other device can guess (absent: mqtt_client_id(device_id))"))
    protocol: int | None = Field(default=None, ge=1, le=1000, description=(
        "the version the server answers this device in; absent: 1 (it said none)"))
    _since_v2 = ("mqtt_client_id", "protocol")
    init_model: Digest | None = Field(default=None, description=(
        "sha256 of the federation's whole initial model: every tensor, its personal blocks' seeded initial values "
        "included (the same for every device, not personal yet); a device that cannot build the model itself "
        "takes its personal blocks from here"))

    _config = field_validator("config")(bounded_config(MAX_CLIENTS))


class Neighbour(_Answer):
    """DisPFL: an in-neighbour of this round and its latest sparse model."""

    index: int = Field(ge=0, lt=MAX_CLIENTS, description="its slot")
    device_id: str = Field(pattern=_ID_RE, description="its device id (skip it if it is your own)")
    digest: Digest = Field(description="sha256 of its latest sparse model (GET /v1/blobs/{digest})")


class Task(_Answer):
    """Round ``round`` for one device. FedPer: load ``base`` (the server's latest average), train, upload the
    base part. DisPFL: average ``neighbours``' latest sparse models with its own, train, prune and regrow,
    upload its sparse model. ``final``: no training; evaluate on ``base`` and report (FedPer's last step)."""

    federation: str = Field(pattern=_ID_RE, description="federation id")
    round: int = Field(ge=0, le=MAX_ROUND, description="the round this task is for (>= 1)")
    algorithm: str = Field(max_length=_NAME, description="an algorithm that runs on devices (pfl-edge list)")
    base: Digest | None = Field(default=None, description=(
        "FedPer/FedAvg: sha256 of the base part for this device's kp (its personal tensors left out); "
        "DisPFL: null"))
    neighbours: list[Neighbour] = Field(default_factory=list, max_length=MAX_NEIGHBOURS, description=(
        "DisPFL: its in-neighbours of this round that have a model; FedPer: empty"))
    deadline: float = Field(ge=0, le=1e11, description="unix time (seconds, UTC) the round may close at")
    final: bool = Field(default=False, description=(
        "true: the federation's last step: no training, no update; evaluate on base, report round's metrics"))
    protocol: int | None = Field(default=None, ge=1, le=1000, description="the version it is sent in (absent: 1)")
    _since_v2 = ("protocol",)


class RoundAnnouncement(_Answer):
    """The federation's round and state (retained on ``pfl/<fed>/round``): a doorbell, never an instruction."""

    federation: str = Field(pattern=_ID_RE, description="federation id")
    round: int = Field(ge=0, le=MAX_ROUND, description="current round")
    state: RoundState = Field(description="state of that round")
    base: Digest | None = Field(default=None, description=(
        "FedPer/FedAvg: sha256 of the server's whole model (every tensor, personal ones too): the model round "
        "`round` started from while collecting/closing (round 0 and 1: the initial model), the last round's "
        "result once finished. Not a device's base (that is Task.base). DisPFL: null"))
    deadline: float | None = Field(default=None, ge=0, le=1e11, description=(
        "unix time the current round may close at; null before round 1"))


class BrokerInfo(_Answer):
    """The MQTT broker as devices reach it now (the operator may have moved it), and fresh credentials for it."""

    broker_url: str = Field(max_length=2_048, description="mqtt://host:port or mqtts://host:port")
    mqtt_password: str | None = Field(None, max_length=4_096, description="token brokers: a fresh MQTT password")


class DeviceStatus(_Msg):
    """A device's presence (retained on its status topic): ``online`` on connect, ``offline`` as its will."""

    device_id: str = Field(pattern=_ID_RE, description="the publishing device's id (must match the topic)")
    state: Literal["online", "offline"] = Field(description="online on connect; offline as its will")


class UpdateRequest(_Msg):
    """A device's result of round ``t``: the digest of the blob it uploaded (its base part, or its sparse
    model), its sample count (FedPer's weight) and what it measured."""

    digest: Digest = Field(description="sha256 of the payload it PUT first")
    n_samples: int = Field(ge=1, le=2**31 - 1, strict=True,
                           description="training samples (the averaging weight; a JSON integer, never a string, a "
                                       "float or a boolean)")
    train_loss: float | None = Field(default=None, ge=0, le=_MAX_FLOAT,
                                     description="mean training cross-entropy of the round")
    train_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS, description="seconds spent training")
    bytes_down: int = Field(default=0, ge=0, le=MAX_COUNT, description="bytes it downloaded for this round")


class UpdateAccepted(_Answer):
    """The answer to an update."""

    round: int = Field(ge=0, le=MAX_ROUND, description="the update's round")
    accepted: bool = Field(description="false: this very update had been accepted already (a retry)")
    updates: int = Field(ge=0, le=MAX_CLIENTS, description="updates accepted so far this round")


class MetricsReport(_Msg):
    """Evaluation of the model a device deploys after round ``t`` on its own test data."""

    accuracy: float = Field(ge=0, le=1, description="fraction of its test samples classified right")
    # no bound but finiteness: a diverged model's loss is still worth reporting
    loss: float = Field(ge=0, le=_MAX_FLOAT, description="mean cross-entropy (natural log) on its test samples")
    n_test: int = Field(ge=0, le=2**31 - 1, description="its test samples")
    bytes_up: int = Field(default=0, ge=0, le=MAX_COUNT, description="bytes it uploaded in round t")
    bytes_down: int = Field(default=0, ge=0, le=MAX_COUNT, description="bytes it downloaded in round t")
    step_ms: float | None = Field(default=None, ge=0, le=MAX_SECONDS, description="ms per training step")
    train_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS, description="seconds it trained in round t")
    dropped: int | None = Field(default=None, ge=0, le=MAX_NEIGHBOURS, description="DisPFL: neighbours' models it "
                                "left out of its average in round t (non-finite, or past neighbour_bound x its own)")
    # what the round cost the device, its own word (version 3; shown per device class, never acted on)
    round_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS, description="version 3: wall seconds of its "
                                  "round t, from its task to its update accepted (training, transfers, waits)")
    transfer_s: float | None = Field(default=None, ge=0, le=MAX_SECONDS, description="version 3: seconds of round "
                                     "t spent moving payloads (downloads and the upload)")
    peak_rss_mb: float | None = Field(default=None, ge=0, le=2**24, description="version 3: the device process's "
                                      "peak resident memory so far (MiB, at most 16 TiB; VmHWM on Linux)")


class TokenIssued(_Answer):
    """A device's new token (the one it held before is refused from now on) and when it expires."""

    device_id: str = Field(pattern=_ID_RE, description="the device the token is for")
    token: str = Field(max_length=_NAME, description="bearer token for every later HTTP call")
    expires: float = Field(ge=0, le=1e11, description="unix time (seconds, UTC) the token stops working")


class MetricsStored(_Answer):
    """The answer to a metrics report (an upsert: a second report of the round replaces the first)."""

    round: int = Field(ge=0, le=MAX_ROUND, description="the round the metrics were stored for")
    device_id: str = Field(pattern=_ID_RE, description="the reporting device")


class BlobStored(_Answer):
    """The answer to ``PUT /v1/blobs/{sha256}``: 201 if new for this device, 200 if it had sent these bytes."""

    digest: Digest = Field(description="sha256 of the stored bytes (the path's)")
    size: int = Field(ge=0, le=MAX_COUNT, description="bytes stored")
    created: bool = Field(description="false: this device had already sent these bytes")


class ValidationIssue(_Answer):
    """One reason a request was refused by validation (at most 16 are listed, then one of type 'truncated')."""

    loc: list[str | int] = Field(max_length=8, description="where: e.g. ['body', 'n_samples'], ['path', 't']")
    msg: str = Field(max_length=200, description="what was wrong, never the input itself")
    type: str = Field(max_length=200, description="pydantic's error type, e.g. 'less_than_equal'")


class ErrorBody(_Answer):
    """Every refusal's body (4xx, 5xx): one message, or (422 from validation) a list of issues."""

    detail: str | list[ValidationIssue] = Field(description="what was wrong and what is valid")
