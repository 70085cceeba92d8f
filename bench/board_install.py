"""What a torch-free device costs on an arm64 board, emulated (bench/boards.py: Debian bookworm, Python 3.11, the
Raspberry Pi OS base; trixie, Python 3.13): installing its Python packages, importing the agent, one training step.

Per suite, on the board, in WORK (/opt/board-install; never the tests' /opt/pfl-edge-device):

- install, as a bundle's install.sh does (edge_runtime.bundle_files ``_install``): ``python3 -m venv --clear``,
  ``pip install --no-deps --no-compile -r requirements-aarch64.txt``, then the pfl-edge wheel (built on the host
  from this checkout: ``pip wheel --no-deps --no-build-isolation``) with ``--no-deps --no-compile``, then
  ``pip uninstall -y pip setuptools``. From scratch: PIP_NO_CACHE_DIR=1 (the board's pip cache neither read nor
  written); the indexes are the host's pip configuration's (bench/boards.py), so download time is this machine's
  network and local indexes, not a board's. Timed per step; the venv's size (du) after it, and again after the
  imports below (nothing was byte-compiled ahead: the first import writes the __pycache__ a device keeps).
- which wheel each package came from (its WHEEL tags) and, for every requirement, the version its markers pick
  for the board's Python (evaluated by pip on the board) against the one installed;
- ``import edge_runtime.agent`` (the device's whole module-level import chain) in a fresh interpreter: the first
  (cold: compiles every .py it imports, qemu translates every shared object) and IMPORT_RUNS - 1 more (warm);
- the ONNX training program (mode fedper, batch 32; ``export.lower_onnx_training`` of each ``--models`` model,
  exported on the host for raspberry-pi-4) in an ONNX Runtime session with one intra-op and one inter-op thread:
  random inputs (x float32, y int64 labels 0..9, weight ones, every parameter float32 of its shape times 0.05,
  seed 0), two warm-up calls, then ``--repeats`` timed calls of ``sess.run(outputs, feed)``: median and p95.
  Under emulation the cnn's call takes seconds, mobilenet-v1's some 25 s (``--repeats 5`` keeps it to minutes).

The same driver runs with the same program and inputs on the host (this .venv's onnxruntime), which gives the
emulation's slowdown (board / host) and checks that both computed the same loss; on the host the eager PyTorch step
(one thread: zero_grad, forward, cross_entropy, backward) of the same model and batch is timed for reference.
Under qemu every timing is the emulation's, not a real board's: the ratio says how much slower for this program
(it varies with the program's operators: qemu's emulation of vectorised float code is far slower than of the rest,
so it says nothing of a real Cortex-A72's speed); what carries over is which wheels pip picks (manylinux aarch64,
by CPython tag), whether they import and run (and compute the host's loss), and the venv's size.

    .venv/bin/python bench/board_install.py [--suites bookworm trixie] [--requirements FILE]
                                            [--models cnn [mobilenet-v1]] [--repeats 20]
                                            [--out bench/results/board_install.json]

The default requirements are the torch-free device bundle's requirements-aarch64.txt
(``requirements_text(device_packages("executorch", "onnxruntime", torch_free=True, own_images=False),
"aarch64")``). Needs root, mmdebstrap and qemu-user-static (see bench/boards.py). Progress (pip's own lines
included) goes to stderr. Other work on the host slows every figure: load averages are recorded.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

import boards  # noqa: E402

WORK = "/opt/board-install"  # on the board; the tests' bundle lives in boards.BUNDLE_DIR, which this never touches
SHAPES = {"cnn": (1, 28), "mobilenet-v1": (3, 32)}  # model -> (in_channels, image_size), as bench/train_step.py
PROFILE = "raspberry-pi-4"
BATCH = 32
IMPORT_RUNS = 3
PIP_ENV = {"PIP_NO_CACHE_DIR": "1", "PIP_PROGRESS_BAR": "off"}
IMPORT = ("import time; t = time.perf_counter(); import edge_runtime.agent; "
          "print(time.perf_counter() - t)")

# on the board and on the host alike: the training program in an ONNX Runtime session, random inputs, timed
DRIVER = """\
import json, math, statistics, sys, time
t0 = time.perf_counter()
import numpy as np
import onnxruntime as ort
t1 = time.perf_counter()
program, details_path, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
details = json.loads(open(details_path).read())
opts = ort.SessionOptions()
opts.intra_op_num_threads = 1
opts.inter_op_num_threads = 1
sess = ort.InferenceSession(program, opts, providers=["CPUExecutionProvider"])
t2 = time.perf_counter()
rng = np.random.default_rng(0)
n = int(details["batch_size"])
feed = {"x": rng.standard_normal((n, *details["input_shape"])).astype(np.float32),
        "y": rng.integers(0, 10, n).astype(np.int64), "weight": np.ones(n, np.float32)}
