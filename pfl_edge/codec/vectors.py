"""The golden test vectors of the payload format (docs/codec.md), for device teams: each positive vector is a
payload (``NAME.bin``) and its decoded content (``NAME.json``); each negative vector a payload with one fault and
the refusal it must get; ``index.json`` lists them all (``{"format", "positive", "negative"}``). Everything is
derived from fixed seeds with a self-contained generator (splitmix64), so the files are the same on every machine
and every torch/numpy version, and a codec change that alters any byte shows up as a diff.
``python -m pfl_edge.codec.vectors --out docs/vectors`` rewrites them; numpy only, so it runs where torch is not
installed too."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pfl_edge.errors import CodecError, InternalError

from .decoding import decode
from .encoding import encode
from .layout import NDArray
from .vector_faults import Negative, faults, split_payload

__all__ = ["INDEX_FORMAT", "Negative", "Positive", "generate", "index", "main", "negatives", "positives", "render"]

MID = "cnn/10/1x28/deep0"
INDEX_FORMAT = "pfl-edge-vectors/1"  # the "format" of index.json; a change to its shape changes this
_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Positive:
    """A payload the encoder produces from these tensors (and masks), and that every decoder must accept."""

    name: str
    about: str
    tensors: dict[str, NDArray]
    masks: dict[str, NDArray] = field(default_factory=dict)
    round: int = 1
    value_dtype: str = "float32"
    model: str = MID

    def payload(self) -> bytes:
        return encode(self.tensors, model_id=self.model, round=self.round, masks=self.masks,
                      value_dtype="float16" if self.value_dtype == "float16" else "float32")


class _Rng:
    """splitmix64: a few lines that give the same numbers everywhere, unlike library generators' streams."""

    def __init__(self, seed: int) -> None:
        self.state = seed & _M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def values(self, shape: tuple[int, ...], bound: float) -> NDArray:
        """Uniform in [-bound, bound), each a float32 (24 random bits scaled, then rounded once)."""
        flat = [((self.next() >> 40) / float(1 << 23) - 1.0) * bound for _ in range(math.prod(shape))]
        return np.array(flat, dtype=np.float32).reshape(shape)

    def mask(self, shape: tuple[int, ...], ones: int) -> NDArray:
        """Exactly ``ones`` ones at positions from a partial Fisher-Yates shuffle."""
        n = math.prod(shape)
        order = list(range(n))
        for i in range(ones):
            j = i + self.next() % (n - i)
            order[i], order[j] = order[j], order[i]
        flat = np.zeros(n, dtype=np.bool_)
        flat[order[:ones]] = True
        return flat.reshape(shape)


def _at(n: int, ones: list[int]) -> NDArray:
    m = np.zeros(n, dtype=np.bool_)
    m[ones] = True
    return m


def _f32(bits: list[int]) -> NDArray:
    return np.array(bits, dtype="<u4").view("<f4")


def _t(x: Any) -> NDArray:
    return np.array(x, dtype=np.float32)


def _examples() -> list[Positive]:
    """The five worked examples of docs/codec.md section 8, byte for byte."""
    b, c = _at(10, [0, 2, 3, 6, 7, 8]), _at(40, [3, 17, 18, 30])
    d = ~_at(24, [5, 6, 20])
    return [
        Positive("example_a", "docs/codec.md 8(a): two dense f32 tensors",
                 {"w": _t([[1.0], [-2.5]]), "b": _t([0.5])}, round=3),
        Positive("example_b", "docs/codec.md 8(b): a bitmap mask (bitmap ties rice1 at 2 bytes and wins)",
                 {"s": np.arange(1, 11, dtype=np.float32) * b}, {"s": b}),
        Positive("example_c", "docs/codec.md 8(c): a rice1 mask, k=2",
                 {"r": np.arange(1, 41, dtype=np.float32) * c}, {"r": c}),
        Positive("example_d", "docs/codec.md 8(d): a rice0 mask, k=2 (k=2 and k=3 tie on 13 bits)",
                 {"z": np.full(24, 0.25, dtype=np.float32) * d}, {"z": d}),
        Positive("example_e", "docs/codec.md 8(e): an f16 tensor (0.1 rounded to binary16, 65504 the largest)",
                 {"h": _t([[1.0, -2.0], [0.1, 65504.0]])}, round=2, value_dtype="float16"),
    ]


