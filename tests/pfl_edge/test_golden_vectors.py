"""The golden vectors in docs/vectors against pfl_edge.codec, and against a second decoder written from
docs/codec.md alone (``_ref_decode`` below: plain ints and bytes, no numpy, nothing imported from pfl_edge.codec),
which is what shows the spec is complete: a device team following it decodes every vector to the same values and
refuses every negative one. The hex dumps of codec.md's worked examples are checked against the vector files too,
and the vectors against a fresh generation, so a codec change that alters bytes fails here until the vectors and
the docs are updated on purpose."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pfl_edge.codec import decode, encode
from pfl_edge.codec.vectors import INDEX_FORMAT, generate
from pfl_edge.errors import CodecError

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "docs" / "vectors"
INDEX = json.loads((VECTORS / "index.json").read_text())  # {"format", "positive": [...], "negative": [...]}
POSITIVE = [p["name"] for p in INDEX["positive"]]
NEGATIVE = INDEX["negative"]


def _content(name: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((VECTORS / f"{name}.json").read_text())
    return out


def _bits32(t: torch.Tensor) -> list[str]:
    return [f"{int(v):08x}" for v in t.detach().reshape(-1).numpy().astype("<f4").view("<u4")]


def test_the_vectors_are_there() -> None:
    assert len(POSITIVE) >= 15 and len(NEGATIVE) >= 20
    codings = {t["coding"] for n in POSITIVE for t in _content(n)["tensors"]}
    assert codings == {None, "bitmap", "rice1", "rice0"}
    assert {t["dtype"] for n in POSITIVE for t in _content(n)["tensors"]} == {"f4", "f2"}
    assert sum(p.stat().st_size for p in VECTORS.iterdir()) < 200_000


def test_the_index_lists_every_vector_once() -> None:
    """A reader finds every vector from index.json alone: each .bin here is listed once (so a vector added
    without an index entry fails), each entry's files exist, and nothing else is in the folder."""
    assert set(INDEX) == {"format", "positive", "negative"} and INDEX["format"] == INDEX_FORMAT
    pos, neg = INDEX["positive"], INDEX["negative"]
    assert all(set(p) == {"name", "file", "json", "about"} for p in pos)
    assert all(set(n) == {"name", "file", "about", "error", "decode_args"} for n in neg)
    listed = [e["file"] for e in pos + neg]
    assert len(listed) == len(set(listed)), "a .bin is listed twice"
    assert sorted(listed) == sorted(p.name for p in VECTORS.glob("*.bin"))
    assert all(e["file"] == f"{e['name']}.bin" for e in pos + neg)
    assert all(p["json"] == f"{p['name']}.json" and (VECTORS / p["json"]).is_file() for p in pos)
    assert sorted(p["json"] for p in pos) == sorted(p.name for p in VECTORS.glob("*.json") if p.name != "index.json")
    for p in pos:
        assert _content(p["name"])["vector"] == p["name"] and _content(p["name"])["about"] == p["about"]


# ------------------------------------------------------------------------------------------ against pfl_edge.codec


@pytest.mark.parametrize("name", POSITIVE)
def test_decodes_to_its_json(name: str) -> None:
    payload = (VECTORS / f"{name}.bin").read_bytes()
    want = _content(name)
    assert len(payload) == want["payload_bytes"] and hashlib.sha256(payload).hexdigest() == want["payload_sha256"]
    d = decode(payload)
    assert (d.model_id, d.round) == (want["model"], want["round"])
    assert list(d.tensors) == [t["name"] for t in want["tensors"]]
    for t in want["tensors"]:
        got = d.tensors[t["name"]]
        assert list(got.shape) == t["shape"] and got.dtype == torch.float32
        flat = got.reshape(-1)
        if t["coding"] is None:
            assert t["name"] not in d.masks
        else:
            mask = d.masks[t["name"]].reshape(-1)
            assert torch.nonzero(mask).reshape(-1).tolist() == t["mask_ones"] and len(t["mask_ones"]) == t["ones"]
            assert _bits32(flat[~mask]) == ["00000000"] * int((~mask).sum())  # +0.0 outside the mask
            flat = flat[mask]
        assert _bits32(flat) == t["f32_bits"]
        assert [struct.unpack("<f", bytes.fromhex(b)[::-1])[0] for b in t["f32_bits"]] == t["values"]
        if t["dtype"] == "f2":
            assert [f"{int(v):04x}" for v in flat.numpy().astype("<f2").view("<u2")] == t["f16_bits"]