for k in details["inputs"][3:]:
    feed[k] = (0.05 * rng.standard_normal(details["shapes"][k])).astype(np.float32)
outs = details["outputs"]
first = sess.run(outs, feed)
sess.run(outs, feed)
runs = []
for _ in range(repeats):
    t = time.perf_counter()
    sess.run(outs, feed)
    runs.append(time.perf_counter() - t)
runs.sort()
print(json.dumps({"import_s": t1 - t0, "session_s": t2 - t1, "repeats": repeats,
                  "ms_median": 1000 * statistics.median(runs),
                  "ms_p95": 1000 * runs[min(len(runs) - 1, math.ceil(0.95 * len(runs)) - 1)],
                  "ms_min": 1000 * runs[0], "loss": float(first[0]),
                  "grad_abs_sum": float(sum(np.abs(g).sum(dtype=np.float64) for g in first[1:])),
                  "ort": ort.__version__, "numpy": np.__version__, "providers": sess.get_providers()}))
"""

# on the board: the wheel tag and version of each installed distribution (its .dist-info/WHEEL)
TAGS = """\
import json
from importlib import metadata
out = {}
for d in metadata.distributions():
    wheel = d.read_text("WHEEL") or ""
    out[d.metadata["Name"]] = {"version": d.version,
                               "tags": [l.split(":", 1)[1].strip() for l in wheel.splitlines() if l.startswith("Tag:")]}
print(json.dumps(out, sort_keys=True))
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def default_requirements() -> str:
    """The torch-free device bundle's requirements-aarch64.txt, as ``pfl-edge bundle`` writes it from this .venv."""
    from edge_runtime.bundle_files import device_packages, requirements_text

    return requirements_text(device_packages("executorch", "onnxruntime", torch_free=True, own_images=False),
                             "aarch64")


def build_wheel(dest: Path) -> Path:
    """The pfl-edge wheel of this checkout (its working tree, uncommitted edits included)."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dest), str(REPO)], check=True, stdout=sys.stderr)
    (wheel,) = sorted(dest.glob("pfl_edge-*.whl"))
    return wheel


def export_program(model: str, dest: Path) -> dict[str, Any]:
    """The model's ONNX training program (fedper, batch BATCH) for PROFILE, written to dest/MODEL.onnx with its
    details in dest/MODEL.json; returns facts about the export."""
    import device_profiles
    import export
    from pfl_edge.checkpoint import ModelSpec

    ch, size = SHAPES[model]
    t = time.perf_counter()
    prep = export.prepare(device_profiles.get_profile(PROFILE), spec=ModelSpec(model, 10, ch, size))
    lowered = export.lower_onnx_training(prep, mode="fedper", batch_size=BATCH)
    took = time.perf_counter() - t
    (dest / f"{model}.onnx").write_bytes(lowered.program)
    (dest / f"{model}.json").write_text(json.dumps(lowered.details))
    return {"export_s": round(took, 1), "program_kib": round(len(lowered.program) / 1024, 1),
            "spec": {"model": model, "num_classes": 10, "in_channels": ch, "image_size": size},
            "batch_size": BATCH, "mode": "fedper", "profile": PROFILE,
            "parameters": int(sum(math.prod(s) for s in lowered.details["shapes"].values()))}


def eager_step(model: str, repeats: int) -> dict[str, Any]:
    """The eager PyTorch step on the host, one thread: zero_grad, forward, cross_entropy, backward."""
    import torch
    import torch.nn.functional as F

    from pfl_edge.checkpoint import ModelSpec, build_model

    torch.set_num_threads(1)
    ch, size = SHAPES[model]
    torch.manual_seed(0)
    net = build_model(ModelSpec(model, 10, ch, size)).train()
    x, y = torch.randn(BATCH, ch, size, size), torch.randint(0, 10, (BATCH,))

    def step() -> float:
        t = time.perf_counter()
        net.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        return time.perf_counter() - t

    for _ in range(2):
        step()
    return summary([step() for _ in range(repeats)]) | {"torch": torch.__version__, "threads": torch.get_num_threads()}


def summary(runs: list[float]) -> dict[str, Any]:
    s = sorted(runs)
    p95 = s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]
    return {"repeats": len(s), "ms_median": round(1000 * statistics.median(s), 3), "ms_p95": round(1000 * p95, 3),
            "ms_min": round(1000 * s[0], 3)}


def rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 3) if k.endswith("_s") else round(v, 4) if k.startswith("ms_") else v)
            if isinstance(v, float) else v for k, v in d.items()}


def host_driver(driver: Path, program: Path, details: Path, repeats: int, timeout: float) -> dict[str, Any]:
    """DRIVER with this .venv's Python (onnxruntime), one-thread BLAS alike."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(driver), str(program), str(details), str(repeats)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise SystemExit(f"host driver failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return rounded(json.loads(r.stdout))


