"""The text files of a device bundle (edge_runtime.bundle): device.json, start.sh, install.sh, the systemd unit,
README.txt, and the pinned requirements taken from this environment's installed packages."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from dataclasses import dataclass
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

__all__ = [
    "OLDER_PYTHONS",
    "PINNED_ELSEWHERE",
    "TORCH_FREE_PACKAGES",
    "TRIM_SHELL",
    "UNUSED",
    "BundleSpec",
    "device_packages",
    "min_python",
    "pinned",
    "render_files",
    "requirements_text",
]

# pinned for aarch64 too, but whose aarch64 Linux wheels (or their build on the board) need checking there
CHECK_ON_AARCH64 = ("torch", "executorch", "onnxruntime")


@dataclass(frozen=True)
class BundleSpec:
    server: str
    federation: str
    profile: str
    name: str
    has_secret: bool
    has_ca: bool
    training_program: str | None  # file under model/programs/ passed as --training-program
    programs: list[str]
    wheel: str  # file under wheels/
    install_dir: str
    user: str
    client_args: tuple[str, ...]
    model_id: str
    training_backend: str | None = None  # passed to `pfl-edge client` when set (else the profile's)
    torch_free: bool = False  # no torch on the device: numpy arrays, a training program (ONNX: Python >= 3.10)
    own_images: bool = True  # pillow is installed: the device may read its own images (--data-dir)


def render_files(spec: BundleSpec) -> dict[str, tuple[str, int]]:
    """Relative path -> (text, mode) of every generated file."""
    device = {"format": "pfl-edge-device/1", "server": spec.server, "federation": spec.federation,
              "profile": spec.profile, "name": spec.name, "model_id": spec.model_id,
              "model_card": "model/card.json", "programs": [f"model/programs/{p}" for p in spec.programs],
              "training_program": f"model/programs/{spec.training_program}" if spec.training_program else None,
              "enrol_secret_file": "enrol-secret" if spec.has_secret else None,
              "ca_file": "ca.pem" if spec.has_ca else None, "state_dir": "state",
              "arrays": "numpy" if spec.torch_free else "torch", "own_images": spec.own_images}
    return {"device.json": (json.dumps(device, indent=1) + "\n", 0o644), "start.sh": (_start(spec), 0o755),
            "install.sh": (_install(spec), 0o755), "pfl-edge-device.service": (_unit(spec), 0o644),
            "README.txt": (_readme(spec), 0o644)}


def min_python(spec: BundleSpec) -> tuple[int, int]:
    """The oldest Python the bundle installs on: 3.10 without torch (numpy and ONNX Runtime's wheels: JetPack 6's
    Python), 3.12 for the ExecuTorch program without torch (executorch-numpy-runtime: cp312-abi3 wheels only),
    3.11 with torch (the pinned torch and executorch)."""
    if not spec.torch_free:
        return (3, 11)
    return (3, 12) if spec.training_backend == "executorch" else (3, 10)


def _start(spec: BundleSpec) -> str:
    q = shlex.quote
    args = [f"--server {q(spec.server)}", f"--federation {q(spec.federation)}", f"--profile {q(spec.profile)}",
            f"--name {q(spec.name)}", '--state-dir "$here/state"']
    if spec.has_secret:
        args.append('--enrol-secret-file "$here/enrol-secret"')
    if spec.has_ca:
        args.append('--ca-file "$here/ca.pem"')
    if spec.training_backend:
        args.append(f"--training-backend {q(spec.training_backend)}")
    if spec.torch_free:
        args.append("--arrays numpy")
    if spec.training_program:
        args.append(f'--training-program "$here/model/programs/{spec.training_program}"')
    args += [q(a) for a in spec.client_args]
    joined = " \\\n    ".join(args)
    return f"""#!/bin/sh
# Runs this device: `pfl-edge client` from the bundle's virtual environment (install.sh made it), its state (enrolment,
# token, personal blocks, progress) in ./state. Arguments given to this script are passed on to `pfl-edge client`.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$here/state"
chmod 700 "$here/state"
exec "$here/venv/bin/pfl-edge" client \\
    {joined} \\
    "$@"
