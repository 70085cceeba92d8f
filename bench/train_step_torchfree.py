"""The training program on a torch-free ExecuTorch runtime, side by side with eager PyTorch and the pip runtime.

``executorch-numpy-runtime`` (PyPI; ExecuTorch 1.3.1's runtime with its portable, optimized and quantized kernel
libraries and the XNNPACK delegate, numpy its only dependency, wheels for CPython >= 3.12) runs a ``.pte`` without
PyTorch. This script measures what a device that installs no torch would pay per step:

- eager: ``zero_grad``, forward, cross-entropy, backward, ``torch.optim.SGD.step`` (momentum 0.9), one thread;
- pip: the shipped gradient program through ``edge_runtime.ExecuTorchBackend.gradients`` (pip ``executorch``,
  which links libtorch);
- torch-free: the same program bytes, the same inputs, in a child process on Python >= 3.12 whose virtual
  environment holds only numpy and ``executorch-numpy-runtime`` (made by this script if missing; ``import torch``
  is checked to fail there). The child times the program call alone; the device's SGD step is ~1 % of a step
  (``bench/train_step.py``) and is left out of all three for a like-for-like program comparison.

Interleaved per repeat (eager, pip, torch-free), medians. Also: the child's gradients against the pip runtime's
on the first batch (max abs difference), and the size of the torch-free environment.

    .venv/bin/python bench/train_step_torchfree.py [--models cnn,mobilenet-v1] [--repeats 7]
                                                   [--python /root/.pyenv/versions/3.12.1/bin/python3.12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from device_profiles import get_profile
from edge_runtime import ExecuTorchBackend
from export import lower_executorch_training, prepare
from pfl_edge.checkpoint import ModelSpec
from pfl_edge.table import format_table

SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32)}
RUNTIME = "executorch-numpy-runtime==1.4.0"

# the child: loads the program once, then answers one line per request with the time of one call (and, on the
# first, the outputs' digest for the comparison); it imports nothing but numpy and the runtime
CHILD = r"""
import json, sys, time
import numpy as np
import executorch_numpy_runtime as en
try:
    import torch  # noqa: F401
    sys.exit("torch is importable in the torch-free environment")
except ImportError:
    pass
program, inputs = sys.argv[1], sys.argv[2]
method = en.Runtime.get().load_program(program).load_method("forward")
arrays = np.load(inputs)
args = [arrays[f"a{i}"] for i in range(len(arrays.files))]
first = method(args)
np.savez(inputs + ".out.npz", *first)
print("ready", flush=True)
for line in sys.stdin:
    t = time.perf_counter()
    method(args)
    print(json.dumps({"ms": 1e3 * (time.perf_counter() - t)}), flush=True)
"""


def find_python() -> str:
    """A working CPython >= 3.12 (pyenv's shims answer 'command not found' for versions not selected)."""
    import glob

    for cand in [shutil.which("python3.12"), shutil.which("python3.13"),
                 *sorted(glob.glob("/root/.pyenv/versions/3.1[2-9]*/bin/python3"))]:
        if cand and subprocess.run([cand, "-c", "import sys; assert sys.version_info >= (3, 12)"],
                                   capture_output=True).returncode == 0:
            return cand
    raise SystemExit("no Python >= 3.12 found: give --python (executorch-numpy-runtime has cp312-abi3 wheels only)")


def torchfree_env(python: str, root: Path) -> Path:
    """The torch-free virtual environment (created once): its interpreter."""
    exe = root / "bin" / "python"
    if not exe.exists():
        subprocess.run([python, "-m", "venv", str(root)], check=True)
        subprocess.run([str(exe), "-m", "pip", "install", "-q", RUNTIME, "numpy"], check=True)
    return exe


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def measure(name: str, exe: Path, args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    ch, size = SHAPES[name]
    prep = prepare(get_profile("phone-high"), spec=ModelSpec(name, 10, ch, size), seed=0)
    t0 = time.perf_counter()
    low = lower_executorch_training(prep, mode="fedper", batch_size=args.batch)
    export_s = time.perf_counter() - t0
    backend = ExecuTorchBackend.from_lowered(low)
    state = {k: v.detach().clone() for k, v in prep.model.state_dict().items()}
    backend.load(state)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, ch, size, size, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    program = tmp / f"{name}.pte"
    program.write_bytes(low.program)
    inputs = tmp / f"{name}.npz"
    feed = [x.numpy(), y.numpy(), np.ones(args.batch, np.float32), *(state[k].numpy() for k in low.details["keys"])]
    np.savez(inputs, **{f"a{i}": a for i, a in enumerate(feed)})
    child = subprocess.Popen([str(exe), "-c", CHILD, str(program), str(inputs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        raise SystemExit(f"the torch-free runtime could not run the {name} program")
    loss, grads = backend.gradients(x, y)
    out = np.load(str(inputs) + ".out.npz")
    theirs = [out[f"arr_{i}"] for i in range(len(out.files))]
    diff = max([abs(float(theirs[0]) - loss)] + [float(np.abs(theirs[1 + i] - grads[k].numpy()).max())
                                                 for i, k in enumerate(low.details["trainable"])])
    model = prep.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def eager() -> float:
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return 1e3 * (time.perf_counter() - t)

    def pip() -> float:
        t = time.perf_counter()
        backend.gradients(x, y)
        return 1e3 * (time.perf_counter() - t)

    def torchfree() -> float:
        child.stdin.write("step\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return float(json.loads(child.stdout.readline())["ms"])  # type: ignore[union-attr]

    times: dict[str, list[float]] = {"eager": [], "pip": [], "torchfree": []}
    for r in range(args.warmup + args.repeats):
        for key, fn in (("eager", eager), ("pip", pip), ("torchfree", torchfree)):
            ms = fn()
            if r >= args.warmup:
                times[key].append(ms)
    child.stdin.close()
    child.wait(timeout=60)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": name, "batch": args.batch, "export_s": export_s, "program_bytes": len(low.program),
            "median_ms": med, "times_ms": times, "max_abs_diff_vs_pip": diff,
            "torchfree_over_eager": med["torchfree"] / med["eager"], "pip_over_eager": med["pip"] / med["eager"],
            "torchfree_over_pip": med["torchfree"] / med["pip"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="cnn,mobilenet-v1")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--python", help="a CPython >= 3.12 (default: the first found)")
    ap.add_argument("--env", type=Path, default=Path(tempfile.gettempdir()) / "pfl-torchfree-runtime")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "train_step_torchfree.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    args.python = args.python or find_python()
    exe = torchfree_env(args.python, args.env)
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        rows = [measure(m, exe, args, Path(d)) for m in args.models.split(",")]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.processor() or
              platform.machine(), "cores": os.cpu_count(), "load_1min": [load0, os.getloadavg()[0]],
              "torch": torch.__version__, "runtime": RUNTIME, "python": args.python,
              "torchfree_env_bytes": du(args.env), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(format_table([["model", "eager ms", "pip program ms", "torch-free program ms", "torch-free / eager",
                         "pip / eager", "max |diff|"]] +
                       [[r["model"], f"{r['median_ms']['eager']:.1f}", f"{r['median_ms']['pip']:.1f}",
                         f"{r['median_ms']['torchfree']:.1f}", f"{r['torchfree_over_eager']:.2f}x",
                         f"{r['pip_over_eager']:.2f}x", f"{r['max_abs_diff_vs_pip']:.1e}"] for r in rows], rule=True))
    print(f"torch-free environment: {result['torchfree_env_bytes'] / 1e6:.0f} MB ({args.env}); results: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
