"""Artefact size against density: what a sparse model costs as a deployable file and on the wire.

For each model and density, masks from DisPFL's ERK rule (``erk_densities`` + ``init_masks``, as the simulator
draws them) are applied to a model's weights, the model is saved as a simulator checkpoint and exported from it:
``.onnx``, ``.pte`` float32 and ``.pte`` int8 (XNNPACK). Against them: the codec's wire payload for the sparse
state (``accounting.payload_bytes`` with the masks, as DisPFL sends it), and the dense float32 state. The gzip'ed
size (level 9) of each artefact stands for what an over-the-air update would ship. The float32 artefacts are
verified against eager PyTorch. Writes bench/results/artefact_size.json and prints a table.

    .venv/bin/python bench/artefact_size.py [--models cnn,mobilenet-v1] [--densities 1,0.8,0.5,0.2,0.1,0.05]
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import torch

from device_profiles import get_profile
from export import lower_executorch, lower_executorch_int8, lower_onnx, package, prepare, verify
from pfl_edge.accounting import payload_bytes
from pfl_edge.checkpoint import ModelSpec, build_model, save_checkpoint
from pfl_edge.sparse import erk_densities, init_masks
from pfl_edge.table import format_table

FORMATS = ("onnx", "pte_fp32", "pte_int8")


def measure(name: str, density: float, tmp: Path) -> dict[str, object]:
    spec = ModelSpec(name, 10, 1, 28)  # Fashion-MNIST's shape: what the simulator's federations train
    torch.manual_seed(0)
    model = build_model(spec)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in model.named_parameters()}
    masks = init_masks(shapes, erk_densities(shapes, density), torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k, m in masks.items():
            state[k].mul_(m)
    # as DisPFL sends it: a mask only for tensors the density leaves sparse (dense ones need none)
    wire_masks = {k: m.bool() for k, m in masks.items() if not bool(m.all())}
    ck = save_checkpoint(tmp / f"{name}-d{density}.safetensors", state, spec)
    prep = prepare(get_profile("raspberry-pi-5"), checkpoint=ck)
    out = tmp / "art"
    onnx_pkg = package(lower_onnx(prep), out)
    pte_pkg = package(lower_executorch(prep), out)
    for p in (onnx_pkg, pte_pkg):
        verify(p)  # the zeros survive export: the artefacts compute what the sparse eager model computes
    # calibration values set scales, not sizes: random inputs do for a size measurement
    calib = torch.randn(64, *prep.input_shape, generator=torch.Generator().manual_seed(1))
    int8_pkg = package(lower_executorch_int8(prep, calib), out)
    files = {"onnx": onnx_pkg.path, "pte_fp32": pte_pkg.path, "pte_int8": int8_pkg.path}
    data = {k: p.read_bytes() for k, p in files.items()}
    row: dict[str, object] = {
        "model": name,
        "density": density,
        "achieved_density": prep.density,
        "parameters": sum(v.numel() for v in state.values()),
        "dense_fp32_state_bytes": sum(v.numel() * 4 for v in state.values()),
        "dense_wire_payload_bytes": payload_bytes(state),
        "sparse_wire_payload_bytes": payload_bytes(state, wire_masks),
        "artefact_bytes": {k: len(v) for k, v in data.items()},
        "artefact_gzip_bytes": {k: len(gzip.compress(v, compresslevel=9, mtime=0)) for k, v in data.items()},
    }
    print(f"{name} d={density}: " + ", ".join(f"{k} {len(v):,} B" for k, v in data.items())
          + f", wire {row['sparse_wire_payload_bytes']:,} B", flush=True)
    return row


def table(rows: list[dict[str, object]]) -> str:
    head = ["model", "density", "dense fp32 state", "wire payload", ".onnx", ".pte fp32", ".pte int8",
            ".onnx gz", ".pte fp32 gz", ".pte int8 gz"]
    body = []
    for r in rows:
        size, gz = r["artefact_bytes"], r["artefact_gzip_bytes"]
        assert isinstance(size, dict) and isinstance(gz, dict)
        body.append([str(r["model"]), f"{r['achieved_density']:.3f}", f"{r['dense_fp32_state_bytes']:,}",
                     f"{r['sparse_wire_payload_bytes']:,}", *(f"{size[k]:,}" for k in FORMATS),
                     *(f"{gz[k]:,}" for k in FORMATS)])
    return format_table([head, *body], right=True, rule=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,mobilenet-v1")
    ap.add_argument("--densities", default="1,0.8,0.5,0.2,0.1,0.05")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "artefact_size.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    densities = [float(d) for d in args.densities.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(m, d, Path(tmp)) for m in args.models.split(",") for d in densities]
    print(table(rows))
    out = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "args": vars(args) | {"out": str(args.out)},
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