def timed(root: Path, argv: list[str], timeout: float, what: str, env: dict[str, str] | None = None,
          check: bool = True) -> tuple[float, str]:
    """argv on the board, its wall time seen from the host (unshare, chroot and qemu's start included)."""
    t = time.monotonic()
    r = boards.run(root, argv, timeout=timeout, env=env)
    took = time.monotonic() - t
    if check and r.returncode != 0:
        raise SystemExit(f"{what} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return took, r.stdout


def pip(root: Path, suite: str, args: list[str], timeout: float) -> float:
    """The venv's pip with args, its lines shown on stderr as they come; wall seconds."""
    argv = [f"{WORK}/venv/bin/python", "-m", "pip", *args]
    t = time.monotonic()
    proc = boards.popen(root, argv, env=PIP_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    tail: list[str] = []
    try:
        for line in proc.stdout:
            tail = [*tail[-40:], line]
            log(f"{suite}: pip: {line.rstrip()}")
            if time.monotonic() - t > timeout:
                raise subprocess.TimeoutExpired(argv, timeout)
        rc = proc.wait(max(1.0, timeout - (time.monotonic() - t)))
    except BaseException:
        boards.stop(proc, grace=5)
        raise
    if rc != 0:
        raise SystemExit(f"{suite}: pip {' '.join(args[:3])} failed ({rc}):\n{''.join(tail)}")
    return time.monotonic() - t


def picked(requirements: str, python: str, installed: dict[str, Any]) -> dict[str, Any]:
    """For each requirement line whose markers hold for the board's Python (as pip on the board evaluates them):
    the version it pins against the one installed."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    env = {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
           "platform_machine": "aarch64", "sys_platform": "linux", "platform_system": "Linux"}
    have = {canonicalize_name(k): v["version"] for k, v in installed.items()}
    out: dict[str, Any] = {}
    for line in requirements.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = canonicalize_name(req.name)
        want = next((s.version for s in req.specifier if s.operator == "=="), str(req.specifier))
        out[key] = {"pinned": want, "installed": have.get(key), "ok": have.get(key) == want}
    return out


def bench_suite(suite: str, requirements: str, files: Path, models: list[str], host: dict[str, Any],
                repeats: int, timeout: float) -> dict[str, Any]:
    t = time.monotonic()
    built = not (boards.cache_dir() / f"{suite}-{boards.ARCH}" / "usr/bin/python3").exists()
    log(f"{suite}: rootfs {'(building: some minutes)' if built else '(cached)'}")
    root = boards.rootfs(suite)
    rootfs_s = time.monotonic() - t if built else None
    work = root / WORK.lstrip("/")
    shutil.rmtree(work, ignore_errors=True)
    rootfs_mib = round(boards.du_mib(root), 1)  # the bare board (with the tests' bundle if any), before this venv
    shutil.copytree(files, work)
    wheel = next(work.glob("pfl_edge-*.whl")).name
    load_start = loadavg()
    _, uname = timed(root, ["uname", "-m"], 60, "uname -m")
    _, version = timed(root, ["python3", "-c", "import platform; print(platform.python_version())"], 120, "python3")
    python = version.strip()
    log(f"{suite}: uname -m {uname.strip()}, Python {python}; python3 -m venv --clear")
    steps: dict[str, float] = {}
    steps["venv_s"], _ = timed(root, ["python3", "-m", "venv", "--clear", f"{WORK}/venv"], timeout, "venv")
    log(f"{suite}: venv in {steps['venv_s']:.1f} s; pip install --no-deps --no-compile -r requirements-aarch64.txt")
    steps["requirements_s"] = pip(root, suite, ["install", "--no-deps", "--no-compile", "-r",
                                                f"{WORK}/requirements-aarch64.txt"], timeout)
    log(f"{suite}: requirements in {steps['requirements_s']:.1f} s; the pfl-edge wheel")
    steps["wheel_s"] = pip(root, suite, ["install", "--no-deps", "--no-compile", f"{WORK}/{wheel}"], timeout)
    steps["uninstall_pip_s"] = pip(root, suite, ["uninstall", "-y", "pip", "setuptools"], timeout)
    untrimmed_mib = round(boards.du_mib(work / "venv"), 1)
    # what install.sh removes before its check (edge_runtime.bundle_files.UNUSED), on the board as it does
    site = next((work / "venv" / "lib").glob("python3*/site-packages"))
    from edge_runtime.bundle_files import TRIM_SHELL

    steps["trim_s"], _ = timed(root, ["sh", "-c", f"site=\"$1\"\n{TRIM_SHELL}", "sh",
                                      "/" + str(site.relative_to(root))], timeout, "trim")
    install_s = sum(steps.values())
    venv_mib = round(boards.du_mib(work / "venv"), 1)
    log(f"{suite}: installed in {install_s:.1f} s, venv {venv_mib} MiB; wheel tags")
    py = f"{WORK}/venv/bin/python"
    _, tags = timed(root, [py, f"{WORK}/tags.py"], timeout, "wheel tags")
    installed = json.loads(tags)
    versions = picked(requirements, python, installed)
    wrong = {k: v for k, v in versions.items() if not v["ok"]}
    if wrong:
        log(f"{suite}: WARNING: installed versions differ from the pins: {wrong}")
    log(f"{suite}: numpy {versions.get('numpy')}, onnxruntime {versions.get('onnxruntime')}; import edge_runtime.agent")
    imports = []
    for i in range(IMPORT_RUNS):  # the first cold (compiles, qemu translates every shared object), then warm
        wall, out = timed(root, [py, "-c", IMPORT], timeout, "import edge_runtime.agent")
        imports.append({"wall_s": round(wall, 2), "in_python_s": round(float(out.strip().splitlines()[-1]), 2)})
        log(f"{suite}: import {'cold' if i == 0 else 'warm'}: {imports[-1]}")
    venv_mib_after = round(boards.du_mib(work / "venv"), 1)
    steps_out: dict[str, Any] = {}
    for model in models:
        log(f"{suite}: {model}: ONNX training step on the board ({repeats} calls)")
        wall, out = timed(root, [py, f"{WORK}/driver.py", f"{WORK}/{model}.onnx", f"{WORK}/{model}.json",
                                 str(repeats)], timeout, f"{model} driver",
                          env={"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
        board = rounded(json.loads(out)) | {"wall_s": round(wall, 1)}
        # the host's figure again, right after the board's: load on a shared machine drifts over a run
        h = host_driver(files / "driver.py", files / f"{model}.onnx", files / f"{model}.json", repeats, timeout)
        steps_out[model] = {
            "board_onnx": board, "host_onnx": h, "host_onnx_at_start": host[model]["onnx"],
            "host_eager": host[model]["eager"],
            "ratio_board_host_median": round(board["ms_median"] / h["ms_median"], 1),
            "ratio_board_host_p95": round(board["ms_p95"] / h["ms_p95"], 1),
            "loss_board_minus_host": board["loss"] - h["loss"],
            "grad_abs_sum_rel_diff": abs(board["grad_abs_sum"] - h["grad_abs_sum"]) / max(h["grad_abs_sum"], 1e-30)}
        log(f"{suite}: {model}: board {board['ms_median']:.1f} ms median ({board['ms_p95']:.1f} p95), host "
            f"{h['ms_median']:.2f} ms: x{steps_out[model]['ratio_board_host_median']}; loss board {board['loss']:.6f} "
            f"host {h['loss']:.6f}")
    result = {"uname_m": uname.strip(), "python": python, "rootfs_build_s": rootfs_s and round(rootfs_s, 1),
              "rootfs_mib": rootfs_mib, "install_s": round(install_s, 1),
              "install_steps_s": {k: round(v, 1) for k, v in steps.items()},
              "venv_mib": venv_mib, "venv_mib_untrimmed": untrimmed_mib, "venv_mib_after_imports": venv_mib_after,
              "import_edge_runtime_agent": {"cold": imports[0], "warm": imports[1:]},
              "training_step": steps_out, "requirements_picked": versions,
              "wheel_tags": {k: v["tags"] for k, v in installed.items()},
              "load_avg_start": load_start, "load_avg_end": loadavg()}
    shutil.rmtree(work)  # the board stays as built, for the tests that share it
    log(f"{suite}: done: install {result['install_s']} s, venv {venv_mib} MiB, import cold "
        f"{imports[0]['in_python_s']} s warm {imports[-1]['in_python_s']} s")
    return result


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    qemu = subprocess.run(["qemu-aarch64-static", "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"host": platform.machine(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "kernel": platform.release(), "host_python": platform.python_version(), "qemu": qemu[0] if qemu else None,
            "qemu_cpu": boards.QEMU_CPU, "load_avg_at_start": loadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", nargs="+", default=list(boards.SUITES), choices=list(boards.SUITES))
    ap.add_argument("--requirements", type=Path, help="default: the torch-free device bundle's requirements-aarch64")
    ap.add_argument("--models", nargs="+", default=["cnn"], choices=list(SHAPES),
                    help="training programs to time (default cnn: emulation is slow)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls of each program, per side")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds, per step on the board")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/board_install.json")
    a = ap.parse_args(argv)
    why = boards.prerequisites()
    if why is not None:
        raise SystemExit(why)
    requirements = a.requirements.read_text() if a.requirements else default_requirements()
    report: dict[str, Any] = {
        "command": " ".join([sys.executable, *sys.argv]), "machine": machine(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "requirements": str(a.requirements) if a.requirements else
        "torch-free device bundle's requirements-aarch64.txt (edge_runtime.bundle_files, from this .venv)",
        "requirements_text": requirements, "pip_env": PIP_ENV, "work_dir_on_board": WORK,
        "models": {}, "suites": {}}
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp, "files")
        files.mkdir()
        (files / "requirements-aarch64.txt").write_text(requirements)
        (files / "driver.py").write_text(DRIVER)
        (files / "tags.py").write_text(TAGS)
        wheel = build_wheel(files)
        report["wheel"] = {"name": wheel.name, "kib": round(wheel.stat().st_size / 1024, 1)}
        log(f"built {wheel.name}")
        host: dict[str, Any] = {}
        for model in a.models:
            log(f"{model}: exporting the ONNX training program")
            report["models"][model] = export_program(model, files)
            log(f"{model}: {report['models'][model]}; host ONNX Runtime step")
            onnx = host_driver(files / "driver.py", files / f"{model}.onnx", files / f"{model}.json", a.repeats,
                               a.timeout)
            eager = eager_step(model, a.repeats)
            host[model] = {"onnx": onnx, "eager": eager}
            log(f"{model}: host onnx {onnx['ms_median']:.2f} ms, eager {eager['ms_median']:.2f} ms (medians)")
        report["host"] = host | {"load_avg": loadavg()}
        for suite in a.suites:
            report["suites"][suite] = bench_suite(suite, requirements, files, a.models, host, a.repeats, a.timeout)
            report["machine"]["load_avg_at_end"] = loadavg()
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(report, indent=2) + "\n")  # after each suite: a long run keeps what it has
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