def _edges() -> list[Positive]:
    rng = _Rng(11)
    special = _f32([0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3EAAAAAB, 0x3F800001])
    f16 = _f32([0x33800000, 0x387FC000, 0x38800000, 0x477FE000, 0x80000000, 0x3EAAAAAB, 0x3F801000, 0x3F803000,
                0xC77FE000, 0x33000001, 0x33000000])
    n0 = np.zeros(0, dtype=np.bool_)
    return [
        Positive("dense_f32_shapes", "dense f32: a scalar (shape []), an empty [0, 3] tensor, a 3-D [2, 3, 4] "
                 "tensor (row-major), and -0.0, the smallest subnormal, the largest finite values",
                 {"scalar": _t(-7.5), "empty": np.zeros((0, 3), dtype=np.float32), "cube": rng.values((2, 3, 4), 2.0),
                  "special": special}, round=0),
        Positive("dense_f16", "dense f16: subnormals, the smallest normal, 65504 and -65504, -0.0, and values "
                 "rounded to nearest-even (1/3; the ties 1+2^-11 -> 1 and 1+3*2^-11 -> 1+2^-9; "
                 "just above 2^-25 -> 2^-24; 2^-25 exactly, a tie, -> +0.0)",
                 {"f16": f16, "w": rng.values((3, 5), 1.0)}, round=4, value_dtype="float16"),
        Positive("empty_mask", "sparse with no ones: rice1, k=0, no values and an empty mask stream",
                 {"none": rng.values((20,), 1.0)}, {"none": np.zeros(20, dtype=np.bool_)}),
        Positive("full_mask", "sparse with every bit 1: rice0, k=0, all values and an empty mask stream",
                 {"all": rng.values((2, 10), 1.0)}, {"all": np.ones((2, 10), dtype=np.bool_)}),
        Positive("zero_size_sparse", "a sparse tensor of 0 elements: bitmap of 0 bytes; and a 1-element all-ones "
                 "mask (rice0, empty stream)", {"nothing": np.zeros(0, dtype=np.float32), "one": _t([2.0])},
                 {"nothing": n0, "one": np.ones(1, dtype=np.bool_)}),
        Positive("tie_rice1_over_rice0", "rice1 and rice0 both take 1 byte (8 bits): rice1 wins; within rice1, "
                 "k=1 and k=2 tie on 8 bits: k=1 wins", {"t": _t([0.0] * 8 + [1.0, 2.0])},
                 {"t": _at(10, [8, 9])}),
        Positive("rice1_k0_prefix", "rice1 with 2c >= n (k=0, the 'last one + 1' cost): 40 ones then 24 zeros",
                 {"p": rng.values((64,), 1.0)}, {"p": _at(64, list(range(40)))}),
    ]


def _sparse() -> list[Positive]:
    rng = _Rng(23)
    out = []
    for name, n, ones, about in (
        ("sparse_bitmap", 100, 50, "density 0.5: the bitmap is the shortest"),
        ("sparse_rice1", 1000, 50, "density 0.05: rice1"),
        ("sparse_rice0", 1000, 950, "density 0.95: rice0"),
        ("sparse_rice1_k12", 100000, 20, "20 ones in 100000: rice1 with a 12-bit remainder (k > 8 spans bytes)"),
    ):
        m = rng.mask((n,), ones)
        out.append(Positive(name, about, {"x": rng.values((n,), 1.0) * m}, {"x": m}))
    m2 = rng.mask((6, 7), 9)
    out.append(Positive("sparse_2d_f16", "a sparse [6, 7] tensor in f16: mask indices are row-major flat indices",
                        {"m": rng.values((6, 7), 4.0) * m2}, {"m": m2}, value_dtype="float16"))
    return out


# a slice of the cnn (cnn/10/1x28/deep0): its real tensor names, smaller shapes, so the files stay small
_CNN = {"conv1.0.weight": (8, 1, 5, 5), "conv1.0.bias": (8,), "conv2.0.weight": (4, 8, 5, 5), "conv2.0.bias": (4,),
        "fc1.1.weight": (8, 32), "fc1.1.bias": (8,), "fc2.0.weight": (6, 8), "fc2.0.bias": (6,),
        "head.weight": (10, 6), "head.bias": (10,)}
_DENSITY = {"conv1.0.weight": 0.5, "conv2.0.weight": 0.12, "fc1.1.weight": 0.03, "fc2.0.weight": 0.9,
            "head.weight": 0.6}


