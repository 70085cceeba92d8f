"""Where an ExecuTorch training step's time goes, operator by operator.

The pip runtime is built without ExecuTorch's event tracer (``enable_etdump=True`` loads, and writing the dump
says "No etdump data found, try rebuilding with EXECUTORCH_ENABLE_EVENT_TRACER"), so ETDump is not available
here. Instead each operator of the training program's joint forward-backward graph (``export.joint_graph``) is
timed on its own: the graph is run once in eager PyTorch to capture every node's real inputs, and each node
becomes a one-operator ExecuTorch program (``to_edge`` -> ``to_executorch``, the same kernels the training program
gets), run on those inputs (median of ``--repeats``). Nodes with the same operator, shapes and arguments share
one program. The sum over operators is set beside the whole program's measured step, so the breakdown's
coverage is visible (view-like operators are copies on their own, sometimes free inside a planned program).
Operators are timed on the runtime's own kernels (the program without a delegate); the shipped program, with
XNNPACK, is timed whole beside it.

    OMP_NUM_THREADS=1 .venv/bin/python bench/train_ops.py [--models cnn,mobilenet-v1] [--convolutions native,matmul]

Writes bench/results/train_ops.json and prints, per model and convolution route, the operators by total time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from device_profiles import get_profile
from export import joint_graph, lower_executorch_training, prepare
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.table import format_table

SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32), "resnet18-gn": (3, 32)}


class _One(torch.nn.Module):
    """One operator, its tensor arguments as the program's inputs, the rest as constants."""

    def __init__(self, op: Any, args: list[Any], kwargs: dict[str, Any], slots: list[Any]) -> None:
        super().__init__()
        self.op, self.args_, self.kwargs_, self.slots = op, args, kwargs, slots

    def forward(self, *tensors: torch.Tensor) -> Any:
        args = [list(a) if isinstance(a, list | tuple) else a for a in self.args_]
        for slot, t in zip(self.slots, tensors, strict=True):
            if isinstance(slot, tuple):
                args[slot[0]][slot[1]] = t
            else:
                args[slot] = t
        return self.op(*args, **self.kwargs_)


def _key(op: Any, args: Any, kwargs: Any) -> str:
    def desc(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return f"T{tuple(a.shape)}{a.dtype}"
        if isinstance(a, list | tuple):
            return "[" + ",".join(desc(b) for b in a) + "]"
        return repr(a)
    return f"{op}|{desc(args)}|{desc(kwargs)}"


def _median_ms(f: Any, repeats: int) -> float:
    f()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def per_operator(ep: Any, inputs: list[torch.Tensor], repeats: int) -> dict[str, dict[str, float]]:
    """{operator: {"ms": total over its nodes, "nodes": count}} for every call in the graph."""
    from executorch.exir import to_edge
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    cache: dict[str, float] = {}
    out: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"ms": 0.0, "nodes": 0})

    class Timed(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
                return result
            args = list(self.map_nodes_to_values(n.args, n))  # type: ignore[arg-type]
            kwargs = dict(self.map_nodes_to_values(n.kwargs, n))  # type: ignore[arg-type]
            key = _key(n.target, args, kwargs)
            if key not in cache:
                tensors, slots = [], []
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        tensors.append(a.detach().contiguous().clone())
                        slots.append(i)
                    elif isinstance(a, list | tuple):
                        for j, b in enumerate(a):
                            if isinstance(b, torch.Tensor):
                                tensors.append(b.detach().contiguous().clone())
                                slots.append((i, j))
                try:
                    prog = to_edge(torch.export.export(_One(n.target, args, kwargs, slots), tuple(tensors),
                                                       strict=False)).to_executorch()
                    module = _load_for_executorch_from_buffer(prog.buffer)
                    cache[key] = _median_ms(lambda: module.forward(tuple(tensors)), repeats)
                except Exception:  # an in-place view op (unsqueeze_) does not export alone: a view, ~free
                    cache[key] = float("nan")
            name = n.target.name()
            if cache[key] == cache[key]:
                out[name]["ms"] += cache[key]
                out[name]["nodes"] += 1
            else:
                out[name]["unprofiled"] = out[name].get("unprofiled", 0) + 1
            return result

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Timed(ep.graph_module).run(*inputs)
    return dict(out)


def measure(name: str, convolutions: str, args: argparse.Namespace) -> dict[str, Any]:
    ch, size = SHAPES[name]
    prep = prepare(get_profile("phone-high"), spec=ModelSpec(name, 10, ch, size), seed=0)
    joint = joint_graph(prep, mode="fedper", batch_size=args.batch, convolutions=convolutions)
    ep = joint.program
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, ch, size, size, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)
    inputs = [x, y, torch.ones(args.batch), *joint.example[3:]]  # the program's inputs: a batch, every weight
    t0 = time.perf_counter()
    ops = per_operator(ep, inputs, args.repeats)
    profile_s = time.perf_counter() - t0

    from edge_runtime import ExecuTorchBackend

    steps = {}
    for delegate in ("none", "xnnpack") if convolutions == "matmul" else ("none",):
        backend = ExecuTorchBackend.from_lowered(lower_executorch_training(
            prep, mode="fedper", batch_size=args.batch, convolutions=convolutions, delegate=delegate))
        backend.load(prep.model.state_dict())
        steps[delegate] = _median_ms(lambda b=backend: b.gradients(x, y), args.repeats)
    step_ms = steps["none"]
    total = sum(v["ms"] for v in ops.values())
    print(f"{name} ({convolutions}): whole program {step_ms:.1f} ms, sum of operators {total:.1f} ms "
          f"({profile_s:.0f} s to profile)", flush=True)
    return {"model": name, "convolutions": convolutions, "batch": args.batch, "program_ms": step_ms,
            "program_xnnpack_ms": steps.get("xnnpack"),
            "operators_ms": total, "operators": dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,mobilenet-v1")
    ap.add_argument("--convolutions", default="native,matmul")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=8, help="operators shown per row of the table")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_ops.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = [measure(m, c, args) for m in args.models.split(",") for c in args.convolutions.split(",")]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread",
              "load_average_1min": {"start": load, "end": os.getloadavg()[0]},
              "args": vars(args) | {"out": str(args.out)}, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    table: list[tuple[str, ...]] = [("model", "convolutions", "program ms", "with XNNPACK", "sum of ops ms",
                                     "top operators")]
    for r in rows:
        top = list(r["operators"].items())[: args.top]
        share = ", ".join(f"{k} {v['ms']:.1f} ({100 * v['ms'] / r['operators_ms']:.0f} %, x{v['nodes']})"
                          for k, v in top)
        xnn = r["program_xnnpack_ms"]
        table.append((r["model"], r["convolutions"], f"{r['program_ms']:.1f}", "-" if xnn is None else f"{xnn:.1f}",
                      f"{r['operators_ms']:.1f}", share))
    print(format_table(table, rule=True))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
