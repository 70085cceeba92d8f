"""SecAgg+ on the wire (docs/protocol.md, "Secure aggregation"; docs/codec.md, "The masked payload"): the messages
of its steps, defined once for the server and the device, and the masked input's binary payload.

A secure round is a collecting round in four steps (``SecAggStep.step``), each ended by the server (every
device still in it has sent, or the step's deadline passed):

- ``advertise``: a device that trained sends its two public keys (``SecAggKeys``);
- ``share``: the server has fixed the graph; a device reads its neighbours' keys and sends one sealed pair of
  shares for each, with its commitments to the two shares (``SecAggShares``);
- ``input``: a device reads the pairs sealed for it (with their dealers' commitments); if one does not open or
  holds shares other than the committed ones it sends a complaint first (``SecAggComplaint``: its sealing key of
  this round and the dealers it accuses; the server opens those pairs itself and names the one at fault), then
  uploads its masked input (``encode_masked``) as its round's update (``PUT /v1/blobs``,
  ``POST /v1/rounds/{t}/updates``);
- ``unmask``: the survivors and the dropouts are fixed; each survivor sends, per neighbour, the share the server
  asks of it (``SecAggUnmask``).

Binary values travel as lowercase hex; clients are named by their slot (``index``). This module imports no
cryptography: the server's HTTP layer and the schema generator read it without it.
"""

from __future__ import annotations

import struct
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..errors import CodecError

__all__ = [
    "COMMITS_BYTES",
    "MASKED_MAGIC",
    "SEALED_BYTES",
    "SecAggComplaint",
    "SecAggKeys",
    "SecAggNeighbour",
    "SecAggParams",
    "SecAggSealed",
    "SecAggShare",
    "SecAggShares",
    "SecAggStep",
    "SecAggUnmask",
    "Step",
    "decode_masked",
    "encode_masked",
    "round_id",
]

MASKED_MAGIC = b"PFLM"
_MASKED = struct.Struct("<4sBII")  # magic, format version, round, count of uint32 values
_MASKED_VERSION = 1
SEALED_BYTES = 12 + 8 + 2 * 66 + 16  # nonce, (sender, receiver, share of b, share of s), GCM tag
COMMITS_BYTES = 2 * 32  # SHA-256 commitments to a pair's share of b, then of s (pfl_edge.secagg.verify)
_MAX_SLOTS = 100_000  # pfl_edge.protocol.MAX_CLIENTS
_MAX_DEGREE = 10_000  # SecAggConfig's bound

Step = Literal["advertise", "share", "input", "unmask", "done"]
Key = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="an X25519 public key, 32 bytes in hex")]
Sealed = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * SEALED_BYTES}}}$",
                              description=f"an AES-GCM sealed pair of shares, {SEALED_BYTES} bytes in hex")]
Commits = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * COMMITS_BYTES}}}$",
                               description=f"the dealer's commitments to the pair's two shares, {COMMITS_BYTES} "
                                           "bytes in hex")]
Share = Annotated[str, Field(pattern=r"^[0-9a-f]{132}$", description="a Shamir share, 66 bytes in hex")]
Slot = Annotated[int, Field(ge=0, lt=_MAX_SLOTS, description="a device's slot (its enrolment index)")]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SecAggKeys(_Msg):
    """Step ``advertise``: a device's two public keys (``c``: its shares are sealed under it; ``s``: its masks)."""

    c_public: Key = Field(description="the key its neighbours seal its shares under (X25519, hex)")
    s_public: Key = Field(description="the key of its pairwise masks (X25519, hex)")


class SecAggSealed(_Msg):
    """One sealed pair of shares and its dealer's commitments to them, and the other end of it (the receiver in
    a request, the sender in an answer)."""

    index: Slot
    box: Sealed
    commits: Commits


class SecAggComplaint(_Msg):
    """Step ``input``, before the device's masked input: the pairs of ``accused`` did not open for it or held
    shares other than their dealers committed to. ``c_secret``: its share-sealing secret key of this round (used
    for nothing else: the server opens the accused pairs with it and names the dealer, or this device if they
    open and check)."""

    c_secret: Key = Field(description="the X25519 secret key whose public half it advertised as c_public (hex)")
    accused: list[Slot] = Field(min_length=1, max_length=_MAX_DEGREE, description="the dealers it accuses")