def _realistic() -> list[Positive]:
    rng = _Rng(37)
    state = {k: rng.values(s, 1.0 / math.sqrt(math.prod(s[1:]) if len(s) > 1 else 8)) for k, s in _CNN.items()}
    base = {k: v for k, v in state.items() if not k.startswith(("fc2.", "head."))}  # FedPer base with K_P = 2
    masks = {k: rng.mask(s, round(_DENSITY[k] * math.prod(s))) if k in _DENSITY else np.ones(s, dtype=np.bool_)
             for k, s in _CNN.items()}
    sparse = {k: v * masks[k] for k, v in state.items()}
    return [
        Positive("fedper_base", "a FedPer upload: the cnn's base blocks (conv1, conv2, fc1; K_P = 2), sliced "
                 "to small shapes, dense f32", base, round=7),
        Positive("dispfl_sparse", "a DisPFL sparse model: every tensor with its mask (weights at densities "
                 "0.5/0.12/0.03/0.9/0.6 pick bitmap, rice1 and rice0; biases' all-ones masks are empty rice0 "
                 "streams)", sparse, masks, round=12),
    ]


def positives() -> list[Positive]:
    return _examples() + _edges() + _sparse() + _realistic()


def negatives() -> list[Negative]:
    """The negative vectors, each a fault put into one of the worked examples."""
    by = {p.name: p.payload() for p in _examples()}
    return faults(by["example_a"], by["example_b"], by["example_c"], by["example_e"])


