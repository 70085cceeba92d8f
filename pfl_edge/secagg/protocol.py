"""SecAgg+ (Bell, Bonawitz, Gascón, Lepoint, Raykova, CCS 2020; after Bonawitz et al., CCS 2017): a server learns
the sum of the round's integer vectors and nothing else of any one of them, and the round survives devices that
drop out after they shared their keys.

Four steps, each a message from every client still in the round and the server's answer (``Client``, ``Server``;
docs/secagg.md):

0. **Advertise**: a client makes two X25519 key pairs, ``c`` (to encrypt shares) and ``s`` (its pairwise masks),
   and sends both public keys. The server fixes the round's graph (``graph``: a Harary graph of even degree k over
   the advertisers in an order drawn from the round's public seed) and gives each client its neighbours' keys.
1. **Share keys**: a client draws a self-mask seed b, splits b and its ``s`` secret key into Shamir shares
   (threshold t) for its neighbours, and sends each neighbour's pair sealed (AES-GCM under the ``c`` agreement,
   bound to the round and the pair) through the server.
2. **Masked input**: y_i = x_i + PRG(b_i) + sum_{j in N(i), i<j} PRG(s_ij) - sum_{j in N(i), j<i} PRG(s_ij),
   mod 2^32 (``x_i``: the quantized vector). The clients whose y arrive are the survivors.
3. **Unmask**: the server names survivors and dropouts; each survivor sends, per neighbour, the share of its b if
   it survived, of its ``s`` key if it dropped (never both: a client refuses a request that would reveal both, or
   that names fewer than t survivors). With t shares of each, the server removes the survivors' self-masks and
   the dropouts' pairwise masks; the survivors' pairwise masks cancel in the sum.

A client sees only its neighbours' keys and shares; the server sees uniform vectors (each y_i carries PRG(b_i),
which it can remove only with t shares, and it asks for b's shares only of survivors), and the sum.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import CodecError, ConfigError
from .crypto import KeyPair, prg, seal
from .shamir import combine, split
from .verify import Forged, commitment, consistent, judge, matches, open_pair, pair_key
from .verify import pair_info as _pair_info

__all__ = ["Advert", "Client", "Dealt", "Params", "Server", "dequantize_sum", "graph", "groups", "quantize"]

Dealt = tuple[bytes, bytes]  # a sealed pair and the dealer's commitments to its two shares (64 bytes)


@dataclass(frozen=True)
class Params:
    """A round's parameters: ``degree`` k (neighbours per client; n - 1 or more: everyone, the 2017 protocol),
    ``threshold`` t (shares that recover a secret: more than k / 2, so that the server cannot gather t shares of
    both a client's b and its key), ``size`` (the vector's length), ``round_id`` (bound into every key and seal)."""

    degree: int
    threshold: int
    size: int
    round_id: bytes = b""

    def __post_init__(self) -> None:
        if self.degree < 2 or self.degree % 2:
            raise ConfigError(f"the graph's degree must be even and >= 2, got {self.degree}")
        if not self.degree // 2 < self.threshold <= self.degree:
            raise ConfigError(f"threshold must be in ({self.degree // 2}, {self.degree}], got {self.threshold}")
        if not 0 < self.size <= 1 << 28:
            raise ConfigError(f"vector size must be in [1, 2^28], got {self.size}")


def graph(ids: list[int], degree: int, seed: int) -> dict[int, frozenset[int]]:
    """Each id's neighbours: the Harary graph H(k, n) (each node joined to the k / 2 nearest on either side of a
    ring) over ``ids`` in an order drawn from ``seed`` (public: the round's); everyone where k >= n - 1."""
    order = sorted(ids)
    if degree >= len(order) - 1:
        return {i: frozenset(j for j in order if j != i) for i in order}
    random.Random(seed).shuffle(order)
    n, half = len(order), degree // 2
    return {order[p]: frozenset(order[(p + d) % n] for d in range(-half, half + 1) if d) for p in range(n)}


def groups(ids: list[int], min_group: int, seed: int) -> list[list[int]]:
    """Grouped secure aggregation's groups (each one SecAgg+ round of its own, its sum unmasked alone): ``ids``
    in an order drawn from ``seed`` (public: the round's), cut into as many groups of at least ``min_group`` as
    they fill, of sizes differing by at most one, each sorted; one group of everyone where ``min_group`` is 0 or
    fewer than two groups fill."""
    order = sorted(ids)
    g = len(order) // min_group if min_group > 0 else 1
    if g <= 1:
        return [order]
    random.Random(seed).shuffle(order)
    size, extra = divmod(len(order), g)
    out, at = [], 0
    for i in range(g):
        n = size + (i < extra)
        out.append(sorted(order[at:at + n]))
        at += n
    return out


def quantize(x: np.ndarray, bound: float, bits: int) -> np.ndarray:
    """``x`` clipped to [-bound, bound] and mapped to integers in [0, 2^bits - 1] (rounded to nearest), uint32."""
    if not 1 <= bits <= 31:
        raise ConfigError(f"quantization bits must be in [1, 31], got {bits}")
    levels = (1 << bits) - 1
    q = np.rint((np.clip(x.astype(np.float64), -bound, bound) + bound) / (2 * bound) * levels)
    return q.astype(np.uint32)


def dequantize_sum(total: np.ndarray, count: int, bound: float, bits: int) -> np.ndarray:
    """The float64 sum of ``count`` vectors from the sum of their quantizations (exact while count x (2^bits - 1)
    < 2^32: no wrap)."""
    levels = (1 << bits) - 1
    if count * levels >= 1 << 32:
        raise ConfigError(f"{count} vectors of {bits} bits wrap around 2^32: use at most "
                          f"{32 - int(np.ceil(np.log2(count + 1)))} bits")
    return total.astype(np.float64) * (2 * bound / levels) - count * bound


@dataclass(frozen=True)
class Advert:
    """Step 0's message: a client's two public keys."""

    cid: int
    c_public: bytes
    s_public: bytes


def _aad(params: Params, sender: int, receiver: int) -> bytes:
    return b"pfl-secagg:" + params.round_id + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")




@dataclass
class Client:
    """One client's side of a round (its secrets never leave it but as Shamir shares). ``cid`` >= 0."""

    cid: int
    params: Params
    c: KeyPair = field(default_factory=KeyPair)
    s: KeyPair = field(default_factory=KeyPair)
    b: bytes = field(default_factory=lambda: KeyPair().secret)  # 32 random bytes
    neighbours: dict[int, Advert] = field(default_factory=dict)
    held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # neighbour -> (share of b, share of s)
    revealed: dict[int, str] = field(default_factory=dict)
    accused: set[int] = field(default_factory=set)  # neighbours whose pair for it did not open or check

    def advertise(self) -> Advert:
        return Advert(self.cid, self.c.public, self.s.public)

    def share_keys(self, neighbours: Mapping[int, Advert]) -> dict[int, Dealt]:
        """Step 1: for each neighbour, by its id, the sealed pair of shares (of b, of the ``s`` key) and the
        commitments to them (``verify.commitment``: the server holds them before any share is revealed)."""
        if len(neighbours) < self.params.threshold or self.cid in neighbours:
            raise ConfigError(f"{len(neighbours)} neighbours: fewer than the threshold {self.params.threshold}")
        self.neighbours = dict(neighbours)
        xs = [j + 1 for j in sorted(neighbours)]
        sb = split(self.b, xs, self.params.threshold)
        ss = split(self.s.secret, xs, self.params.threshold)
        out = {}
        for j, adv in sorted(neighbours.items()):
            key = pair_key(self.params, self.c, adv.c_public)
            body = self.cid.to_bytes(4, "big") + j.to_bytes(4, "big") + sb[j + 1] + ss[j + 1]
            commits = (commitment(self.params, "b", self.cid, j, sb[j + 1])
                       + commitment(self.params, "s", self.cid, j, ss[j + 1]))
            out[j] = (seal(key, body, _aad(self.params, self.cid, j)), commits)
        return out

    def masked_input(self, x: np.ndarray, sealed: Mapping[int, Dealt]) -> np.ndarray:
        """Step 2: y = x + the masks (mod 2^32), after opening the pairs its neighbours sealed for it. A pair
        that does not open or holds shares other than its dealer committed to is not used (its dealer goes in
        ``accused``, for the client to ``complain`` about): the client masks only with the neighbours whose pairs
        it holds."""
        if x.dtype != np.uint32 or x.shape != (self.params.size,):
            raise ConfigError(f"the input must be uint32 of shape ({self.params.size},)")
        for j, (box, commits) in sealed.items():
            adv = self.neighbours.get(j)
            if adv is None:
                raise ConfigError(f"a share from {j}, not a neighbour")
            try:
                self.held[j] = open_pair(self.params, pair_key(self.params, self.c, adv.c_public), j, self.cid, box,
                                         commits)
            except CodecError:
                self.accused.add(j)
        y = x + prg(self.b, self.params.size)  # uint32 arithmetic wraps mod 2^32
        # pairwise masks with the neighbours whose pairs it holds (a neighbour that dropped before sharing could
        # never have its mask removed); the server knows them: it routed their pairs and heard the complaints
        for j in sorted(self.held):
            adv = self.neighbours[j]
            m = prg(self.s.agree(adv.s_public, _pair_info(self.params, b"s")), self.params.size)
            y = y + m if self.cid < j else y - m
        return y

    def complaint(self) -> tuple[bytes, list[int]]:
        """What it sends when ``accused`` is not empty: its ``c`` secret key (this round's, for sealing only: the
        server opens the accused pairs itself, ``verify.judge``) and the dealers it accuses."""
        return self.c.secret, sorted(self.accused)

    def unmask(self, survivors: frozenset[int], dropped: frozenset[int]) -> dict[int, tuple[str, bytes]]:
        """Step 3: per neighbour whose share it holds, ("b", share) if it survived, ("s", share) if it dropped."""
        if survivors & dropped or len(survivors) < self.params.threshold or self.cid not in survivors:
            raise ConfigError("an unmask request naming a client both ways, fewer survivors than the threshold, "
                              "or not this client")
        out: dict[int, tuple[str, bytes]] = {}
        for j, (share_b, share_s) in self.held.items():
            kind = "b" if j in survivors else "s" if j in dropped else None
            if kind is None:
                continue
            if self.revealed.setdefault(j, kind) != kind:  # never both of one client, whatever is asked later
                raise ConfigError(f"client {j}: its other secret's share was revealed already")
            out[j] = (kind, share_b if kind == "b" else share_s)
        return out


@dataclass
class Server:
    """The server's side: it routes, records who survives each step, judges complaints, checks every revealed
    share against its dealer's commitment, and unmasks the sum. ``seed``: the round's public seed (the graph).
    A check only one device could fail names it (``verify.Forged``, its ``culprit``)."""

    params: Params
    seed: int
    adverts: dict[int, Advert] = field(default_factory=dict)
    edges: dict[int, frozenset[int]] = field(default_factory=dict)
    boxes: dict[int, dict[int, Dealt]] = field(default_factory=dict)  # holder -> dealer -> (sealed pair, commits)
    sharers: set[int] = field(default_factory=set)
    unused: dict[int, set[int]] = field(default_factory=dict)  # holder -> dealers it complained of: no mask between
    excluded: set[int] = field(default_factory=set)  # named by a complaint: out of the round as if dropped
    survivors: set[int] = field(default_factory=set)  # whose y came: summed as it comes, never held
    summed: np.ndarray | None = None
    shares: dict[int, dict[str, dict[int, bytes]]] = field(default_factory=dict)  # about j -> kind -> x -> share

    def advertised(self, adverts: list[Advert]) -> dict[int, dict[int, Advert]]:
        """Step 0's answer: each advertiser's neighbours' keys."""
        self.adverts = {a.cid: a for a in adverts}
        self.edges = graph(list(self.adverts), self.params.degree, self.seed)
        return {i: {j: self.adverts[j] for j in nb} for i, nb in self.edges.items()}

    def route(self, sender: int, sealed: Mapping[int, Dealt]) -> None:
        """Step 1: a client's sealed pairs and commitments, one for each neighbour of it."""
        if sender not in self.edges or set(sealed) != set(self.edges[sender]):
            raise ConfigError(f"client {sender}'s shares are not one for each of its neighbours")
        for j, dealt in sealed.items():
            self.boxes.setdefault(j, {})[sender] = dealt
        self.sharers.add(sender)

    def inbox(self, cid: int) -> dict[int, Dealt]:
        """The sealed pairs for ``cid`` from neighbours that shared (step 2's input)."""
        return dict(self.boxes.get(cid, {}))

    def complain(self, cid: int, c_secret: bytes, accused: list[int]) -> set[int]:
        """Step 2: ``cid`` says the pairs of ``accused`` do not open or check (``Client.complaint``); before
        any input of the one at fault is taken. Returns who is named (``verify.judge``): each accused dealer at
        fault, or ``cid`` itself for a false complaint; they leave the round as dropouts."""
        got = self.boxes.get(cid, {})
        if not accused or any(j not in got for j in accused) or len(set(accused)) != len(accused):
            raise ConfigError(f"client {cid} complains of {accused}: not dealers of pairs it was sent")
        named = {judge(self.params, self.adverts[cid], c_secret, self.adverts[j], *got[j]) for j in accused}
        if named & self.survivors:
            raise ConfigError(f"complaint of {cid}: {sorted(named & self.survivors)} already sent an input")
        self.unused.setdefault(cid, set()).update(accused)
        self.excluded |= named
        return named

    def receive(self, cid: int, y: np.ndarray) -> None:
        if cid not in self.sharers or y.dtype != np.uint32 or y.shape != (self.params.size,):
            raise ConfigError(f"client {cid}: not a sharer, or not a uint32 vector of the round's size")
        if cid in self.survivors or cid in self.excluded:
            raise ConfigError(f"client {cid}: its masked input came already, or it is out of the round")
        self.survivors.add(cid)
        self.summed = y.copy() if self.summed is None else self.summed + y  # wraps mod 2^32

    def unmask_request(self) -> tuple[frozenset[int], frozenset[int]]:
        """Step 3's question: the survivors (their y arrived) and the dropouts (shared keys, sent no y, or were
        named by a complaint)."""
        survivors = frozenset(self.survivors)
        return survivors, frozenset(self.sharers - survivors)

    def asked(self, cid: int) -> dict[int, str]:
        """What the unmask step asks of survivor ``cid``: per neighbour whose pair it holds, "b" if it survived,
        "s" if it dropped."""
        survivors, dropped = self.unmask_request()
        held = set(self.boxes.get(cid, {})) - self.unused.get(cid, set())
        return {j: "b" if j in survivors else "s" for j in sorted(held & (survivors | dropped))}

    def collect(self, cid: int, shares: Mapping[int, tuple[str, bytes]]) -> None:
        """Step 3: survivor ``cid``'s revealed shares, each checked against its dealer's commitment: the ones
        that match are kept, then Forged names ``cid`` if any did not."""
        bad = []
        for j, (kind, share) in shares.items():
            dealt = self.boxes.get(cid, {}).get(j)
            if dealt is None or kind not in ("b", "s"):
                raise ConfigError(f"client {cid} sent a share about {j}, not its neighbour")
            if matches(self.params, kind, j, cid, share, dealt[1]):
                self.shares.setdefault(j, {}).setdefault(kind, {})[cid + 1] = share
            else:
                bad.append(j)
        if bad:
            raise Forged(cid, f"its shares of {bad} are not the ones their dealers committed to")

    def _secret(self, j: int, kind: str) -> bytes:
        """``j``'s secret from the shares revealed of it (ConfigError: too few came; Forged naming ``j``: its
        shares, each checked against its own commitment, do not make one secret)."""
        got = self.shares.get(j, {}).get(kind, {})
        if len(got) < self.params.threshold:
            what = "self-mask seed" if kind == "b" else "mask key"
            raise ConfigError(f"client {j}'s {what}: {len(got)} shares came, {self.params.threshold} needed (more "
                              f"than degree - threshold = {self.params.degree - self.params.threshold} of its "
                              "neighbours dropped out): the round's sum cannot be unmasked")
        if not consistent(got, self.params.threshold):
            raise Forged(j, f"the shares it dealt of its {kind} are not of one polynomial")
        try:
            return combine(got, self.params.threshold)
        except ConfigError as e:
            raise Forged(j, f"the shares it dealt of its {kind} make no secret ({e})") from None

    def total(self) -> np.ndarray:
        """The sum of the survivors' inputs mod 2^32 (ConfigError where fewer than t shares of a secret came;
        Forged naming the dealer whose committed shares do not make one secret, or make a mask key other than
        the one it advertised)."""
        survivors, dropped = self.unmask_request()
        size = self.params.size
        out = np.zeros(size, dtype=np.uint32) if self.summed is None else self.summed.copy()
        for j in sorted(survivors):
            out = out - prg(self._secret(j, "b"), size)
        for j in sorted(dropped):
            sk = KeyPair(self._secret(j, "s"))
            if sk.public != self.adverts[j].s_public:  # every share was j's committed one: j dealt a wrong key
                raise Forged(j, "its mask key's shares make a key other than the one it advertised")
            for k in sorted(self.edges[j] & survivors):  # k masked with +m if k < j, unless it complained of j
                if j in self.unused.get(k, ()):
                    continue
                m = prg(sk.agree(self.adverts[k].s_public, _pair_info(self.params, b"s")), size)
                out = out - m if k < j else out + m
        return out
