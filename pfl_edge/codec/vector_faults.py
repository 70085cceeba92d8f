"""The negative golden vectors (see :mod:`pfl_edge.codec.vectors`): valid payloads with one fault each, put in so
that the trailer stays correct (unless the fault is the trailer) and the decoder meets exactly that fault."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Negative", "faults", "split_payload"]


@dataclass(frozen=True)
class Negative:
    """A payload with one fault: ``decode(payload, **decode_args)`` must raise CodecError containing ``error``."""

    name: str
    about: str
    payload: bytes
    error: str
    decode_args: dict[str, Any] = field(default_factory=dict)


def split_payload(payload: bytes) -> tuple[dict[str, Any], bytes]:
    size = struct.unpack_from("<I", payload, 5)[0]
    return json.loads(payload[9: 9 + size]), payload[9 + size: -32]


def _build(header: dict[str, Any] | str, data: bytes, *, version: int = 1, magic: bytes = b"PFLE") -> bytes:
    """A payload with a correct trailer, so the fault put in it is the one a decoder finds."""
    head = (header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))).encode()
    return _raw(head, data, version=version, magic=magic)


def _raw(head: bytes, data: bytes, *, version: int = 1, magic: bytes = b"PFLE") -> bytes:
    body = magic + struct.pack("<BI", version, len(head)) + head + data
    return body + hashlib.sha256(body).digest()


def _edit(payload: bytes, change: Callable[[dict[str, Any]], None], data: bytes | None = None) -> bytes:
    header, old = split_payload(payload)
    change(header)
    return _build(header, old if data is None else data)


def _put(entry: int, start: int, values: list[Any]) -> Callable[[dict[str, Any]], None]:
    def change(h: dict[str, Any]) -> None:
        h["tensors"][entry][start: start + len(values)] = values
    return change


def _framing(a: bytes) -> list[Negative]:
    h, data = split_payload(a)
    nan = data[:4] + b"\x00\x00\xc0\x7f" + data[8:]
    flip = bytearray(a)
    flip[-1] ^= 1
    padded = json.dumps(h, separators=(",", ":")).ljust(5000)  # whitespace after the object is valid JSON
    return [
        Negative("bad_magic", "D3: the magic is not PFLE", _build(h, data, magic=b"PFLX"), "not a pfl-edge payload"),
        Negative("bad_version", "D4: version 2", _build(h, data, version=2), "unsupported payload format version 2"),
        Negative("truncated_short", "D2: 40 bytes, under the fixed 41", a[:40], "payload truncated: 40 bytes"),
        Negative("truncated_header", "D5: header length 0xFFFFFFFF", a[:5] + b"\xff\xff\xff\xff" + a[9:],
                 "payload truncated: header of 4294967295 bytes"),
        Negative("truncated_tail", "D7: the last byte cut off", a[:-1], "sha256 does not match"),
        Negative("corrupt_trailer", "D7: one trailer bit flipped", bytes(flip), "sha256 does not match"),
        Negative("header_too_long", "D6: a 5000-byte header (valid JSON padded with spaces) against the limit "
                 "for the expected tensors w [2, 1] and b [1]: 4096 + 2*256 + 6*2 + 21*3 = 4683",
                 _build(padded, data), "malformed header: 5000 bytes, over the limit of 4683",
                 {"expected": {"w": [2, 1], "b": [1]}}),
        Negative("nan_value", "V1: a NaN (0x7fc00000) among the values, trailer correct", _build(h, nan),
                 "holds NaN or Inf"),
        Negative("data_longer", "D8: 4 bytes of data past the last tensor", _build(h, data + bytes(4)),
                 "tensors cover 12 bytes of data, the payload holds 16"),
    ]


def _header_faults(a: bytes) -> list[Negative]:
    h, data = split_payload(a)
    raw = json.dumps(h, separators=(",", ":"))
    mid = {"model_id": "cnn/10/1x28/linear2"}
    return [
        Negative("duplicate_key", "H1: the key round twice", _build(raw.replace('"round":3', '"round":3,"round":4'),
                 data), "duplicate keys"),
        Negative("nan_round", "H1: round is the constant NaN", _build(raw.replace('"round":3', '"round":NaN'), data),
                 "NaN is not valid here"),
        Negative("negative_round", "H4: round -1", _edit(a, lambda x: x.update(round=-1)), "round -1 is not"),
        Negative("float_round", "H4: round 3.0 (not an integer)", _edit(a, lambda x: x.update(round=3.0)),
                 "round 3.0 is not"),
        Negative("dense_nbytes", "E6: a dense [2, 1] f4 tensor with nbytes 12", _edit(a, _put(0, 4, [12])),
                 "needs 8 bytes, header says 12"),
        Negative("too_many_dims", "E3: a shape of 65 dimensions", _edit(a, _put(0, 1, [[2] + [1] * 64])),
                 "has an invalid shape"),
        Negative("duplicate_name", "E16: two tensors named w", _edit(a, _put(1, 0, ["w"])), "appears twice"),
        Negative("offset_gap", "E17: the second tensor at data offset 12, not 8", _edit(a, _put(1, 3, [12])),
                 "starts at byte 12 of data, expected 8"),
        Negative("decodes_too_big", "E18: a [1000000] tensor against max_bytes 1048576",
                 _edit(a, _put(0, 1, [[1000000], "f4", 0, 4000000])),
                 "would decode to over 1048576 bytes", {"max_bytes": 1048576}),
        Negative("model_mismatch", "D9: a payload for cnn/10/1x28/deep0 decoded by a linear2 model", a,
                 "payload is for model 'cnn/10/1x28/deep0'", mid),
        Negative("unexpected_tensor", "H6: two tensors listed where only w is expected", a,
                 "payload holds unexpected tensors ['b']", {"expected": {"w": [2, 1]}}),
        Negative("missing_tensor", "D10: v is expected and missing (allow_missing false)", a,
                 "payload is missing tensors ['v']", {"expected": {"w": [2, 1], "b": [1], "v": [3]}}),
        Negative("shape_mismatch", "D10: w is [2, 1], the receiver expects [1, 2]", a,
                 "has shape (2, 1), expected (1, 2)", {"expected": {"w": [1, 2], "b": [1]}}),
    ]


def _mask_faults(b: bytes, c: bytes) -> list[Negative]:
    hb, db = split_payload(b)
    hc, dc = split_payload(c)
    return [
        Negative("bitmap_ones_mismatch", "M2: the bitmap has 6 ones, the header says 5 (and sends 5 values)",
                 _edit(b, _put(0, 4, [20, "bitmap", 0, 5]), db[:20] + db[24:]),
                 "bitmap has 6 ones but 5 values were sent"),
        Negative("bitmap_padding", "M1: a padding bit of the bitmap set (b3 81)", _build(hb, db[:-1] + b"\x81"),
                 "bitmap has bits set past the end"),
        Negative("bitmap_length", "E12: a 3-byte bitmap for 10 elements", _edit(b, _put(0, 8, [3]), db + b"\x00"),
                 "has a bitmap of 3 bytes, expected 2"),
        Negative("rice_extra_codeword", "M4: example c's stream of 4 codewords, the header says 3 ones",
                 _edit(c, _put(0, 4, [12, "rice1", 2, 3]), dc[4:]),
                 "holds more than the 3 codewords"),
        Negative("rice_missing_codewords", "M3: example c's stream of 4 codewords, the header says 5 ones",
                 _edit(c, _put(0, 4, [20, "rice1", 2, 5]), dc[:16] + dc[:4] + dc[16:]),
                 "holds fewer than the 5 codewords"),
        Negative("rice_padding_zero", "M4: a zero among the padding bits (7f -> 7e)", _build(hc, dc[:-1] + b"\x7e"),
                 "holds more than the 4 codewords"),
        Negative("rice_past_end", "M5: example c's positions (last 30) in a tensor of 30 elements",
                 _edit(c, _put(0, 1, [[30]])), "points past the end of the tensor"),
        Negative("rice_k_too_large", "E14: k = 6 for 4 codewords over 40 elements (at most 5)",
                 _edit(c, _put(0, 6, [6])), "Rice parameter 6 for 4 codewords over 40 elements; at most 5"),
        Negative("rice_too_long", "E15: a 5-byte stream where at most 3 fit",
                 _edit(c, _put(0, 8, [5]), dc + b"\xff\xff"), "at most 3 bytes fit"),
        Negative("unknown_coding", "E7: coding 'rle'", _edit(c, _put(0, 5, ["rle"])), "has mask coding 'rle'"),
    ]


def _entry_faults(a: bytes, b: bytes, c: bytes) -> list[Negative]:
    """One vector for each remaining check of codec.md section 7, so every check has one."""
    h, data = split_payload(a)
    raw = json.dumps(h, separators=(",", ":"))
    dc = split_payload(c)[1]
    return [
        Negative("over_max_bytes", "D1: a 144-byte payload against max_bytes 100", a,
                 "payload of 144 bytes is over the limit of 100 bytes", {"max_bytes": 100}),
        Negative("header_not_utf8", "H1: a byte 0xff in the model id (not UTF-8)",
                 _raw(raw.encode().replace(b"deep0", b"deep\xff"), data), "not JSON"),
        Negative("extra_header_key", "H2: a fourth member \"x\"", _edit(a, lambda x: x.update(x=1)),
                 "exactly the fields model, round and tensors"),
        Negative("model_not_string", "H3: model 5", _edit(a, lambda x: x.update(model=5)), "model is not a string"),
        Negative("tensors_not_list", "H5: tensors is an object", _edit(a, lambda x: x.update(tensors={})),
                 "tensors is not a list"),
        Negative("entry_six_fields", "E1: an entry of 6 fields", _edit(a, lambda x: x["tensors"][0].append(0)),
                 "must be a list of 5 or 9 fields"),
        Negative("name_not_string", "E2: a tensor named 7", _edit(a, _put(0, 0, [7])), "tensor name 7 is not a string"),
        Negative("unknown_dtype", "E4: dtype f8", _edit(a, _put(0, 2, ["f8"])), "has value dtype 'f8'"),
        Negative("negative_offset", "E5: offset -1", _edit(a, _put(0, 3, [-1])), "has an invalid offset -1"),
        Negative("bitmap_k_nonzero", "E8: a bitmap with k = 1", _edit(b, _put(0, 6, [1])),
                 "has an invalid Rice parameter 1"),
        Negative("ones_over_n", "E9: 11 ones in a tensor of 10", _edit(b, _put(0, 7, [11])),
                 "has an invalid count of ones 11"),
        Negative("values_ones_mismatch", "E10: 6 ones but 20 bytes of f4 values", _edit(b, _put(0, 4, [20])),
                 "has 6 ones in its mask but 20 bytes of f4 values"),
        Negative("negative_mask_length", "E11: mask_nbytes -1", _edit(b, _put(0, 8, [-1])),
                 "has an invalid mask length -1"),
        Negative("rice_stream_without_codewords", "E13: rice1 with 0 ones and a 3-byte stream",
                 _edit(c, _put(0, 4, [0, "rice1", 2, 0]), dc[16:]), "where no codeword is expected"),
        Negative("rice_too_short", "E15: a 1-byte stream for 4 codewords with k = 2 (at least 2 bytes)",
                 _edit(c, _put(0, 8, [1]), dc[:17]), "too short for 4 codewords with k=2"),
    ]


def faults(a: bytes, b: bytes, c: bytes, e: bytes) -> list[Negative]:
    """Every negative vector, from docs/codec.md's examples a (two dense tensors), b (bitmap), c (rice1) and
    e (f16)."""
    he, de = split_payload(e)
    inf = Negative("inf_f16", "V1: an f16 +Inf (0x7c00) in place of 65504, trailer correct",
                   _build(he, de[:6] + b"\x00\x7c"), "holds NaN or Inf")
    return _framing(a) + _header_faults(a) + _mask_faults(b, c) + _entry_faults(a, b, c) + [inf]