def content(p: Positive, payload: bytes) -> dict[str, Any]:
    """What ``payload`` decodes to, written so that every float round-trips: its bits in hex and its decimal."""
    header, _ = split_payload(payload)
    d = decode(payload, arrays="numpy")
    tensors = []
    for entry in header["tensors"]:
        name = entry[0]
        flat = d.tensors[name].reshape(-1)
        item: dict[str, Any] = {"name": name, "shape": entry[1], "dtype": entry[2], "coding": None}
        if name in d.masks:
            ones_at = np.flatnonzero(d.masks[name].reshape(-1))
            flat = flat[ones_at]  # only the values sent, in flat index order
            item.update(coding=entry[5], k=entry[6], ones=entry[7], mask_nbytes=entry[8],
                        mask_ones=[int(i) for i in ones_at])
        item["values"] = [float(v) for v in flat]
        item["f32_bits"] = [f"{int(v):08x}" for v in flat.view(np.uint32)]
        if entry[2] == "f2":
            item["f16_bits"] = [f"{int(v):04x}" for v in flat.astype(np.float16).view(np.uint16)]
        tensors.append(item)
    top = {"vector": p.name, "about": p.about, "format_version": 1, "model": d.model_id, "round": d.round,
           "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(top, indent=1, ensure_ascii=False)[:-2]
    return {"top": top, "tensors": tensors, "text": head + ',\n "tensors": [\n'
            + ",\n".join("  " + json.dumps(t) for t in tensors) + "\n ]\n}\n"}


def index(pos: list[Positive], negs: list[Negative]) -> str:
    """docs/vectors/index.json: every vector, so that a reader finds them all without listing the folder; one
    entry a line, for readable diffs."""
    p_rows = [{"name": p.name, "file": f"{p.name}.bin", "json": f"{p.name}.json", "about": p.about} for p in pos]
    n_rows = [{"name": n.name, "file": f"{n.name}.bin", "about": n.about, "error": n.error,
               "decode_args": n.decode_args} for n in negs]
    lists = [f' "{key}": [\n' + ",\n".join("  " + json.dumps(r) for r in rows) + "\n ]"
             for key, rows in (("positive", p_rows), ("negative", n_rows))]
    return "{\n" + f' "format": {json.dumps(INDEX_FORMAT)},\n' + ",\n".join(lists) + "\n}\n"


_README_HEAD = """# Golden test vectors of the payload format

Generated by `python -m pfl_edge.codec.vectors --out docs/vectors` (fixed seeds; do not edit by hand). The format is
specified in [../codec.md](../codec.md); `tests/pfl_edge/test_golden_vectors.py` checks that pfl-edge decodes every
`.bin` to its `.json`, re-encodes the `.json` to the same bytes, refuses every negative vector, and that an
independent decoder written from codec.md agrees. Secure aggregation's vectors (keys, sealed shares, Shamir, masks,
the quantizer, every message of a secure round) are in [secagg/](secagg/README.md), from their own generator.

Each positive vector is `NAME.bin` (the payload) and `NAME.json`: `model`, `round`, `payload_bytes`, `payload_sha256`
(of the whole file) and `tensors` in header order, each with `name`, `shape`, `dtype` (`f4`/`f2`), `coding` (null for
dense; else `bitmap`/`rice1`/`rice0` with `k`, `ones`, `mask_nbytes` and `mask_ones`, the flat row-major indices
where the mask is 1), and the values sent, in flat index order (dense: all n; sparse: the `ones` values at
`mask_ones`, the decoded tensor being +0.0 elsewhere) as `values` (decimal, exact as a double) and `f32_bits` (the
decoded binary32's bits in hex); f2 tensors also give `f16_bits` (the binary16 bits on the wire).

`index.json` lists every vector, positive and negative: `{"format": "{FORMAT}", "positive": [...],
"negative": [...]}`. A positive entry is `{"name", "file", "json", "about"}`: `file` the `.bin`, `json` its content,
`about` what it exercises (the table below); a negative entry is `{"name", "file", "about", "error", "decode_args"}`
(the second table). Read the vectors from it rather than listing the folder: every `.bin` here is in it once.
"""
_README_NEG = """
## Negative vectors

Each must be refused. The `negative` list of `index.json` gives each with `error`, the substring of pfl-edge's
CodecError message, and `decode_args`, what the receiver knows when it decodes (`expected`: name -> shape;
`model_id`; `max_bytes`, default 268435456; `allow_missing`, default false). The check names (D3, E14, ...) are
those of codec.md section 7; another decoder must refuse the same payloads, in its own words. Each has exactly one
fault and a correct trailer unless the fault is the trailer. Not covered by a file: a header over 1 MiB without
expected tensors (the file would be over 1 MiB; the check is the one `header_too_long` makes), and a round other
than the one an upload is posted for (the server checks that after decoding; it is not the codec's check).
"""


def render(pos: list[Positive], payloads: dict[str, bytes], negs: list[Negative]) -> str:
    """docs/vectors/README.md: what each vector exercises."""
    lines = [_README_HEAD.replace("{FORMAT}", INDEX_FORMAT), "| vector | bytes | tensors (coding) | exercises |",
             "|---|---|---|---|"]
    for p in pos:
        header, _ = split_payload(payloads[p.name])
        what = ", ".join(f"{e[0]} {e[2]}" + (f" {e[5]} k={e[6]}" if len(e) > 5 else "") for e in header["tensors"])
        lines.append(f"| `{p.name}` | {len(payloads[p.name])} | {what} | {p.about} |")
    lines += [_README_NEG, "| vector | fault | decode_args | error contains |", "|---|---|---|---|"]
    lines += [f"| `{n.name}` | {n.about} | `{json.dumps(n.decode_args)}` | `{n.error}` |" for n in negs]
    return "\n".join(lines) + "\n"


def generate(out: Path) -> list[Path]:
    """Writes every vector, its content, index.json and README.md under ``out``, after checking that pfl-edge decodes
    each positive one and refuses each negative one as stated; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    pos, negs = positives(), negatives()
    payloads = {p.name: p.payload() for p in pos}
    files: dict[str, bytes | str] = {}
    for p in pos:
        files[f"{p.name}.bin"] = payloads[p.name]
        files[f"{p.name}.json"] = content(p, payloads[p.name])["text"]
    for n in negs:
        try:
            decode(n.payload, **n.decode_args)
        except CodecError as e:
            if n.error not in str(e):
                raise InternalError(f"negative vector {n.name}: refused with {e!s:.300}, not {n.error!r}") from e
        else:
            raise InternalError(f"negative vector {n.name} decodes")
        files[f"{n.name}.bin"] = n.payload
    files["index.json"] = index(pos, negs)
    files["README.md"] = render(pos, payloads, negs)
    paths = []
    for name, data in files.items():
        path = out / name
        path.write_text(data, encoding="utf-8") if isinstance(data, str) else path.write_bytes(data)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pfl_edge.codec.vectors", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/vectors"), help="folder to (re)write")
    args = parser.parse_args(argv)
    paths = generate(args.out)
    print(f"wrote {len(paths)} files, {sum(p.stat().st_size for p in paths)} bytes, under {args.out}")


if __name__ == "__main__":
    main()