"""


#: what no device loads, removed from a bundle's venv by install.sh before its check, as paths (globs) under
#: site-packages: ONNX Runtime's Python tools for model conversion, quantization and transformer optimisation
#: (about 9 MB) and its C library for C and C++ programs, which its Python module does not link (about 34 MB);
#: and every ``tests`` folder of numpy (about 17 MB). Measured in BENCHMARKS.md, "The device on every board".
UNUSED = ("onnxruntime/tools", "onnxruntime/transformers", "onnxruntime/quantization", "onnxruntime/datasets",
          "onnxruntime/capi/libonnxruntime.so*")
UNUSED_TESTS = ("numpy",)
# the shell lines that remove them from "$site" (install.sh; bench/bundle_install.py runs them too)
TRIM_SHELL = "\n".join([
    "rm -rf " + " ".join(f'"$site"/{p}' for p in UNUSED),
    *(f'[ ! -d "$site/{p}" ] || find "$site/{p}" -depth -type d -name tests -exec rm -rf {{}} +'
      for p in UNUSED_TESTS),
])


def _install(spec: BundleSpec) -> str:
    major, minor = min_python(spec)
    # the console script; with torch, the registries too (the simulator's: tqdm), which need torch's models
    script = "client --help" if spec.torch_free else "list"
    return f"""#!/bin/sh
# Creates ./venv (Python {major}.{minor} or newer) and installs the pinned requirements (requirements.txt; on aarch64,
# requirements-aarch64.txt) and the bundled pfl-edge wheel, each without its declared dependencies: the requirements
# list only what this device imports (not the build and export tools some of them declare). Then it checks the
# installation: the device's imports, one training step, each bundled program it can run loaded and run once
# (python -m edge_runtime.bundle_check), so that a missing package shows here, not at the first round. Last, it
# removes pip and setuptools from the venv (nothing on the device imports them: about 22 MB), as it removes before
# the check what no device loads of numpy and ONNX Runtime (below: about 60 MB); run it again to
# change the environment: it starts from an empty venv each time. Nothing is byte-compiled ahead (--no-compile):
# Python compiles what the device imports on first use, not the packages' tests and tools (about 20 MB).
# Run it where the bundle will stay (a virtual environment cannot be moved), as the user that runs the device.
#   PYTHON           the interpreter to build the environment from (default python3)
#   TORCH_INDEX_URL  where torch comes from (default the CPU-only build, x86_64 and aarch64 alike:
#                    https://download.pytorch.org/whl/cpu); empty: pip's own configuration decides (PyPI's
#                    aarch64 and x86_64 torch are CUDA builds, hundreds of MB more, which need NVIDIA's libraries)
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
python="${{PYTHON:-python3}}"
"$python" -c 'import sys; sys.exit(sys.version_info < ({major}, {minor}))' || {{
    echo "install.sh: this bundle needs Python {major}.{minor} or newer; set PYTHON to one" >&2; exit 1; }}
req="$here/requirements.txt"
case "$(uname -m)" in aarch64|arm64) req="$here/requirements-aarch64.txt" ;; esac
"$python" -m venv --clear "$here/venv"
pip="$here/venv/bin/python -m pip"
torch="$(grep '^torch==' "$req" | sed 's/ *#.*//' || true)"
index="${{TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}}"
if [ -n "$torch" ] && [ -n "$index" ]; then
    $pip install --no-deps --no-compile --index-url "$index" "$torch"
elif [ -n "$torch" ]; then
    echo "install.sh: TORCH_INDEX_URL is empty: torch comes from pip's configured index (on PyPI a CUDA build);" \
         "for the CPU build set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
fi
$pip install --no-deps --no-compile -r "$req"
$pip install --no-deps --no-compile "$here/wheels/{spec.wheel}"
# what no device loads, removed before the check (so the check sees the venv as it will run)
site="$("$here/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')"
{TRIM_SHELL}
"$here/venv/bin/python" -m edge_runtime.bundle_check "$here" || {{
    echo "install.sh: the installed environment fails its check (above); venv/ is left for a look" >&2; exit 1; }}