def _from_json(want: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    tensors, masks = {}, {}
    for t in want["tensors"]:
        values = torch.from_numpy(np.array([int(b, 16) for b in t["f32_bits"]], dtype="<u4").view("<f4").copy())
        n = int(np.prod(t["shape"], dtype=np.int64))
        if t["coding"] is None:
            tensors[t["name"]] = values.reshape(t["shape"])
            continue
        mask = torch.zeros(n, dtype=torch.bool)
        mask[t["mask_ones"]] = True
        dense = torch.zeros(n)
        dense[mask] = values
        tensors[t["name"]], masks[t["name"]] = dense.reshape(t["shape"]), mask.reshape(t["shape"])
    return tensors, masks


@pytest.mark.parametrize("name", POSITIVE)
def test_reencodes_to_the_same_bytes(name: str) -> None:
    want = _content(name)
    tensors, masks = _from_json(want)
    f2 = {t["dtype"] for t in want["tensors"]} == {"f2"}
    again = encode(tensors, model_id=want["model"], round=want["round"], masks=masks,
                   value_dtype="float16" if f2 else "float32")
    assert again == (VECTORS / f"{name}.bin").read_bytes()


@pytest.mark.parametrize("neg", NEGATIVE, ids=[n["name"] for n in NEGATIVE])
def test_negative_is_refused(neg: dict[str, Any]) -> None:
    payload = (VECTORS / neg["file"]).read_bytes()
    with pytest.raises(CodecError) as err:
        decode(payload, **neg["decode_args"])
    assert neg["error"] in str(err.value)


def test_every_check_of_codec_md_has_a_negative_vector() -> None:
    section = (ROOT / "docs" / "codec.md").read_text().split("## 7.", 1)[1].split("## 8.", 1)[0]
    checks = set(re.findall(r"^\| ([DHEVM]\d+) \|", section, re.M))
    assert len(checks) >= 40
    assert checks == {n["about"].split(":")[0] for n in NEGATIVE}


def test_regenerating_gives_the_checked_in_files(tmp_path: Path) -> None:
    written = {p.name for p in generate(tmp_path)}
    held = {p.name for p in VECTORS.iterdir() if p.is_file()}  # secagg/: pfl_edge.secagg.vectors' own
    assert written == held, "docs/vectors holds other files than the generator writes"
    changed = [n for n in sorted(written) if (tmp_path / n).read_bytes() != (VECTORS / n).read_bytes()]
    assert not changed, f"regenerate with python -m pfl_edge.codec.vectors --out docs/vectors: {changed}"


def test_the_worked_examples_in_codec_md_are_the_vectors() -> None:
    doc = (ROOT / "docs" / "codec.md").read_text()
    for letter in "abcde":
        section = doc.split(f"### ({letter})", 1)[1].split("```", 2)[1]
        rows = re.findall(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} ){0,15}[0-9a-f]{2})", section, re.M)
        payload = (VECTORS / f"example_{letter}.bin").read_bytes()
        assert rows and int(rows[-1][0], 16) + 16 >= len(payload)  # the dump runs to the end
        for offset, hexes in rows:
            at = int(offset, 16)
            assert bytes.fromhex(hexes) == payload[at: at + 16], f"codec.md example ({letter}) at {offset}"


# ------------------------------------------------------------------------ an independent decoder from codec.md


class RefError(Exception):
    """A refusal of the reference decoder (its wording is its own)."""


def _ints(*xs: object) -> bool:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in xs)


