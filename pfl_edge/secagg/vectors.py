"""The test vectors of secure aggregation (docs/secagg.md, "Byte for byte"), for device teams: each primitive of a
secure round (X25519 keys, the pairwise key derivation, the sealed share box, Shamir's shares, the masks'
generator, the commitments, the quantizer) and every message of a whole round (``vector_round``) as JSON, from
fixed inputs: every secret, coefficient and nonce is a hash of a label (``secret``, ``coefficient``, ``nonce``),
so the files are the same on every machine, and a change that alters any byte shows up as a diff.
``python -m pfl_edge.secagg.vectors --out docs/vectors/secagg`` rewrites them; tests/pfl_edge/test_secagg_vectors.py
and devices/js/test/secagg_vectors.test.ts hold pfl-edge and the JavaScript device to them."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CodecError, ConfigError, InternalError
from ..secagg_config import max_bits
from .crypto import KeyPair, open_sealed, prg, sealed_with
from .protocol import Params, dequantize_sum, quantize
from .shamir import PRIME, SHARE_BYTES, combine, split_with
from .vector_round import coefficient, complaints, nonce, readme, secret, secure_round
from .verify import commitment, pair_info

__all__ = ["coefficient", "files", "generate", "main", "nonce", "secret"]

RFC7748_ALICE = ("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a",
                 "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
#: public keys every agreement must refuse: points of small order (their shared secret is all zeros)
LOW_ORDER = ["00" * 32, "01" + "00" * 31,
             "e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800",
             "5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157",
             "ec" + "ff" * 30 + "7f", "ed" + "ff" * 30 + "7f", "ee" + "ff" * 30 + "7f"]


def _hkdf(shared: bytes, info: bytes) -> tuple[bytes, bytes]:
    """RFC 5869 by hand (no salt: 32 zero bytes; one block of output): the PRK and the 32-byte key."""
    prk = hmac.new(bytes(32), shared, hashlib.sha256).digest()
    return prk, hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def _shared(mine: KeyPair, public: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    return X25519PrivateKey.from_private_bytes(mine.secret).exchange(X25519PublicKey.from_public_bytes(public))


def keys() -> dict[str, Any]:
    pairs = [KeyPair(bytes.fromhex(RFC7748_ALICE[0]))] + [KeyPair(secret(f"key:{i}")) for i in range(3)]
    pairs.append(KeyPair(bytes([0xFF] * 32)))
    if pairs[0].public.hex() != RFC7748_ALICE[1]:
        raise InternalError("X25519 disagrees with RFC 7748's vector")
    for pub in LOW_ORDER:
        try:
            pairs[1].agree(bytes.fromhex(pub), b"pfl-secagg:check")
        except CodecError:
            continue
        raise InternalError(f"a low-order key {pub} was agreed with")
    return {
        "about": "X25519 key pairs (RFC 7748): the public key of each 32-byte secret (used as given: the scalar is "
                 "clamped inside X25519; the first is RFC 7748 section 6.1's Alice; the last all 0xff bytes), and "
                 "public keys every agreement must refuse (small-order points: the shared secret would be zero)",
        "pairs": [{"secret": p.secret.hex(), "public": p.public.hex()} for p in pairs],
        "refused_publics": LOW_ORDER,
    }


def agreements() -> dict[str, Any]:
    cases = []
    for a, b, rid, kind in [(0, 1, b"vec:3", b"c"), (1, 0, b"vec:3", b"c"), (0, 1, b"vec:3", b"s"),
                            (2, 0, "fédé:12".encode(), b"s"), (1, 2, b"vec:4", b"c")]:
        mine, theirs = KeyPair(secret(f"key:{a}")), KeyPair(secret(f"key:{b}"))
        info = pair_info(Params(2, 2, 1, rid), kind)
        shared = _shared(mine, theirs.public)
        prk, key = _hkdf(shared, info)
        if key != mine.agree(theirs.public, info) or key != theirs.agree(mine.public, info):
            raise InternalError("the agreement is not HKDF-SHA256 of the shared secret, both ways")
        cases.append({"secret": mine.secret.hex(), "public": mine.public.hex(), "peer_public": theirs.public.hex(),
                      "round_id": rid.decode(), "kind": kind.decode(), "info": info.decode(),
                      "info_hex": info.hex(), "shared": shared.hex(), "prk": prk.hex(), "key": key.hex()})
    mine, peer = KeyPair(secret("key:0")), bytearray(KeyPair(secret("key:1")).public)
    peer[31] |= 0x80  # RFC 7748: the top bit is ignored
    for what, pub in [("the peer's key with its top bit set: the same point", bytes(peer)),
                      ("u = 2^255 - 19 + 9, not reduced: the same as the base point 9 (so the shared secret is "
                       "this key's own public key)", (2**255 - 10).to_bytes(32, "little"))]:
        info = pair_info(Params(2, 2, 1, b"vec:3"), b"c")
        shared = _shared(mine, pub)
        prk, key = _hkdf(shared, info)
        if key != mine.agree(pub, info):
            raise InternalError("the agreement is not HKDF-SHA256 of the shared secret")
        cases.append({"what": what, "secret": mine.secret.hex(), "public": mine.public.hex(), "peer_public": pub.hex(),
                      "round_id": "vec:3", "kind": "c", "info": info.decode(), "info_hex": info.hex(),
                      "shared": shared.hex(), "prk": prk.hex(), "key": key.hex()})
    return {"about": "the pairwise keys: key = HKDF-SHA256(IKM = X25519(secret, peer_public), salt = none (32 zero "
                     "bytes), info = 'pfl-secagg:' kind ':' round_id (UTF-8), L = 32); prk is HKDF-Extract's "
                     "output. kind c: the key a pair of shares is sealed under; kind s: the seed of a pairwise mask. "
                     "The last two: public keys an X25519 of RFC 7748 takes as they are (the server does too)",
            "cases": cases}


def _aad(rid: bytes, sender: int, receiver: int) -> bytes:
    return b"pfl-secagg:" + rid + struct.pack(">II", sender, receiver)


def sealed_boxes() -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for sender, receiver, rid in [(1, 0, b"vec:3"), (0, 1, b"vec:3"), (7, 70_000, b"vec:1000")]:
        c_s, c_r = KeyPair(secret(f"key:{sender % 3}")), KeyPair(secret(f"key:{receiver % 3 + 3}"))
        key = c_s.agree(c_r.public, pair_info(Params(2, 2, 1, rid), b"c"))
        sb, ss = (split_with(secret(f"{k}:{sender}"), [receiver + 1], [coefficient(f"box:{k}:{sender}")])
                  for k in ("b", "s"))
        plain = struct.pack(">II", sender, receiver) + sb[receiver + 1] + ss[receiver + 1]
        aad = _aad(rid, sender, receiver)
        box = sealed_with(key, nonce(f"{sender}:{receiver}"), plain, aad)
        if len(box) != 168 or open_sealed(key, box, aad) != plain:
            raise InternalError("a sealed pair is not 168 bytes that open to their plaintext")
        cases.append({"sender": sender, "receiver": receiver, "round_id": rid.decode(),
                      "sender_c_secret": c_s.secret.hex(), "receiver_c_public": c_r.public.hex(),
                      "receiver_c_secret": c_r.secret.hex(), "sender_c_public": c_s.public.hex(),
                      "key": key.hex(), "nonce": box[:12].hex(), "aad": aad.hex(), "plaintext": plain.hex(),
                      "sealed": box.hex()})
    first = cases[0]
    key, box, aad = (bytes.fromhex(first[k]) for k in ("key", "sealed", "aad"))
    flipped = bytearray(box)
    flipped[100] ^= 1
    for why, k, b, a in [("the AAD of another receiver", key, box, _aad(b"vec:3", 1, 2)),
                         ("the AAD of another round", key, box, _aad(b"vec:4", 1, 0)),
                         ("one ciphertext bit flipped", key, bytes(flipped), aad),
                         ("the tag's last byte cut off", key, box[:-1], aad),
                         ("another pair's key", bytes.fromhex(cases[1]["key"]), box, aad),
                         ("27 bytes: shorter than a nonce and a tag", key, box[:27], aad)]:
        try:
            open_sealed(k, b, a)
        except CodecError:
            refused.append({"why": why, "key": k.hex(), "sealed": b.hex(), "aad": a.hex()})
            continue
        raise InternalError(f"a sealed pair opened with {why}")
    return {"about": "the sealed pair of shares: sealed = nonce (12 bytes) || AES-256-GCM(key, nonce, plaintext, "
                     "aad) (ciphertext, then the 16-byte tag); key: the sender's and receiver's kind-c agreement; "
                     "aad = 'pfl-secagg:' || round_id || sender || receiver (uint32 big-endian, not sent); plaintext "
                     "= sender || receiver (uint32 big-endian) || share of b (66) || share of the s key (66): 140 "
                     "bytes, so a sealed pair is 168. The nonce is random in a round; fixed here",
            "cases": cases, "refused": refused}


def _hex66(v: int) -> str:
    return v.to_bytes(SHARE_BYTES, "big").hex()


def shamir() -> dict[str, Any]:
    cases: list[dict[str, Any]] = []
    for label, xs, t in [("shamir:0", [1, 2, 3, 4, 5], 3), ("shamir:1", [1, 3, 6, 10], 2),
                         ("shamir:2", [2, 8, 100_001, 2**31 - 1], 4), ("shamir:3", [5, 6], 1)]:
        coeffs = [coefficient(f"{label}:{k}") for k in range(1, t)]
        cases.append({"secret": secret(label).hex(), "threshold": t, "xs": xs, "coeffs": [_hex66(a) for a in coeffs],
                      "shares": {str(x): s.hex() for x, s in split_with(secret(label), xs, coeffs).items()}})
    edge = [12345678901234567890, PRIME - 2]  # the largest coefficients, so every share is reduced
    at_edge = split_with(secret("shamir:edge"), [1, 2, 3, 7], edge)
    cases.append({"secret": secret("shamir:edge").hex(), "threshold": 3, "xs": [1, 2, 3, 7],
                  "coeffs": [_hex66(a) for a in edge], "shares": {str(x): s.hex() for x, s in at_edge.items()}})
    combine_cases = []
    first = cases[0]
    shares = {int(x): bytes.fromhex(s) for x, s in first["shares"].items()}
    forged = dict(shares)
    forged[2] = (int.from_bytes(forged[2], "big") + 1).to_bytes(SHARE_BYTES, "big")
    replaced = coefficient("shamir:x").to_bytes(SHARE_BYTES, "big")
    for what, got, t in [("any t shares", {x: shares[x] for x in (2, 4, 5)}, 3),
                         ("more than t: the first t by x are used", shares, 3),
                         ("fewer than t", {x: shares[x] for x in (1, 2)}, 3),
                         ("a share moved by one: another secret (the old one - 3), not refused (the commitments "
                          "catch a forged share)", {x: forged[x] for x in (1, 2, 3)}, 3),
                         ("a share replaced: not a secret of 32 bytes", {1: shares[1], 2: replaced, 3: shares[3]}, 3),
                         ("a share not below the prime", {1: shares[1], 2: PRIME.to_bytes(SHARE_BYTES, "big"),
                                                          3: shares[3]}, 3)]:
        try:
            out: dict[str, Any] = {"secret": combine(got, t).hex()}
        except ConfigError as e:
            out = {"error": str(e)}
        combine_cases.append({"what": what, "threshold": t, "shares": {str(x): s.hex() for x, s in got.items()},
                              **out})
    return {"about": "Shamir's sharing over GF(p), p = 2^521 - 1: f(x) = secret + c_1 x + ... + c_{t-1} x^(t-1) mod "
                     "p, the secret read as a big-endian integer, c_k uniform in [0, p) (fixed here); the share at "
                     "x is f(x), 66 bytes big-endian. In a round x = the holder's slot + 1. combine: Lagrange "
                     "interpolation at 0 over the t shares of smallest x; refused unless every share is 66 bytes "
                     "below p and the result fits the secret's 32 bytes",
            "prime": _hex66(PRIME), "share_bytes": SHARE_BYTES, "cases": cases, "combine": combine_cases}


def masks() -> dict[str, Any]:
    cases = []
    for label, n in [("prg:0", 8), ("prg:1", 1), ("prg:2", 13), ("prg:3", 1000)]:
        seed = secret(label)
        v = prg(seed, n)
        cases.append({"seed": seed.hex(), "n": n, "head": [int(u) for u in v[:16]], "tail": [int(u) for u in v[-4:]],
                      "le_bytes_sha256": hashlib.sha256(v.astype("<u4").tobytes()).hexdigest()})
    return {"about": "the masks' generator: n uint32 = AES-256-CTR's keystream under the 32-byte seed, the whole "
                     "16-byte counter block starting at zero and incremented as one big-endian 128-bit integer, cut "
                     "into 4-byte little-endian words; head: the first 16 (or n), tail: the last 4, "
                     "le_bytes_sha256: SHA-256 of all 4n keystream bytes",
            "cases": cases}


def commitments() -> dict[str, Any]:
    cases = []
    for rid, kind, dealer, holder, share in [(b"fed:3", "b", 1, 0, bytes(range(66))),
                                             (b"fed:3", "s", 1, 0, bytes(range(66))),
                                             (b"vec:3", "b", 7, 70_000, bytes.fromhex(_hex66(PRIME - 1)))]:
        msg = b"pfl-secagg-commit:" + kind.encode() + b":" + rid + struct.pack(">II", dealer, holder) + share
        c = commitment(Params(2, 2, 1, rid), kind, dealer, holder, share)
        if c != hashlib.sha256(msg).digest():
            raise InternalError("a commitment is not SHA-256 of its message")
        cases.append({"round_id": rid.decode(), "kind": kind, "dealer": dealer, "holder": holder,
                      "share": share.hex(), "message": msg.hex(), "commitment": c.hex()})
    return {"about": "a dealer's commitment to the share of its secret kind (b: the self-mask seed, s: the mask "
                     "key) that holder holds: SHA-256('pfl-secagg-commit:' || kind || ':' || round_id || dealer || "
                     "holder (uint32 big-endian) || share (66 bytes)); a pair's commits are b's then s's (64 bytes)",
            "cases": cases}


def quantizer() -> dict[str, Any]:
    xs = [-2.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 1 / 3, -0.7, 0.1, 1e-9, -1e-9, 1e300, -0.0]
    cases = []
    for bound, bits in [(0.5, 16), (1.0, 2), (0.7, 16), (1.0, 28), (2.5, 31), (1.0, 1)]:
        q = quantize(np.array(xs, dtype=np.float64), bound, bits)
        cases.append({"bound": bound, "bits": bits, "x": xs, "x_f64": [struct.pack(">d", v).hex() for v in xs],
                      "q": [int(v) for v in q]})
    ties: list[dict[str, Any]] = [{"bound": 1.0, "bits": 2, "x": [-1 / 3, 1 / 3, 0.0], "q": [1, 2, 2],
             "why": "(x + 1) / 2 * 3 = 1.0, 2.0 and 1.5: 1.5 rounds to 2, the even one"}]
    for t in ties:
        if [int(v) for v in quantize(np.array(t["x"]), t["bound"], t["bits"])] != t["q"]:
            raise InternalError("quantize does not round half to even")
    infinite = {"bound": 0.5, "bits": 16, "x_f64": [struct.pack(">d", v).hex() for v in (np.inf, -np.inf)],
                "q": [int(v) for v in quantize(np.array([np.inf, -np.inf]), 0.5, 16)]}
    sums = []
    for total, count, bound, bits in [([0, 65535, 131070, 98303], 2, 0.5, 16), ([3, 0, 6], 3, 1.0, 2),
                                      ([2**28 - 1, 5 * (2**28 - 1), 0], 5, 1.0, 28)]:
        v = dequantize_sum(np.array(total, dtype=np.uint32), count, bound, bits)
        sums.append({"total": total, "count": count, "bound": bound, "bits": bits, "sum": [float(u) for u in v],
                     "sum_f64": [struct.pack(">d", float(u)).hex() for u in v]})
    return {"about": "q = round_half_even((clip(x, -bound, bound) + bound) / (2 bound) * (2^bits - 1)) in float64, "
                     "as uint32 (x: the update, trained base minus received base, the base's floating tensors "
                     "sorted by name, each row-major); bits: the config's, else max_bits(clients) = "
                     "min(31, 32 - ceil(log2(clients + 1))) of the federation's clients, so the sum of every "
                     "client's q never wraps mod 2^32. dequantize: sum = total * (2 bound / (2^bits - 1)) - count "
                     "* bound (float64), the mean sum / count. infinite: +-inf clip to +-bound (not JSON numbers: "
                     "x_f64 only); NaN has no defined q (a device sends no NaN update)",
            "cases": cases, "ties": ties, "infinite": infinite, "dequantize": sums,
            "max_bits": [{"clients": n, "bits": max_bits(n)} for n in (1, 2, 3, 7, 8, 10, 100, 1000, 65535, 65536)]}


def files() -> dict[str, dict[str, Any]]:
    """Every vector file's content, by file name."""
    rnd = secure_round()
    return {"keys.json": keys(), "agree.json": agreements(), "seal.json": sealed_boxes(), "shamir.json": shamir(),
            "prg.json": masks(), "commit.json": commitments(), "quantize.json": quantizer(), "round.json": rnd,
            "complaint.json": complaints(rnd)}


def generate(out: Path) -> list[Path]:
    """Writes every vector file and the README under ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    content = files()
    for name, data in content.items():
        path = out / name
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        paths.append(path)
    (out / "README.md").write_text(readme(content), encoding="utf-8")
    return [*paths, out / "README.md"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pfl_edge.secagg.vectors", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/vectors/secagg"), help="folder to (re)write")
    args = parser.parse_args(argv)
    paths = generate(args.out)
    print(f"wrote {len(paths)} files, {sum(p.stat().st_size for p in paths)} bytes, under {args.out}")


if __name__ == "__main__":
    main()
