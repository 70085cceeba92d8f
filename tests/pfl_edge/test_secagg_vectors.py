"""docs/vectors/secagg against pfl_edge.secagg (docs/secagg.md, "Byte for byte"): a fresh generation gives the
checked-in files byte for byte, and every vector is recomputed here from the library's own functions (and, where
the doc gives a construction in a line, from that line: HKDF, the AAD, the commitment's message, the polynomial),
so a change that alters a byte of a secure round fails here until the vectors and the doc are changed on purpose.
Every message of the round validates against its schema in docs/schemas. devices/js/test/secagg_vectors.test.ts
holds the JavaScript device to the same files."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema_rs
import numpy as np
import pytest

from pfl_edge.errors import CodecError, ConfigError
from pfl_edge.secagg import wire
from pfl_edge.secagg.crypto import KeyPair, open_sealed, prg, sealed_with
from pfl_edge.secagg.protocol import Advert, Client, Params, dequantize_sum, graph, quantize
from pfl_edge.secagg.rounds import stored_total
from pfl_edge.secagg.shamir import PRIME, SHARE_BYTES, combine, split, split_with
from pfl_edge.secagg.vectors import generate
from pfl_edge.secagg.verify import commitment, judge, open_pair, pair_info, pair_key
from pfl_edge.secagg_config import max_bits

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "docs" / "vectors" / "secagg"
SCHEMAS = ROOT / "docs" / "schemas"


def _load(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((VECTORS / name).read_text())
    return out


def _params(rid: str, size: int = 1) -> Params:
    return Params(2, 2, size, rid.encode())


def test_regenerating_gives_the_checked_in_files(tmp_path: Path) -> None:
    written = {p.name for p in generate(tmp_path)}
    assert written == {p.name for p in VECTORS.iterdir()}, "docs/vectors/secagg holds other files"
    changed = [n for n in sorted(written) if (tmp_path / n).read_bytes() != (VECTORS / n).read_bytes()]
    assert not changed, f"regenerate with python -m pfl_edge.secagg.vectors --out docs/vectors/secagg: {changed}"


def test_the_vectors_generate_without_torch(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from pathlib import Path\n"
            "from pfl_edge.secagg.vectors import generate\n"
            "generate(Path(sys.argv[1]))\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in VECTORS.iterdir())


def test_the_doc_specifies_what_the_vectors_hold() -> None:
    doc = (ROOT / "docs" / "secagg.md").read_text()
    section = doc.split("## Byte for byte", 1)[1].split("\n## ", 1)[0]
    for name in (p.name for p in VECTORS.glob("*.json")):
        assert f"vectors/secagg/{name}" in section, f"docs/secagg.md's 'Byte for byte' does not point at {name}"
    for line in ("pfl-secagg:c:", "pfl-secagg:s:", "pfl-secagg-commit:", "2^521 − 1", "168", "max_bits"):
        assert line in section


def test_keys() -> None:
    v = _load("keys.json")
    for pair in v["pairs"]:
        assert KeyPair(bytes.fromhex(pair["secret"])).public.hex() == pair["public"]
    me = KeyPair(bytes.fromhex(v["pairs"][1]["secret"]))
    for pub in v["refused_publics"]:
        with pytest.raises(CodecError, match="unusable public key"):
            me.agree(bytes.fromhex(pub), b"pfl-secagg:check")


def test_agreements_are_hkdf_of_x25519() -> None:
    for c in _load("agree.json")["cases"]:
        info = f"pfl-secagg:{c['kind']}:{c['round_id']}".encode()
        assert c["info"].encode() == info == bytes.fromhex(c["info_hex"])
        assert pair_info(_params(c["round_id"]), c["kind"].encode()) == info
        assert KeyPair(bytes.fromhex(c["secret"])).agree(bytes.fromhex(c["peer_public"]), info).hex() == c["key"]
        prk = hmac.new(bytes(32), bytes.fromhex(c["shared"]), hashlib.sha256).digest()
        assert prk.hex() == c["prk"]
        assert hmac.new(prk, info + b"\x01", hashlib.sha256).hexdigest() == c["key"]


def test_sealed_boxes() -> None:
    v = _load("seal.json")
    for c in v["cases"]:
        rid = _params(c["round_id"])
        sender, receiver = KeyPair(bytes.fromhex(c["sender_c_secret"])), KeyPair(bytes.fromhex(c["receiver_c_secret"]))
        assert sender.public.hex() == c["sender_c_public"] and receiver.public.hex() == c["receiver_c_public"]
        key = pair_key(rid, sender, receiver.public)
        assert key == pair_key(rid, receiver, sender.public) == bytes.fromhex(c["key"])
        aad = b"pfl-secagg:" + c["round_id"].encode() + struct.pack(">II", c["sender"], c["receiver"])
        plain = bytes.fromhex(c["plaintext"])
        assert aad.hex() == c["aad"] and plain[:8] == struct.pack(">II", c["sender"], c["receiver"])
        assert len(plain) == 8 + 2 * SHARE_BYTES and len(bytes.fromhex(c["sealed"])) == wire.SEALED_BYTES == 168
        assert sealed_with(key, bytes.fromhex(c["nonce"]), plain, aad).hex() == c["sealed"]
        assert open_sealed(key, bytes.fromhex(c["sealed"]), aad) == plain
    for r in v["refused"]:
        with pytest.raises(CodecError):
            open_sealed(bytes.fromhex(r["key"]), bytes.fromhex(r["sealed"]), bytes.fromhex(r["aad"]))


def test_shamir() -> None:
    v = _load("shamir.json")
    assert int(v["prime"], 16) == PRIME == 2**521 - 1 and v["share_bytes"] == SHARE_BYTES == 66
    for c in v["cases"]:
        coeffs = [int(a, 16) for a in c["coeffs"]]
        assert len(coeffs) == c["threshold"] - 1
        got = split_with(bytes.fromhex(c["secret"]), c["xs"], coeffs)
        assert {str(x): s.hex() for x, s in got.items()} == c["shares"]
        poly = [int(c["secret"], 16), *coeffs]
        for x, share in c["shares"].items():  # the polynomial as the doc writes it
            assert int(share, 16) == sum(a * int(x) ** k for k, a in enumerate(poly)) % PRIME
        shares = {int(x): bytes.fromhex(s) for x, s in c["shares"].items()}
        assert combine(shares, c["threshold"]).hex() == c["secret"]
    for c in v["combine"]:
        shares = {int(x): bytes.fromhex(s) for x, s in c["shares"].items()}
        if "error" in c:
            with pytest.raises(ConfigError, match=c["error"].split(" (")[0]):
                combine(shares, c["threshold"])
        else:
            assert combine(shares, c["threshold"]).hex() == c["secret"]
    fresh = split(bytes(range(32)), [1, 2, 3], 2)  # split draws its coefficients: any 2 of its shares combine
    assert combine({1: fresh[1], 3: fresh[3]}, 2) == bytes(range(32))


def test_the_masks_generator() -> None:
    for c in _load("prg.json")["cases"]:
        v = prg(bytes.fromhex(c["seed"]), c["n"])
        assert v.dtype == np.uint32 and v.size == c["n"]
        assert [int(u) for u in v[:16]] == c["head"] and [int(u) for u in v[-4:]] == c["tail"]
        assert hashlib.sha256(v.astype("<u4").tobytes()).hexdigest() == c["le_bytes_sha256"]


def test_commitments() -> None:
    for c in _load("commit.json")["cases"]:
        share = bytes.fromhex(c["share"])
        msg = (b"pfl-secagg-commit:" + c["kind"].encode() + b":" + c["round_id"].encode()
               + struct.pack(">II", c["dealer"], c["holder"]) + share)
        assert msg.hex() == c["message"] and hashlib.sha256(msg).hexdigest() == c["commitment"]
        assert commitment(_params(c["round_id"]), c["kind"], c["dealer"], c["holder"], share).hex() == c["commitment"]


def test_the_quantizer() -> None:
    v = _load("quantize.json")
    for c in v["cases"]:
        x = np.array([struct.unpack(">d", bytes.fromhex(h))[0] for h in c["x_f64"]])
        assert np.array_equal(x, np.array(c["x"]))
        assert [int(q) for q in quantize(x, c["bound"], c["bits"])] == c["q"]
    inf = v["infinite"]
    x = np.array([struct.unpack(">d", bytes.fromhex(h))[0] for h in inf["x_f64"]])
    assert np.isinf(x).all() and [int(q) for q in quantize(x, inf["bound"], inf["bits"])] == inf["q"]
    for c in v["ties"]:
        assert [int(q) for q in quantize(np.array(c["x"]), c["bound"], c["bits"])] == c["q"]
    for c in v["dequantize"]:
        got = dequantize_sum(np.array(c["total"], dtype=np.uint32), c["count"], c["bound"], c["bits"])
        assert [struct.pack(">d", float(u)).hex() for u in got] == c["sum_f64"]
        assert got.tolist() == c["sum"]
    for c in v["max_bits"]:
        assert max_bits(c["clients"]) == c["bits"]
        assert c["clients"] * ((1 << c["bits"]) - 1) < 1 << 32


def _validate(kind: str, body: dict[str, Any]) -> None:
    jsonschema_rs.validator_for(json.loads((SCHEMAS / f"{kind}.json").read_text())).validate(body)
    getattr(wire, kind).model_validate(body)


def test_every_message_of_the_round_is_valid() -> None:
    m = _load("round.json")["messages"]
    steps = [("SecAggStep", [m["advertise"]["state"], m["done"]["state"]]),
             ("SecAggKeys", m["advertise"]["keys"].values()),
             ("SecAggStep", [*m["share"]["state"].values(), *m["input"]["state"].values(),
                             *m["unmask"]["state"].values()]),
             ("SecAggShares", m["share"]["shares"].values()), ("SecAggUnmask", m["unmask"]["unmask"].values())]
    for kind, bodies in steps:
        for body in bodies:
            _validate(kind, body)
    for case in _load("complaint.json")["cases"]:
        _validate("SecAggStep", case["state"])
        _validate("SecAggComplaint", case["complaint"])


def _client(v: dict[str, Any], slot: int) -> Client:
    d = v["devices"][str(slot)]
    p = v["params"]
    params = Params(p["degree"], p["threshold"], p["size"], wire.round_id(v["federation"], v["round"]))
    c = Client(slot, params, c=KeyPair(bytes.fromhex(d["c_secret"])), s=KeyPair(bytes.fromhex(d["s_secret"])),
               b=bytes.fromhex(d["b"]))
    state = v["messages"]["share"]["state"][str(slot)]
    c.neighbours = {n["index"]: Advert(n["index"], bytes.fromhex(n["c_public"]), bytes.fromhex(n["s_public"]))
                    for n in state["neighbours"]}
    return c


def _inbox(state: dict[str, Any]) -> dict[int, tuple[bytes, bytes]]:
    return {s["index"]: (bytes.fromhex(s["box"]), bytes.fromhex(s["commits"])) for s in state["inbox"]}


def test_the_round_keys_graph_and_shares() -> None:
    v = _load("round.json")
    m, p = v["messages"], v["params"]
    assert v["round_id"] == wire.round_id(v["federation"], v["round"]).decode() == f"{v['federation']}:{v['round']}"
    assert v["quantizer"]["bits"] == max_bits(v["quantizer"]["clients"])
    slots = sorted(int(i) for i in v["devices"])
    edges = graph(slots, p["degree"], v["graph_seed"])
    for i in slots:
        d, c = v["devices"][str(i)], _client(v, i)
        assert m["advertise"]["keys"][str(i)] == {"c_public": c.c.public.hex(), "s_public": c.s.public.hex()}
        assert [n["index"] for n in m["share"]["state"][str(i)]["neighbours"]] == sorted(edges[i])
        assert [int(q) for q in quantize(np.array(d["update"]), v["quantizer"]["bound"], v["quantizer"]["bits"])] \
            == d["x"]
        for sealed in m["share"]["shares"][str(i)]["shares"]:  # each pair opens for its holder and holds f(j + 1)
            j = sealed["index"]
            holder = _client(v, j)
            key = pair_key(holder.params, holder.c, c.c.public)
            sb, ss = open_pair(holder.params, key, i, j, bytes.fromhex(sealed["box"]), bytes.fromhex(sealed["commits"]))
            assert sealed["box"][:24] == d["nonces"][str(j)]
            assert sb == split_with(c.b, [j + 1], [int(a, 16) for a in d["coeffs_b"]])[j + 1]
            assert ss == split_with(c.s.secret, [j + 1], [int(a, 16) for a in d["coeffs_s"]])[j + 1]


def test_the_round_masked_inputs_unmasking_and_sum() -> None:
    v = _load("round.json")
    m, t = v["messages"], v["round"]
    for i in v["survivors"]:
        c, d = _client(v, i), v["devices"][str(i)]
        y = c.masked_input(np.array(d["x"], dtype=np.uint32), _inbox(m["input"]["state"][str(i)]))
        assert not c.accused and y.tolist() == m["input"]["masked"][str(i)]["y"]
        payload = bytes.fromhex(m["input"]["masked"][str(i)]["payload"])
        assert wire.encode_masked(y, t) == payload and hashlib.sha256(payload).hexdigest() == \
            m["input"]["masked"][str(i)]["sha256"]
        assert wire.decode_masked(payload, v["params"]["size"])[0] == t
        state = m["unmask"]["state"][str(i)]
        assert (state["survivors"], state["dropped"]) == (v["survivors"], v["dropped"])
        shares = c.unmask(frozenset(state["survivors"]), frozenset(state["dropped"]))
        assert [{"about": j, "kind": k, "share": s.hex()} for j, (k, s) in sorted(shares.items())] == \
            m["unmask"]["unmask"][str(i)]["shares"]
    p = v["params"]
    params = Params(p["degree"], p["threshold"], p["size"], v["round_id"].encode())
    inputs = [(i, np.array(m["input"]["masked"][str(i)]["y"], dtype=np.uint32)) for i in v["survivors"]]
    total = stored_total(params, v["graph_seed"], sorted(int(i) for i in v["devices"]),
                         {int(i): k for i, k in m["advertise"]["keys"].items()},
                         {int(i): s for i, s in m["share"]["shares"].items()}, {}, inputs,
                         {int(i): u for i, u in m["unmask"]["unmask"].items()})
    assert total.tolist() == v["sum"]
    plain = sum(np.array(v["devices"][str(i)]["x"], dtype=np.uint64) for i in v["survivors"]) % (1 << 32)
    assert plain.tolist() == v["sum"]
    n, q = len(v["survivors"]), v["quantizer"]
    assert (dequantize_sum(total, n, q["bound"], q["bits"]) / n).tolist() == v["mean"]


def test_complaints() -> None:
    v, rnd = _load("complaint.json"), _load("round.json")
    p = rnd["params"]
    params = Params(p["degree"], p["threshold"], p["size"], v["round_id"].encode())
    adverts = {int(i): Advert(int(i), bytes.fromhex(d["c_public"]), bytes.fromhex(d["s_public"]))
               for i, d in rnd["devices"].items()}
    for case in v["cases"]:
        holder, dealer = case["holder"], case["dealer"]
        c = _client(rnd, holder)
        c.masked_input(np.array(rnd["devices"][str(holder)]["x"], dtype=np.uint32), _inbox(case["state"]))
        assert (c.accused == {dealer}) is case["accused_by_holder"]
        if case["accused_by_holder"]:
            secret, accused = c.complaint()
            assert {"c_secret": secret.hex(), "accused": accused} == case["complaint"]
        box = next(s for s in case["state"]["inbox"] if s["index"] == dealer)
        named = judge(params, adverts[holder], bytes.fromhex(case["complaint"]["c_secret"]), adverts[dealer],
                      bytes.fromhex(box["box"]), bytes.fromhex(box["commits"]))
        assert named == case["named"] == (dealer if case["accused_by_holder"] else holder)