def _no_dup(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise RefError("H1 duplicate key")
    return dict(pairs)


def _no_const(s: str) -> None:
    raise RefError(f"H1 constant {s}")


def _header(raw: bytes, max_bytes: int, expected: dict[str, list[int]] | None) -> dict[str, Any]:
    try:  # codec.md 2.1: UTF-8 JSON, no duplicate keys, no NaN/Infinity
        h = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dup, parse_constant=_no_const)
    except ValueError as e:
        raise RefError(f"H1 not JSON: {e}") from None
    if not isinstance(h, dict) or set(h) != {"model", "round", "tensors"}:
        raise RefError("H2")
    if not isinstance(h["model"], str):
        raise RefError("H3")
    if not _ints(h["round"]) or h["round"] < 0:
        raise RefError("H4")
    if not isinstance(h["tensors"], list):
        raise RefError("H5")
    if expected is not None and len(h["tensors"]) > len(expected):
        raise RefError("H6")
    return h


Entry = tuple[str, list[int], int, int, int, int, str | None, int, int, int]


def _entry(e: object, max_bytes: int) -> Entry:
    """codec.md 2.1 and section 7, E1 to E15: (name, shape, n, size, offset, nbytes, coding, k, ones, mask_nbytes)."""
    if not isinstance(e, list) or len(e) not in (5, 9):
        raise RefError("E1")
    name, shape, dtype, offset, nbytes = e[:5]
    if not isinstance(name, str):
        raise RefError("E2")
    if not isinstance(shape, list) or len(shape) > 64 or not all(_ints(s) and 0 <= s <= max_bytes for s in shape):
        raise RefError("E3")
    if dtype not in ("f4", "f2"):
        raise RefError("E4")
    n = nonzero = 1
    for s in shape:
        n, nonzero = n * s, nonzero * max(s, 1)
    if nonzero > 2**63 - 1:  # codec.md "Computing n": an empty tensor no runtime can allocate
        raise RefError("E3")
    size = 4 if dtype == "f4" else 2
    if not _ints(offset, nbytes) or offset < 0 or nbytes < 0:
        raise RefError("E5")
    if len(e) == 5:
        if nbytes != n * size:
            raise RefError("E6")
        return name, shape, n, size, offset, nbytes, None, 0, n, 0
    coding, k, ones, mnb = e[5:]
    if coding not in ("bitmap", "rice1", "rice0"):
        raise RefError("E7")
    for check, bad in (("E8", not _ints(k) or not 0 <= k <= (0 if coding == "bitmap" else 62)),
                       ("E9", not _ints(ones) or not 0 <= ones <= n), ("E10", nbytes != ones * size),
                       ("E11", not _ints(mnb) or mnb < 0)):
        if bad:
            raise RefError(check)
    _mask_size(n, coding, k, ones if coding == "rice1" else n - ones, mnb)
    return name, shape, n, size, offset, nbytes, coding, k, ones, mnb