"$here/venv/bin/pfl-edge" {script} >/dev/null
$pip uninstall -y -q pip setuptools >/dev/null 2>&1 || true
echo "installed; run $here/start.sh (or the systemd unit pfl-edge-device.service)"
"""


def _unit(spec: BundleSpec) -> str:
    d = spec.install_dir
    return f"""# systemd unit for this device. The bundle is expected in {d} (set with pfl-edge bundle --install-dir),
# owned by user {spec.user}, with install.sh already run there as that user:
#   sudo cp pfl-edge-device.service /etc/systemd/system/ && sudo systemctl enable --now pfl-edge-device
[Unit]
Description=pfl-edge device {spec.name} (federation {spec.federation}, profile {spec.profile})
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
User={spec.user}
Group={spec.user}
WorkingDirectory={d}
ExecStart={d}/start.sh
Restart=on-failure
RestartSec=10
Environment=PYTHONUNBUFFERED=1 HOME={d}/state MPLCONFIGDIR={d}/state/.matplotlib
NoNewPrivileges=yes
PrivateTmp=yes
ProtectSystem=full
ProtectHome=yes
UMask=0077

[Install]
WantedBy=multi-user.target
"""


def _readme(spec: BundleSpec) -> str:
    python = ".".join(map(str, min_python(spec)))
    progs = "\n".join(f"    model/programs/{p}" for p in spec.programs) or "    (none)"
    return f"""pfl-edge device bundle: device {spec.name!s}, profile {spec.profile}, federation {spec.federation},
server {spec.server}, model {spec.model_id}.

