"""The checks that let a secure round name the device that forged one of its messages (docs/secagg.md, "What one
device can do"): the dealer's per-holder commitments, a holder's complaint about a pair that does not open, and
the consistency of a secret's shares.

- **Commitments**: a dealer sends, beside each sealed pair, ``commitment`` of each of the two shares in it (a
  SHA-256 bound to the round, the dealer, the holder and the secret's kind). The server holds them before any
  share is revealed, and the holder checks the shares it opens against them: a share revealed at unmasking that
  is not the committed one names its revealer.
- **Complaints**: a holder whose pair does not open, is not addressed to it, or holds shares other than the
  committed ones sends its ``c`` secret key (a key of this round only, for sealing) with the names of the dealers
  it accuses; the server opens the pair itself (``judge``) and names the dealer, or the holder if the pair is
  good. Either way the one named is left out of the round as if it had dropped out after sharing.
- **Consistency**: with more shares of a secret than the threshold, they must lie on one polynomial; every share
  was the dealer's committed one, so a secret whose shares do not (or that does not match the key its dealer
  advertised) names its dealer.

A name is never guessed: every check that names a device is one only that device could have failed.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from ..errors import CodecError
from .shamir import SHARE_BYTES, evaluator

if TYPE_CHECKING:
    from .crypto import KeyPair
    from .protocol import Advert, Params

__all__ = ["COMMIT_BYTES", "Forged", "commitment", "consistent", "judge", "matches", "open_pair", "pair_info",
           "pair_key"]

COMMIT_BYTES = 32  # one commitment; a pair's two travel as 64 bytes, of b's share then of the key's
_HDR = 8  # a sealed pair's plaintext: sender and receiver ids (4 + 4 bytes), then two shares


class Forged(CodecError):
    """A message of a secure round failed a check only its sender could fail: ``culprit`` (a slot) is named and
    left out of the round (docs/secagg.md)."""

    def __init__(self, culprit: int, why: str) -> None:
        super().__init__(f"device {culprit}: {why}")
        self.culprit = culprit
        self.why = why


def pair_info(params: Params, kind: bytes) -> bytes:
    """What a pairwise key of ``kind`` (b"c": sealing, b"s": masks) is bound to: the round."""
    return b"pfl-secagg:" + kind + b":" + params.round_id


def pair_key(params: Params, mine: KeyPair, their_c_public: bytes) -> bytes:
    """The key a pair of shares is sealed under between two clients: their ``c`` keys' agreement."""
    return mine.agree(their_c_public, pair_info(params, b"c"))


def commitment(params: Params, kind: str, dealer: int, holder: int, share: bytes) -> bytes:
    """The dealer's commitment to the share of its secret ``kind`` ("b": the self-mask seed, "s": the mask key)
    that ``holder`` holds: SHA-256 of the context and the share (a share is a uniform field element while fewer
    than the threshold are known, so its hash says nothing of it)."""
    if kind not in ("b", "s"):
        raise CodecError(f"a share is of b or s, not {kind!r}")
    return hashlib.sha256(b"pfl-secagg-commit:" + kind.encode() + b":" + params.round_id + dealer.to_bytes(4, "big")
                          + holder.to_bytes(4, "big") + share).digest()


def matches(params: Params, kind: str, dealer: int, holder: int, share: bytes, commits: bytes) -> bool:
    """Whether ``share`` is the one the dealer committed to in ``commits`` (its pair's 64 bytes)."""
    if len(commits) != 2 * COMMIT_BYTES:
        return False
    at = 0 if kind == "b" else COMMIT_BYTES
    return hmac.compare_digest(commitment(params, kind, dealer, holder, share), commits[at:at + COMMIT_BYTES])


def open_pair(params: Params, key: bytes, dealer: int, holder: int, box: bytes,
              commits: bytes) -> tuple[bytes, bytes]:
    """The pair of shares (of b, of the key) ``dealer`` sealed for ``holder``, opened with the pair's ``key``
    and checked against the dealer's ``commits``; CodecError if it does not open, is not addressed to this pair,
    or holds shares other than the committed ones (the dealer's doing, once the key is the holder's)."""
    from .crypto import open_sealed

    aad = b"pfl-secagg:" + params.round_id + dealer.to_bytes(4, "big") + holder.to_bytes(4, "big")
    body = open_sealed(key, box, aad)
    if len(body) != _HDR + 2 * SHARE_BYTES or body[:_HDR] != dealer.to_bytes(4, "big") + holder.to_bytes(4, "big"):
        raise CodecError(f"the pair from {dealer} is not addressed to {holder}")
    sb, ss = body[_HDR:_HDR + SHARE_BYTES], body[_HDR + SHARE_BYTES:]
    if not (matches(params, "b", dealer, holder, sb, commits) and matches(params, "s", dealer, holder, ss, commits)):
        raise CodecError(f"the pair from {dealer} holds shares other than the ones it committed to")
    return sb, ss


def judge(params: Params, holder: Advert, c_secret: bytes, dealer: Advert, box: bytes, commits: bytes) -> int:
    """Who is at fault when ``holder`` says ``dealer``'s pair for it is bad, given the holder's ``c`` secret key:
    the holder if that key is not the one it advertised or the pair opens and checks (a false complaint), else
    the dealer."""
    from .crypto import KeyPair

    if len(c_secret) != 32:
        return holder.cid
    mine = KeyPair(c_secret)
    if not hmac.compare_digest(mine.public, holder.c_public):
        return holder.cid
    try:
        key = pair_key(params, mine, dealer.c_public)
        open_pair(params, key, dealer.cid, holder.cid, box, commits)
    except CodecError:
        return dealer.cid
    return holder.cid


def consistent(shares: dict[int, bytes], threshold: int) -> bool:
    """Whether every one of ``shares`` ({x: share}) lies on the polynomial of degree threshold - 1 through the
    first ``threshold`` of them (with no more than ``threshold`` shares there is nothing to check)."""
    points = sorted((x, int.from_bytes(y, "big")) for x, y in shares.items())
    if len(points) <= threshold:
        return True
    at = evaluator(points[:threshold])
    return all(at(x) == y for x, y in points[threshold:])