def _mask_size(n: int, coding: str, k: int, c: int, mnb: int) -> None:
    """codec.md section 7, E12 to E15: the mask's length against what its coding can take."""
    if coding == "bitmap":
        if mnb != (n + 7) // 8:
            raise RefError("E12")
    elif c == 0:
        if mnb:
            raise RefError("E13")
    elif k > (n // c).bit_length() + 1:
        raise RefError("E14")
    elif not (c * (k + 1) + 7) // 8 <= mnb <= min((c * (k + 1) + ((n - c) >> k) + 7) // 8, (n + 7) // 8):
        raise RefError("E15")


def _bit(stream: bytes, i: int) -> int:
    return (stream[i >> 3] >> (7 - (i & 7))) & 1  # codec.md: MSB first


def _rice(stream: bytes, c: int, k: int, n: int) -> list[int]:
    """codec.md 5.2: positions of the c coded symbols."""
    if c == 0:
        if stream:
            raise RefError("E13")
        return []
    total = 8 * len(stream)
    if c * k > total:
        raise RefError("M3")
    rems = [sum(_bit(stream, i * k + j) << (k - 1 - j) for j in range(k)) for i in range(c)]
    pos, positions, last, past = c * k, [], -1, False
    for i in range(c):  # the structure first (M3, M4), then the positions (M5), as the listing orders them
        q = 0
        while pos < total and _bit(stream, pos) == 1:
            q, pos = q + 1, pos + 1
        if pos >= total:
            raise RefError("M3 fewer codewords")
        pos += 1
        past = past or q > (n - 1) >> k  # that gap alone points past the end: stop summing, keep scanning
        if not past:
            last = last + (q << k | rems[i]) + 1
            past = last >= n
            positions.append(last)
    if (pos + 7) // 8 != len(stream) or any(_bit(stream, i) == 0 for i in range(pos, total)):
        raise RefError("M4 more codewords or zero padding")
    if past:
        raise RefError("M5 past the end")
    return positions


def _mask(stream: bytes, coding: str, n: int, ones: int, k: int) -> list[int]:
    """The flat indices of the ones."""
    if coding == "bitmap":
        if any(_bit(stream, i) for i in range(n, 8 * len(stream))):
            raise RefError("M1")
        at = [i for i in range(n) if _bit(stream, i)]
        if len(at) != ones:
            raise RefError("M2")
        return at
    if coding == "rice1":
        return _rice(stream, ones, k, n)
    zeros = set(_rice(stream, n - ones, k, n))
    return [i for i in range(n) if i not in zeros]


def _value(raw: bytes, size: int) -> str:
    """One value widened to binary32, as its bits in hex (codec.md 4); NaN/Inf refused."""
    if size == 4:
        bits = int.from_bytes(raw, "little")
        if (bits >> 23) & 0xFF == 0xFF:
            raise RefError("V1")
        return f"{bits:08x}"
    h = int.from_bytes(raw, "little")
    sign, exp, frac = h >> 15, (h >> 10) & 0x1F, h & 0x3FF
    if exp == 0x1F:
        raise RefError("V1")
    v = (frac / 1024.0) * 2.0 ** -14 if exp == 0 else (1 + frac / 1024.0) * 2.0 ** (exp - 15)
    return struct.pack(">f", -v if sign else v).hex()  # exact: every binary16 value is a binary32 value


def _ref_decode(buf: bytes, *, expected: dict[str, list[int]] | None = None, model_id: str | None = None,
                max_bytes: int = 268435456, allow_missing: bool = False) -> dict[str, Any]:
    size = len(buf)
    if size > max_bytes:
        raise RefError("D1")
    if size < 41:
        raise RefError("D2")
    hlen = int.from_bytes(buf[5:9], "little")
    limit = 1048576 if expected is None else 4096 + sum(256 + 6 * len(k) + 21 * len(s) for k, s in expected.items())
    for check, bad in (("D3", buf[:4] != b"PFLE"), ("D4", buf[4] != 1),
                       ("D5", 9 + hlen + 32 > size), ("D6", hlen > limit),
                       ("D7", hashlib.sha256(buf[:-32]).digest() != buf[-32:])):
        if bad:
            raise RefError(check)
    h = _header(buf[9: 9 + hlen], max_bytes, expected)
    data = buf[9 + hlen: -32]
    entries: list[Entry] = []
    end = total = 0
    for listed in h["tensors"]:
        e = _entry(listed, max_bytes)
        total += 4 * e[2]
        for check, bad in (("E16", e[0] in {x[0] for x in entries}), ("E17", e[4] != end), ("E18", total > max_bytes)):
            if bad:
                raise RefError(check)
        end = e[4] + e[5] + e[9]
        entries.append(e)
    if end != len(data):
        raise RefError("D8")
    if model_id is not None and h["model"] != model_id:
        raise RefError("D9")
    if expected is not None:
        got = {e[0]: e[1] for e in entries}
        if set(got) - set(expected) or (set(expected) - set(got) and not allow_missing):
            raise RefError("D10 names")
        if any(list(expected[k]) != s for k, s in got.items()):
            raise RefError("D10 shape")
    tensors = []
    for name, shape, n, vsize, off, nb, coding, k, ones, mnb in entries:
        values = [_value(data[i: i + vsize], vsize) for i in range(off, off + nb, vsize)]
        item: dict[str, Any] = {"name": name, "shape": shape, "dtype": "f4" if vsize == 4 else "f2",
                                "coding": coding, "f32_bits": values}
        if coding is not None:
            item["mask_ones"] = _mask(data[off + nb: off + nb + mnb], coding, n, ones, k)
            item["k"] = k
        tensors.append(item)
    return {"model": h["model"], "round": h["round"], "tensors": tensors}


def _ref_choice(n: int, ones_at: list[int]) -> tuple[str, int]:
    """codec.md 5.3: the coding and k an encoder must pick for a mask with ones at ``ones_at``."""
    ones = set(ones_at)
    best = ((n + 7) // 8, "bitmap", 0)
    for coding, p in (("rice1", sorted(ones)), ("rice0", [i for i in range(n) if i not in ones])):
        c = len(p)
        if c == 0:
            bits, k = 0, 0
        elif 2 * c >= n:
            bits, k = p[-1] + 1, 0
            if bits >= n:
                continue
        else:
            d = [p[0]] + [p[i] - p[i - 1] - 1 for i in range(1, c)]
            centre = 0
            while c * (2 ** (centre + 1) - 1) <= sum(d):
                centre += 1
            bits, k = min((c * (kk + 1) + sum(x >> kk for x in d), kk)
                          for kk in range(max(0, centre - 1), min(62, centre + 1) + 1))
        if (bits + 7) // 8 < best[0]:
            best = ((bits + 7) // 8, coding, k)
    return best[1], best[2]


@pytest.mark.parametrize("name", POSITIVE)
def test_reference_decoder_agrees(name: str) -> None:
    want = _content(name)
    got = _ref_decode((VECTORS / f"{name}.bin").read_bytes())
    assert (got["model"], got["round"]) == (want["model"], want["round"])
    assert len(got["tensors"]) == len(want["tensors"])
    for g, w in zip(got["tensors"], want["tensors"], strict=True):
        assert (g["name"], g["shape"], g["dtype"], g["coding"]) == (w["name"], w["shape"], w["dtype"], w["coding"])
        assert g["f32_bits"] == w["f32_bits"]
        if w["coding"] is not None:
            assert g["mask_ones"] == w["mask_ones"] and g["k"] == w["k"]
            n = int(np.prod(w["shape"], dtype=np.int64))
            assert _ref_choice(n, w["mask_ones"]) == (w["coding"], w["k"])  # the spec's choice is the encoder's


@pytest.mark.parametrize("neg", NEGATIVE, ids=[n["name"] for n in NEGATIVE])
def test_reference_decoder_refuses(neg: dict[str, Any]) -> None:
    """...and for the reason codec.md section 7 gives first (the check named at the start of ``about``)."""
    with pytest.raises(RefError) as err:
        _ref_decode((VECTORS / neg["file"]).read_bytes(), **neg["decode_args"])
    assert str(err.value).split()[0] == neg["about"].split(":")[0]


def _huge_empty() -> bytes:
    """example_a with w's shape eight times 2^28 then 0: n = 0, but no runtime can hold that shape."""
    payload = (VECTORS / "example_a.bin").read_bytes()
    hlen = int.from_bytes(payload[5:9], "little")
    h = json.loads(payload[9: 9 + hlen])
    h["tensors"][0][1:5] = [[1 << 28] * 8 + [0], "f4", 0, 0]
    h["tensors"][1][3] = 0
    head = json.dumps(h, separators=(",", ":")).encode()
    body = b"PFLE\x01" + len(head).to_bytes(4, "little") + head + payload[9 + hlen + 8: -32]
    return body + hashlib.sha256(body).digest()


def test_reference_decoder_refuses_an_unallocatable_empty_shape() -> None:
    with pytest.raises(RefError, match="E3"):
        _ref_decode(_huge_empty())


def test_codec_refuses_an_unallocatable_empty_shape() -> None:
    # found while writing docs/codec.md: it passed every header check, then torch's reshape raised RuntimeError,
    # which the server's and the device's decode paths (catching CodecError only) would not have handled
    with pytest.raises(CodecError, match="multiply past 2"):
        decode(_huge_empty())