Contents
  device.json              what this device is: server URL, federation, profile, name, and the files below
                           (paths relative to this folder; null where absent)
  enrol-secret             the federation's enrolment secret (mode 0600; kept: it enrols again every 30 days)
  ca.pem                   the CA the server's HTTPS certificate chains to (when the bundle was made with one)
  model/card.json          the model card: input, normalisation, layers, blocks, tensors, the personal part,
                           local training settings and the programs below (docs/model.md in the repository)
  model/programs/          the programs, each checked against the card's sha256:
{progs}
                           *.onnx: ONNX Runtime (inference; -train-: training); *.pte: ExecuTorch. manifest.json beside
                           them: one entry per program ("path" and the card's details), read by the device agent
  requirements.txt         the Python packages this device imports (Linux x86_64), pinned to the versions where the
                           bundle was built; installed without their declared dependencies (see its comments)
  requirements-aarch64.txt the same pins for Linux aarch64 boards (see the comments in it)
  wheels/{spec.wheel}
                           pfl-edge itself
  install.sh               makes ./venv, installs the above and checks it: imports, a training step, each
                           program loaded and run once (PYTHON, TORCH_INDEX_URL: see the script)
  start.sh                 runs the device: pfl-edge client with this bundle's settings; state in ./state
  pfl-edge-device.service  systemd unit (User={spec.user}, WorkingDirectory={spec.install_dir}, Restart=on-failure)

Linux board (Raspberry Pi, Jetson, a PC)
  1. copy this folder to {spec.install_dir}, owned by user {spec.user}: it holds a secret, keep it 0700
  2. as that user: ./install.sh            (needs Python {python}+ and network access to the package index)
  3. try it: ./start.sh -v                 (add the device's data, e.g. ./start.sh --data-dir /srv/images)
  4. as a service: sudo cp pfl-edge-device.service /etc/systemd/system/ &&
     sudo systemctl enable --now pfl-edge-device
  The device enrols once (the secret), then keeps its identity, token and personal blocks in ./state.

Android phone
  The Python parts (install.sh, start.sh, requirements, wheels/, the unit) are not for phones. A phone app reads
  device.json (server, federation, profile, name), enrol-secret and ca.pem, model/card.json, and runs
  model/programs/*.onnx with ONNX Runtime (inference, and training where the card lists an onnxruntime training
  program) or *.pte with ExecuTorch, speaking the protocol in the repository's docs/protocol.md. Ship these files
  inside the app or push them to its private storage.
"""


# --------------------------------------------------------------------------------------------------- requirements
# What a device process imports (pfl-edge client and its import chain: the agent, its HTTP client and MQTT control,
# its own images, torch training; cryptography: its key (pfl_edge.device_key) and secure rounds); the runtimes come
# by profile (device_packages).
AGENT_PACKAGES = ("numpy", "torch", "safetensors", "pydantic", "httpx", "paho-mqtt", "pillow", "tqdm", "cryptography")
# A device without torch (pfl-edge client --arrays numpy): the agent's own imports and ONNX Runtime (training
# through the ONNX program, and evaluation); pillow only for a device's own images (--data-dir), with --own-images;
# ExecuTorch's numpy-only runtime only when it trains with the ExecuTorch program (Python >= 3.12)
TORCH_FREE_PACKAGES = ("numpy", "safetensors", "pydantic", "httpx", "paho-mqtt", "onnxruntime", "cryptography")
# pinned here where it cannot be installed (it has wheels for Python >= 3.12 only): the runtime the programs were
# checked on (bench/train_step_torchfree.py, tests/integration/test_bundle.py)
PINNED_ELSEWHERE = {"executorch-numpy-runtime": "1.4.0"}
# A device on Python 3.10 (JetPack 6; a torch-free bundle installs there) beside the pins of the 3.11+ machine that
# builds the bundle: package -> (its last version with Python 3.10 wheels for Linux x86_64 and aarch64, the pinned
# package that brings it). A pinned package listed here gets its pin for Python >= 3.11 and this one below 3.11;
# the others are what Python 3.10 needs in addition (tomli: pfl_edge.compat's tomllib; exceptiongroup: anyio's).
# tests/integration/test_bundle.py holds every pin of a torch-free bundle to Requires-Python or this table.
OLDER_PYTHON = "3.11"  # the python_version the bundle's own pins start at
OLDER_PYTHONS: dict[str, tuple[str, str]] = {
    "tomli": ("2.5.0", "pydantic"), "exceptiongroup": ("1.3.2", "anyio"), "numpy": ("2.2.6", "numpy"),
    "onnxruntime": ("1.23.2", "onnxruntime"), "pillow": ("12.3.0", "pillow"),
}
# Packages whose declared dependencies are mostly for building or exporting: the ones their runtime imports instead,
# measured in a fresh virtual environment (pip install --no-deps, then import, load and run: torch trains eagerly;
# onnxruntime runs an InferenceSession; executorch loads and runs a training program, forward_backward and an SGD
# step, and an inference program). torch.optim imports torch._dynamo, hence sympy; executorch's runtime pybindings
# import executorch.exir, hence ruamel.yaml, flatbuffers, tabulate and torch's filelock and networkx.
RUNTIME_DEPS: dict[str, tuple[str, ...]] = {
    "torch": ("typing-extensions", "sympy"),
    "onnxruntime": ("numpy",),
    "executorch-numpy-runtime": ("numpy",),
    # cryptography's Rust bindings load cffi's compiled _cffi_backend; pycparser is cffi's for building only
    "cryptography": ("cffi",),
    "cffi": (),
    "executorch": ("torch", "numpy", "typing-extensions", "sympy", "ruamel.yaml", "flatbuffers", "tabulate",
                   "filelock", "networkx"),
}


def device_packages(inference_runtime: str, training_backend: str, *, torch_free: bool = False,
                    own_images: bool = True) -> list[str]:
    """The packages a device of this profile imports: the agent's, onnxruntime when the profile's inference runtime
    is ONNX Runtime or it trains with the ONNX program, executorch when it infers or trains with ExecuTorch;
    without torch, TORCH_FREE_PACKAGES (with executorch-numpy-runtime for the ExecuTorch program, pillow for
    ``own_images``)."""
    if torch_free:
        extra = ["executorch-numpy-runtime"] if training_backend == "executorch" else []
        return [*TORCH_FREE_PACKAGES, *extra, *(["pillow"] if own_images else [])]
    roots = list(AGENT_PACKAGES)
    if "onnxruntime" in (inference_runtime, training_backend):
        roots.append("onnxruntime")
    if "executorch" in (inference_runtime, training_backend):
        roots.append("executorch")
    return roots


def _environment(machine: str | None) -> dict[str, str]:
    env = {k: str(v) for k, v in default_environment().items()}
    if machine is not None:
        env["platform_machine"] = machine
    return env


def _requires(name: str) -> list[Requirement]:
    key = canonicalize_name(name)
    if key in RUNTIME_DEPS:
        return [Requirement(r) for r in RUNTIME_DEPS[key]]
    return [Requirement(r) for r in metadata.distribution(name).requires or []]


def pinned(roots: list[str], machine: str | None = None) -> list[tuple[str, str | None]]:
    """(name, installed version; None when not installed here) of ``roots`` and their dependencies (RUNTIME_DEPS's
    where it has them, else the declared ones), markers evaluated for this machine or for ``machine`` on Linux."""
    env = _environment(machine)
    todo = [(Requirement(r), "") for r in roots]
    versions: dict[str, str | None] = {}
    done: set[tuple[str, str]] = set()  # (package, extra) whose requirements were followed
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        key = canonicalize_name(req.name)
        for want in ("", *sorted(req.extras)):
            if (key, want) in done:
                continue
            done.add((key, want))
            try:
                dist = metadata.distribution(req.name)
            except metadata.PackageNotFoundError:
                versions[key] = PINNED_ELSEWHERE.get(key)
                if key in PINNED_ELSEWHERE:
                    todo += [(r, want) for r in _requires(req.name)]
                    continue
                break
            versions[key] = dist.version.split("+", 1)[0]  # 2.13.0+cpu: the local label is the index's business
            todo += [(r, want) for r in _requires(req.name)]
    return sorted(versions.items())


def left_out(names: list[str]) -> list[str]:
    """The declared dependencies of ``names`` that RUNTIME_DEPS leaves out (extras' aside), for the file's comment."""
    out: set[str] = set()
    for name in names:
        key = canonicalize_name(name)
        if key not in RUNTIME_DEPS or key in PINNED_ELSEWHERE:  # not installed here: nothing declared to leave out
            continue
        for r in metadata.distribution(name).requires or []:
            req = Requirement(r)
            if "extra" not in str(req.marker or ""):
                out.add(canonicalize_name(req.name))
    return sorted(out - set(names))


def requirements_text(roots: list[str], machine: str | None) -> str:
    here = f"{platform.system()} {platform.machine()}, Python {sys.version.split()[0]}"
    pins = pinned(roots, machine)
    names = [n for n, _ in pins]
    head = [f"# What this device imports at run time (pfl-edge client, its profile's runtimes), pinned to what was "
            f"installed where this bundle was built ({here}).",
            "# Installed with pip install --no-deps: only these. Declared dependencies left out (build and export "
            "tools, never imported on a device):",
            "#   " + ", ".join(left_out(names)),
            "# torch: install.sh takes it from the CPU-only index first (TORCH_INDEX_URL)."]
    if machine is not None:
        head += [f"# For Linux {machine}: the same versions, markers evaluated for {machine}. To check there "
                 f"(wheels for {machine} may be missing",
                 "# at these versions, or build from source for a long time): " + ", ".join(CHECK_ON_AARCH64) + ".",
                 "# A package marked 'not installed where built' is needed on this platform only: pin it there."]
    lines = []
    newer, older = f'; python_version >= "{OLDER_PYTHON}"', f'; python_version < "{OLDER_PYTHON}"'
    for name, version in pins:
        if version is None:
            lines.append(f"{name}  # not installed where built")
        else:
            check = "  # check on this platform" if machine is not None and name in CHECK_ON_AARCH64 else ""
            lines.append(f"{name}=={version}{newer if name in OLDER_PYTHONS else ''}{check}")
    lines += [f"{name}=={version}{older}" for name, (version, brought_by) in OLDER_PYTHONS.items()
              if brought_by in names]
    return "\n".join(head + lines) + "\n"