class SecAggShares(_Msg):
    """Step ``share``: one sealed pair for each of the device's neighbours, no more, no fewer."""

    shares: list[SecAggSealed] = Field(max_length=_MAX_DEGREE, description="by receiver's slot")


class SecAggShare(_Msg):
    """One revealed share: of ``about``'s self-mask seed (``b``: it survived) or its mask key (``s``: it dropped)."""

    about: Slot
    kind: Literal["b", "s"] = Field(description="b: of a survivor's self-mask seed; s: of a dropout's mask key")
    share: Share


class SecAggUnmask(_Msg):
    """Step ``unmask``: the shares the server asked of this survivor (``SecAggStep.survivors``/``dropped``)."""

    shares: list[SecAggShare] = Field(max_length=_MAX_DEGREE, description="one per neighbour named in the request")


class SecAggNeighbour(_Msg):
    """A neighbour in the round's graph and its keys."""

    index: Slot
    c_public: Key = Field(description="its share-sealing key")
    s_public: Key = Field(description="its mask key")


class SecAggParams(_Msg):
    """The round's SecAgg+ parameters as the server fixed them at the end of ``advertise``."""

    degree: int = Field(ge=2, le=_MAX_DEGREE, description="neighbours per device (even)")
    threshold: int = Field(ge=2, le=_MAX_DEGREE, description="shares that recover a secret (more than degree / 2)")
    size: int = Field(ge=1, le=1 << 28, description="the masked vector's length: the base's float coordinates")


class SecAggStep(_Msg):
    """``GET /v1/rounds/{t}/secagg``: where the round's secure aggregation stands, and what this device needs of
    it now: its neighbours (from ``share`` on), the pairs sealed for it (from ``input`` on), the survivors and
    dropouts (``unmask``). ``done``: the round has left its collecting state."""

    round: int = Field(ge=1, le=1_000_000, description="the round")
    step: Step = Field(description="advertise, share, input, unmask, or done")
    deadline: float = Field(ge=0, le=1e11, description="unix time the step may end at")
    params: SecAggParams | None = Field(default=None, description="null during advertise")
    neighbours: list[SecAggNeighbour] = Field(default_factory=list, max_length=_MAX_DEGREE,
                                              description="this device's neighbours (empty if it is not in the graph)")
    inbox: list[SecAggSealed] = Field(default_factory=list, max_length=_MAX_DEGREE,
                                      description="the pairs its neighbours sealed for it, by sender")
    survivors: list[Slot] = Field(default_factory=list, max_length=_MAX_SLOTS,
                                  description="unmask: the devices whose masked input the server accepted")
    dropped: list[Slot] = Field(default_factory=list, max_length=_MAX_SLOTS,
                                description="unmask: the devices that shared their keys and sent no input, or "
                                            "were named for a forged message")


def round_id(federation: str, t: int) -> bytes:
    """What every key and seal of round ``t`` is bound to: a share of one round opens in no other."""
    return f"{federation}:{t}".encode()


def encode_masked(y: np.ndarray, t: int) -> bytes:
    """The masked input's payload: ``PFLM``, version 1, the round and the count (little-endian uint32 each but
    the version byte), then the values as little-endian uint32."""
    if y.dtype != np.uint32 or y.ndim != 1:
        raise CodecError("a masked input is a 1-d uint32 vector")
    return _MASKED.pack(MASKED_MAGIC, _MASKED_VERSION, t, y.size) + y.astype("<u4").tobytes()


def decode_masked(payload: bytes, size: int) -> tuple[int, np.ndarray]:
    """``(round, values)`` of a masked payload of exactly ``size`` values; CodecError for anything else (checked
    from the fixed header and the length before any allocation)."""
    if len(payload) < _MASKED.size:
        raise CodecError(f"a masked payload is at least {_MASKED.size} bytes, got {len(payload)}")
    magic, version, t, n = _MASKED.unpack_from(payload)
    if magic != MASKED_MAGIC or version != _MASKED_VERSION:
        raise CodecError(f"not a masked payload (magic {magic!r}, version {version}); expected {MASKED_MAGIC!r} "
                         f"version {_MASKED_VERSION}")
    if n != size or len(payload) != _MASKED.size + 4 * size:
        raise CodecError(f"a masked payload of this round holds {size} values ({_MASKED.size + 4 * size} bytes); "
                         f"this one says {n} in {len(payload)} bytes")
    return t, np.frombuffer(payload, dtype="<u4", offset=_MASKED.size).astype(np.uint32)
