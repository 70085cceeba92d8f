"""What a device bundle's install costs: the lean device set (``edge_runtime.bundle_files``: what a device imports,
by profile, installed with ``pip --no-deps``) against pfl-edge's whole declared dependency tree (what a bundle
pinned before), each into a fresh virtual environment, interleaved, from this machine's package sources.

    .venv/bin/python bench/bundle_install.py [--repeats 1] [--out bench/results/bundle_install.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_runtime import bundle_files  # noqa: E402

# name -> (inference runtime or "torch-free", training backend, Python major.minor: None for this interpreter)
SETS: dict[str, tuple[str, str, str | None]] = {
    "lean, torch training (raspberry-pi-4)": ("onnxruntime", "torch", None),
    "lean, ExecuTorch training (phone-mid)": ("executorch", "executorch", None),
    "no torch, ONNX Runtime training (--torch-free), Python 3.10": ("torch-free", "onnxruntime", "3.10"),
    "no torch, ONNX Runtime training (--torch-free), Python 3.11": ("torch-free", "onnxruntime", "3.11"),
    "no torch, ONNX Runtime training (--torch-free), Python 3.12": ("torch-free", "onnxruntime", "3.12"),
    "no torch, ONNX Runtime training (--torch-free), Python 3.13": ("torch-free", "onnxruntime", "3.13"),
    "no torch, ExecuTorch program (--torch-free --training-backend executorch), Python 3.12": (
        "torch-free", "executorch", "3.12"),
}


def _pins(roots: list[str], *, declared: bool) -> list[str]:
    if declared:  # the whole declared tree, as bundles pinned it before
        with mock.patch.dict(bundle_files.RUNTIME_DEPS, clear=True):
            pins = bundle_files.pinned(roots)
    else:
        pins = bundle_files.pinned(roots)
    return [f"{n}=={v}" for n, v in pins if v is not None and n != "pfl-edge"]  # PINNED_ELSEWHERE's included


def _quiet(cmd: list[str]) -> None:
    """pip, its warnings about this machine's package sources kept out of the table (shown if it fails)."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")


def _python(version: str | None) -> str:
    """The interpreter of a set: this one, or CPython ``version`` (on PATH or pyenv's)."""
    import glob
    import shutil

    if version is None:
        return sys.executable
    pyenv = sorted(glob.glob(f"/root/.pyenv/versions/{version}.*/bin/python3"))
    for cand in [shutil.which(f"python{version}"), *pyenv]:
        if cand and subprocess.run([cand, "-c", f"import sys; assert sys.version.startswith('{version}.')"],
                                   capture_output=True).returncode == 0:
            return cand
    raise SystemExit(f"no Python {version} for its set")


def _install(work: Path, pins: list[str], wheel: Path, *, no_deps: bool, python: str = sys.executable
             ) -> dict[str, Any]:
    venv = work / "venv"
    req = work / "requirements.txt"
    torch = [p for p in pins if p.startswith("torch==")]
    req.write_text("\n".join(p for p in pins if not p.startswith("torch==")) + "\n")
    py = venv / "bin" / "python"
    flags = ["--no-deps"] if no_deps else []
    t0 = time.perf_counter()
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    # as install.sh installs: no byte-compiling ahead (Python compiles what the device imports, on first use)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    if torch:  # the torch-free set has none
        _quiet([*pip, "--no-deps", *torch])
    t1 = time.perf_counter()
    _quiet([*pip, *flags, "-r", str(req)])
    _quiet([*pip, "--no-deps", str(wheel)])
    t2 = time.perf_counter()
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                            text=True).stdout
    with_pip = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file())
    # as install.sh leaves it: nothing on a device imports pip or setuptools, nor what bundle_files.UNUSED names
    _quiet([str(py), "-m", "pip", "uninstall", "-y", "-q", "pip", "setuptools"])
    untrimmed = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file())
    site = next(venv.glob("lib/python3*/site-packages"))
    subprocess.run(["sh", "-c", f"site=\"$1\"\n{bundle_files.TRIM_SHELL}", "sh", str(site)], check=True)
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file())
    per = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 2**20
           for d in site.iterdir() if d.is_dir() and not d.name.endswith((".dist-info", "__pycache__"))}
    return {"pins": len(pins), "installed": len(json.loads(listed)), "torch_s": t1 - t0, "rest_s": t2 - t1,
            "total_s": t2 - t0, "venv_mb": size / 2**20, "venv_untrimmed_mb": untrimmed / 2**20,
            "venv_with_pip_mb": with_pip / 2**20,
            "largest_mb": dict(sorted(per.items(), key=lambda kv: -kv[1])[:8])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "bundle_install.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp) / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
                       check=True)
        wheel = next(wheels.glob("pfl_edge-*.whl"))
        cases = {"declared tree (before)": (_pins(["pfl-edge"], declared=True), False)}
        for name, (inference, training, _) in SETS.items():
            free = inference == "torch-free"
            roots = bundle_files.device_packages(inference, training, torch_free=free, own_images=not free)
            if free:  # the bundle's own requirements.txt, markers and all (Python 3.10's older pins)
                text = bundle_files.requirements_text(roots, None)
                cases[name] = ([ln.split("  #")[0] for ln in text.splitlines() if ln and ln[0] != "#"], True)
            else:
                cases[name] = (_pins(roots, declared=False), True)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
        for rep in range(args.repeats):
            order = list(cases) if rep % 2 == 0 else list(reversed(cases))
            for name in order:
                pins, no_deps = cases[name]
                work = Path(tmp) / f"{rep}-{len(runs[name])}-{abs(hash(name)) % 1000}"
                work.mkdir()
                python = _python(SETS[name][2] if name in SETS else None)
                r = _install(work, pins, wheel, no_deps=no_deps, python=python)
                runs[name].append(r)
                print(f"{name}: {r['total_s']:.0f} s ({r['installed']} packages, {r['venv_mb']:.0f} MB)", flush=True)
                subprocess.run(["rm", "-rf", str(work)], check=True)
    base = min(r["total_s"] for r in runs["declared tree (before)"])
    out = {"date": time.strftime("%Y-%m-%d"), "repeats": args.repeats, "runs": runs,
           "best_total_s": {n: min(r["total_s"] for r in rs) for n, rs in runs.items()},
           "vs_declared": {n: min(r["total_s"] for r in rs) / base for n, rs in runs.items()}}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["vs_declared"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
