"""The test vectors of a whole secure round (``pfl_edge.secagg.vectors``; docs/secagg.md, "Byte for byte"): every
message of it as the wire carries it (``wire``'s JSON, each valid against docs/schemas), made by the library's own
``Client`` and ``Server`` with fixed secrets, Shamir coefficients and nonces (``fixed_draws``: the one thing
replaced, and only while a vector is made), and the complaints a holder makes of a pair that does not open or
check; and the fixed inputs of every vector (``secret``, ``nonce``, ``coefficient``: each a hash of a label)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np

from ..errors import InternalError
from ..secagg_config import max_bits
from . import protocol
from .crypto import KeyPair, sealed_with
from .protocol import Advert, Client, Params, Server, dequantize_sum, quantize
from .shamir import SHARE_BYTES, split_with
from .verify import judge
from .wire import (
    SecAggComplaint,
    SecAggKeys,
    SecAggNeighbour,
    SecAggParams,
    SecAggSealed,
    SecAggShare,
    SecAggShares,
    SecAggStep,
    SecAggUnmask,
    encode_masked,
    round_id,
)

__all__ = ["FEDERATION", "ROUND", "SLOTS", "coefficient", "complaints", "fixed_draws", "nonce", "readme", "secret",
           "secure_round"]

FEDERATION, ROUND = "vec", 3
SLOTS = [1, 2, 4, 5, 7, 9]  # slots of the round's devices (x = slot + 1 in the shares)
DROPS_AFTER_SHARING = 5  # sends its keys and its shares, then no input: its mask key is rebuilt
DEGREE, THRESHOLD, CLIENTS, BOUND, GRAPH_SEED = 4, 3, 10, 0.5, 20_261_207
DEADLINE = 1.8e9
_LABEL = "pfl-secagg-vectors:"


def secret(label: str) -> bytes:
    """32 fixed bytes: SHA-256 of ``pfl-secagg-vectors:<label>`` (a key's secret, a self-mask seed)."""
    return hashlib.sha256((_LABEL + label).encode()).digest()


def nonce(label: str) -> bytes:
    """A fixed 12-byte AES-GCM nonce: the first 12 bytes of ``secret("nonce:<label>")``."""
    return secret("nonce:" + label)[:12]


def coefficient(label: str) -> int:
    """A fixed Shamir coefficient: SHA-512 of ``pfl-secagg-vectors:coeff:<label>`` as a big-endian integer (under
    2^512, so a field element as it stands)."""
    return int.from_bytes(hashlib.sha512((_LABEL + "coeff:" + label).encode()).digest(), "big")


def coeffs(slot: int, kind: str, threshold: int) -> list[int]:
    """The fixed Shamir coefficients c_1 ... c_{t-1} of ``slot``'s secret ``kind`` (b or s)."""
    return [coefficient(f"round:{slot}:{kind}:{k}") for k in range(1, threshold)]


@contextmanager
def fixed_draws(clients: Mapping[int, Client]) -> Iterator[None]:
    """While it lasts, ``Client.share_keys`` deals with the fixed coefficients (``coeffs``) and seals with the
    fixed nonces (``nonce("round:<dealer>:<holder>")``) instead of drawing them; nothing else changes."""
    by_secret = {}
    for i, c in clients.items():
        by_secret[c.b] = coeffs(i, "b", c.params.threshold)
        by_secret[c.s.secret] = coeffs(i, "s", c.params.threshold)

    def split(secret_: bytes, xs: Sequence[int], threshold: int) -> dict[int, bytes]:
        if len(by_secret[secret_]) != threshold - 1:
            raise InternalError("fixed coefficients of another threshold")
        return split_with(secret_, xs, by_secret[secret_])

    def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
        dealer, holder = int.from_bytes(plaintext[:4], "big"), int.from_bytes(plaintext[4:8], "big")
        return sealed_with(key, nonce(f"round:{dealer}:{holder}"), plaintext, aad)

    with mock.patch.object(protocol, "split", split), mock.patch.object(protocol, "seal", seal):
        yield


def _updates(size: int) -> dict[int, np.ndarray]:
    """Each device's float update: a fixed pattern, some coordinates past the bound (clipped)."""
    base = np.array([0.0, 0.125, -0.25, 0.49, -0.6, 1e-4, 0.3, -0.5], dtype=np.float64)[:size]
    return {i: np.round(base * (1 + k / 4) + (k - 2) / 32, 6) for k, i in enumerate(SLOTS)}


def _state(step: str, params: Params | None = None, server: Server | None = None, slot: int = 0,
           inbox: bool = False, unmask: bool = False) -> dict[str, Any]:
    """``GET /v1/rounds/{t}/secagg``'s answer to ``slot``, as the server makes it (server/services/secure.py)."""
    out: dict[str, Any] = {"round": ROUND, "step": step, "deadline": DEADLINE}
    if params is not None and server is not None:
        out["params"] = SecAggParams(degree=params.degree, threshold=params.threshold, size=params.size)
        out["neighbours"] = [SecAggNeighbour(index=j, c_public=server.adverts[j].c_public.hex(),
                                             s_public=server.adverts[j].s_public.hex())
                             for j in sorted(server.edges[slot])]
        if inbox:
            out["inbox"] = [SecAggSealed(index=j, box=b.hex(), commits=h.hex())
                            for j, (b, h) in sorted(server.inbox(slot).items())]
        if unmask:
            survivors, dropped = server.unmask_request()
            out["survivors"], out["dropped"] = sorted(survivors), sorted(dropped)
    return SecAggStep(**out).model_dump(mode="json")


def _devices(params: Params) -> dict[int, Client]:
    return {i: Client(i, params, c=KeyPair(secret(f"round:c:{i}")), s=KeyPair(secret(f"round:s:{i}")),
                      b=secret(f"round:b:{i}")) for i in SLOTS}


def secure_round() -> dict[str, Any]:  # long: one step after another, as the wire carries them
    """Six devices, degree 4, threshold 3; one drops out after sharing: every message, each device's inputs and
    fixed draws, the masked inputs and the sum the server unmasks."""
    size = 8
    rid = round_id(FEDERATION, ROUND)
    params = Params(DEGREE, THRESHOLD, size, rid)
    bits = max_bits(CLIENTS)
    updates = _updates(size)
    x = {i: quantize(updates[i], BOUND, bits) for i in SLOTS}
    clients = _devices(params)
    server = Server(params, GRAPH_SEED)
    msgs: dict[str, Any] = {"advertise": {"state": _state("advertise"), "keys": {}}}
    for i, c in clients.items():
        keys = SecAggKeys(c_public=c.c.public.hex(), s_public=c.s.public.hex())
        msgs["advertise"]["keys"][str(i)] = keys.model_dump()
    nbrs = server.advertised([c.advertise() for c in clients.values()])
    msgs["share"] = {"state": {str(i): _state("share", params, server, i) for i in SLOTS}, "shares": {}}
    with fixed_draws(clients):
        for i, c in clients.items():
            dealt = c.share_keys(nbrs[i])
            msgs["share"]["shares"][str(i)] = SecAggShares(shares=[
                SecAggSealed(index=j, box=b.hex(), commits=h.hex()) for j, (b, h) in dealt.items()]).model_dump()
            server.route(i, dealt)
    live = [i for i in SLOTS if i != DROPS_AFTER_SHARING]
    msgs["input"] = {"state": {str(i): _state("input", params, server, i, inbox=True) for i in live}, "masked": {}}
    for i in live:
        y = clients[i].masked_input(x[i], server.inbox(i))
        payload = encode_masked(y, ROUND)
        msgs["input"]["masked"][str(i)] = {"y": [int(v) for v in y], "payload": payload.hex(),
                                           "sha256": hashlib.sha256(payload).hexdigest()}
        server.receive(i, y)
    survivors, dropped = server.unmask_request()
    msgs["unmask"] = {"state": {str(i): _state("unmask", params, server, i, inbox=True, unmask=True) for i in live},
                      "unmask": {}}
    for i in live:
        shares = clients[i].unmask(survivors, dropped)
        msgs["unmask"]["unmask"][str(i)] = SecAggUnmask(shares=[
            SecAggShare.model_validate({"about": j, "kind": k, "share": v.hex()})
            for j, (k, v) in sorted(shares.items())]).model_dump()
        server.collect(i, shares)
    msgs["done"] = {"state": _state("done")}
    total = server.total()
    plain = np.sum([x[i].astype(np.uint64) for i in live], axis=0) % (1 << 32)
    if not np.array_equal(total, plain.astype(np.uint32)):
        raise InternalError("the round's unmasked sum is not its survivors' plain sum")
    mean = dequantize_sum(total, len(live), BOUND, bits) / len(live)
    return {
        "about": "a whole secure round: six devices of a federation of 10 clients (bits = max_bits(10) = 28), "
                 "degree 4, threshold 3, one drop-out after sharing; every message as the wire carries it (request "
                 "bodies by the sender's slot, the GET /v1/rounds/{t}/secagg answers by the asker's slot), the "
                 "devices' fixed secrets and draws, their masked inputs and the sum the server unmasks",
        "federation": FEDERATION, "round": ROUND, "round_id": rid.decode(), "graph_seed": GRAPH_SEED,
        "params": {"degree": DEGREE, "threshold": THRESHOLD, "size": size},
        "quantizer": {"bound": BOUND, "clients": CLIENTS, "bits": bits},
        "devices": {str(i): {
            "c_secret": c.c.secret.hex(), "c_public": c.c.public.hex(), "s_secret": c.s.secret.hex(),
            "s_public": c.s.public.hex(), "b": c.b.hex(), "update": [float(v) for v in updates[i]],
            "x": [int(v) for v in x[i]],
            "coeffs_b": [v.to_bytes(SHARE_BYTES, "big").hex() for v in coeffs(i, "b", THRESHOLD)],
            "coeffs_s": [v.to_bytes(SHARE_BYTES, "big").hex() for v in coeffs(i, "s", THRESHOLD)],
            "nonces": {str(j): nonce(f"round:{i}:{j}").hex() for j in sorted(nbrs[i])}} for i, c in clients.items()},
        "drops_after_sharing": DROPS_AFTER_SHARING,
        "messages": msgs,
        "survivors": sorted(survivors), "dropped": sorted(dropped),
        "sum": [int(v) for v in total], "mean": [float(v) for v in mean],
    }


def complaints(rnd: Mapping[str, Any]) -> dict[str, Any]:
    """The ``input`` step's complaints, from ``rnd``'s round: a holder's inbox with one pair altered (the box, or
    the commitments), what the holder then accuses and sends, and whom the server's ``judge`` names; and a false
    complaint (a good pair accused), which names the complainer."""
    params = Params(DEGREE, THRESHOLD, rnd["params"]["size"], rnd["round_id"].encode())
    holder = 1
    state = rnd["messages"]["input"]["state"][str(holder)]
    adverts = {int(i): Advert(int(i), bytes.fromhex(d["c_public"]), bytes.fromhex(d["s_public"]))
               for i, d in rnd["devices"].items()}
    c_secret = bytes.fromhex(rnd["devices"][str(holder)]["c_secret"])
    cases = []
    for what, dealer, field in [("a box with one ciphertext bit flipped", state["inbox"][0]["index"], "box"),
                                ("commitments that are not the shares'", state["inbox"][1]["index"], "commits"),
                                ("a good pair accused (a false complaint)", state["inbox"][2]["index"], None)]:
        inbox = [dict(s) for s in state["inbox"]]
        entry = next(s for s in inbox if s["index"] == dealer)
        if field is not None:
            raw = bytearray(bytes.fromhex(entry[field]))
            raw[40] ^= 0x01
            entry[field] = raw.hex()
        named = judge(params, adverts[holder], c_secret, adverts[dealer], bytes.fromhex(entry["box"]),
                      bytes.fromhex(entry["commits"]))
        cases.append({"what": what, "holder": holder, "dealer": dealer,
                      "state": SecAggStep(**{**state, "inbox": inbox}).model_dump(mode="json"),
                      "complaint": SecAggComplaint(c_secret=c_secret.hex(), accused=[dealer]).model_dump(),
                      "accused_by_holder": field is not None, "named": named})
    if [c["named"] for c in cases] != [cases[0]["dealer"], cases[1]["dealer"], holder]:
        raise InternalError("a complaint named the wrong device")
    return {"about": "the input step's complaint (SecAggComplaint): round.json's device 1 is sent an inbox with one "
                     "pair altered; it does not mask with that dealer and accuses it before its input, sending its "
                     "c secret; the server opens the pair itself (judge) and names the dealer, or, where the pair "
                     "opens and checks (a false complaint), the complainer",
            "round_id": rnd["round_id"], "cases": cases}


_FILES = {
    "keys.json": "X25519: a secret's public key; the small-order public keys an agreement refuses",
    "agree.json": "the pairwise keys: HKDF-SHA256 of the X25519 shared secret, info 'pfl-secagg:<c|s>:<round id>'",
    "seal.json": "the sealed pair of shares (168 bytes: nonce, AES-256-GCM of sender, receiver and two shares, tag); "
                 "boxes that must not open",
    "shamir.json": "Shamir's shares over GF(2^521 - 1) at fixed coefficients; combining them (and the refusals)",
    "prg.json": "the masks' generator: AES-256-CTR keystream as little-endian uint32",
    "commit.json": "the dealer's SHA-256 commitments to each share",
    "quantize.json": "the quantizer (clip, scale, round half to even), the default bits, the dequantized sum",
    "round.json": "a whole round, every message of each step (SecAggKeys, SecAggStep, SecAggShares, the masked "
                  "payload, SecAggUnmask), one drop-out, and the unmasked sum",
    "complaint.json": "SecAggComplaint: an altered box, altered commitments, a false complaint; whom the server names",
}


def readme(content: Mapping[str, Any]) -> str:
    """docs/vectors/secagg/README.md."""
    lines = ["# Secure aggregation's test vectors", "",
             "Generated by `python -m pfl_edge.secagg.vectors --out docs/vectors/secagg` (every secret, coefficient "
             "and nonce a hash of a label; do not edit by hand). The constructions are specified in "
             "[../../secagg.md](../../secagg.md), \"Byte for byte\"; `tests/pfl_edge/test_secagg_vectors.py` holds "
             "pfl-edge to them (and every message to docs/schemas), `devices/js/test/secagg_vectors.test.ts` the "
             "JavaScript device. Bytes are lowercase hex; every file says what it holds in its `about`.", "",
             "| file | holds |", "|---|---|"]
    lines += [f"| `{name}` | {_FILES[name]} |" for name in content]
    return "\n".join(lines) + "\n"
