"""A device bundle: one folder with everything one device needs to join a federation, built on a machine that
can reach the server (``pfl-edge bundle``).

The server's side: ``GET /v1/federations/{fed}/model?profile=NAME`` answers the model card (``pfl_edge.modelcard``)
for that profile, listing its programs; ``GET`` of each program's ``url`` answers its bytes. Both take the admin
bearer token and may answer 503 with ``Retry-After`` while the server exports a program: we wait and ask again.
Every answer is hostile until checked: the card is bounded and validated, a program's name must be a plain file
name, its URL a path on the same server (the admin token never goes elsewhere), its bytes bounded by the card's
count and checked against its sha256.

The files a bundle holds and what each is for: :func:`write_bundle`, and README.txt in every bundle."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from pfl_edge.errors import ConfigError, PflEdgeError
from pfl_edge.modelcard import TRAINING_RUNTIMES, ModelCard, ProgramInfo
from pfl_edge.protocol import API_PREFIX

from .bundle_files import BundleSpec, device_packages, render_files, requirements_text
from .http import Http, ServerUnavailable

__all__ = ["BundleOptions", "build_wheel", "fetch_card", "fetch_program", "training_program", "write_bundle"]

log = logging.getLogger(__name__)

MAX_CARD_BYTES = 8 << 20  # a card lists layers and tensors: well under a megabyte for the models we have
MAX_PROGRAM_BYTES = 2 << 30  # no program is trusted beyond this, whatever its card says
RETRY_AFTER_MAX_S = 60.0  # a Retry-After is followed up to this; longer ones are capped
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class BundleOptions:
    server: str
    federation: str
    profile: str
    out: Path
    admin_token: str
    name: str = ""
    enrol_secret: str | None = None
    ca_file: Path | None = None
    install_dir: str = "/opt/pfl-edge-device"  # where the systemd unit expects the bundle on the device
    user: str = "pfl"  # the unit's non-root user
    client_args: tuple[str, ...] = ()  # more `pfl-edge client` arguments for start.sh (e.g. --data-dir=...)
    wheel: Path | None = None  # a pfl-edge wheel to ship; default: built from this checkout
    training_backend: str | None = None  # torch | executorch | onnxruntime; None: the profile's
    torch_free: bool = False  # a device without torch (numpy arrays, a training program; Python >= 3.10)
    own_images: bool = False  # without torch: pillow too, for the device's own images (with torch it always is)
    wait_s: float = 900.0  # how long to wait for the server (its exports, its restarts)


# --------------------------------------------------------------------------------------------------- fetching
def _get(http: Http, path: str, params: dict[str, str], deadline: float, max_bytes: int, dest: Path) -> int:
    """GET ``path`` into ``dest`` (at most ``max_bytes``), retrying connection failures and 5xx answers (a
    503's Retry-After honoured) until ``deadline``; returns the byte count."""
    delay = 1.0
    while True:
        try:
            with http.client.stream("GET", path, params=params,
                                    headers={"Authorization": f"Bearer {http.token}"}) as r:
                if r.status_code == 200:
                    return _save(r, dest, max_bytes, path)
                why = f"{r.status_code} {_head(r)}"
                if r.status_code < 500 and r.status_code != 429:
                    raise PflEdgeError(f"GET {path}: {why}")
                wait = _retry_after(r.headers.get("retry-after"), delay)
        except httpx.TransportError as e:
            why, wait = f"{type(e).__name__}: {e}", delay
        if time.monotonic() + wait > deadline:
            raise ServerUnavailable(f"GET {path}: no answer within the wait ({why})")
        log.info("GET %s: %s; asking again in %.0f s", path, why, wait)
        time.sleep(wait)
        delay = min(delay * 2, 10.0)


def _head(r: httpx.Response, limit: int = 4096) -> str:
    """The start of an error answer's body, for the message (never more than ``limit`` bytes read)."""
    got = b""
    for chunk in r.iter_bytes(1024):
        got += chunk
        if len(got) >= limit:
            break
    return got[:300].decode(errors="replace")


def _retry_after(value: str | None, default: float) -> float:
    try:
        return min(max(float(value), 0.5), RETRY_AFTER_MAX_S) if value is not None else default
    except ValueError:
        return default


def _save(r: httpx.Response, dest: Path, max_bytes: int, path: str) -> int:
    n = 0
    tmp = dest.with_name(dest.name + ".part")
    with tmp.open("wb") as f:
        for chunk in r.iter_bytes(1 << 20):
            n += len(chunk)
            if n > max_bytes:
                f.close()
                tmp.unlink()
                raise PflEdgeError(f"GET {path}: the answer exceeds {max_bytes} bytes")
            f.write(chunk)
    os.replace(tmp, dest)
    return n


def fetch_card(http: Http, federation: str, profile: str, dest: Path, deadline: float,
               training_backend: str | None = None) -> ModelCard:
    """The model card for ``profile`` (training with ``training_backend``, default the profile's), saved to
    ``dest`` exactly as the server sent it, and validated."""
    params = {"profile": profile, **({"training_backend": training_backend} if training_backend else {})}
    _get(http, f"{API_PREFIX}/federations/{quote(federation, safe='')}/model", params, deadline, MAX_CARD_BYTES,
         dest)
    try:
        card = ModelCard.model_validate_json(dest.read_bytes())
    except ValueError as e:
        raise PflEdgeError(f"the server's model card is not a valid card: {e}") from None
    if card.federation != federation or card.profile != profile:
        raise PflEdgeError(f"asked for the card of federation {federation!r}, profile {profile!r}; got "
                           f"{card.federation!r}, {card.profile!r}")
    return card


def _program_path(federation: str, p: ProgramInfo) -> str:
    if p.url.startswith("/") and not p.url.startswith("//") and ".." not in p.url.split("/"):
        return p.url
    if p.url:
        raise PflEdgeError(f"program {p.file}: its URL {p.url!r} is not a path on this server")
    return f"{API_PREFIX}/federations/{quote(federation, safe='')}/programs/{quote(p.file, safe='')}"


def fetch_program(http: Http, federation: str, p: ProgramInfo, folder: Path, deadline: float) -> Path:
    """One program into ``folder/<file>``, its size and sha256 as the card says (else PflEdgeError)."""
    if not _FILE_RE.match(p.file):
        raise PflEdgeError(f"the card names a program {p.file!r}: not a plain file name")
    if not 0 < p.bytes <= MAX_PROGRAM_BYTES or not re.fullmatch(r"[0-9a-f]{64}", p.sha256):
        raise PflEdgeError(f"program {p.file}: bytes {p.bytes} or sha256 {p.sha256!r} out of bounds")
    dest = folder / p.file
    n = _get(http, _program_path(federation, p), {}, deadline, p.bytes, dest)
    h = hashlib.sha256()
    with dest.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if n != p.bytes or h.hexdigest() != p.sha256:
        dest.unlink()
        raise PflEdgeError(f"program {p.file}: got {n} bytes with sha256 {h.hexdigest()}; the card says "
                           f"{p.bytes} bytes, {p.sha256}")
    return dest


def training_program(card: ModelCard, runtime: str = "executorch") -> ProgramInfo | None:
    """The training program of ``runtime`` the agent runs for this card, if the card has one: the card lists
    the algorithm's own mode first (``Algorithm.device_programs``), -FT's personal program after it."""
    return next((p for p in card.programs if p.kind == "training" and p.runtime == runtime), None)


# --------------------------------------------------------------------------------------------------- the wheel
def build_wheel(dest: Path, wheel: Path | None = None) -> Path:
    """The pfl-edge wheel into ``dest``: ``wheel`` copied, or built (``pip wheel --no-deps``) from a copy of this
    checkout's sources (a copy: the build's own folders stay out of the checkout)."""
    dest.mkdir(parents=True, exist_ok=True)
    if wheel is not None:
        if not wheel.is_file() or wheel.suffix != ".whl":
            raise ConfigError(f"--wheel {wheel} is not a wheel file")
        return Path(shutil.copy2(wheel, dest / wheel.name))
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise ConfigError("pfl-edge is not installed from a checkout here: give a pfl-edge wheel with --wheel")
    with tempfile.TemporaryDirectory(prefix="pfl-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        for pkg in ("pfl_edge", "device_profiles", "export", "edge_runtime", "server"):
            shutil.copytree(root / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                               "-w", str(dest), str(src)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise PflEdgeError(f"pip wheel failed: {proc.stderr[-2000:]}")
    wheels = sorted(dest.glob("pfl_edge-*.whl"))
    if not wheels:
        raise PflEdgeError(f"pip wheel made no pfl_edge wheel in {dest}")
    return wheels[-1]


# --------------------------------------------------------------------------------------------------- the bundle
def write_bundle(opts: BundleOptions) -> Path:
    """Build the bundle in ``opts.out`` (a new or empty folder, made 0700: it holds the enrolment secret). It is
    built in a hidden folder beside it and moved into place whole: a failed build leaves nothing behind."""
    # an unknown profile fails here, before any download
    if opts.torch_free and opts.training_backend == "torch":
        raise ConfigError("a device without torch trains with a program (onnxruntime, the default, or executorch), "
                          "not --training-backend torch")
    if opts.torch_free and opts.training_backend is None:
        opts = dataclasses.replace(opts, training_backend="onnxruntime")
    backend = opts.training_backend or _profile_runtimes(opts.profile)[1]
    out = opts.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # 0700
    try:
        _fill(opts, work, backend)
        if out.exists():
            out.rmdir()
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def _fill(opts: BundleOptions, out: Path, backend: str) -> None:
    programs = out / "model" / "programs"
    programs.mkdir(parents=True)
    http = Http(opts.server, opts.wait_s, ca_file=str(opts.ca_file) if opts.ca_file else None)
    http.token = opts.admin_token
    deadline = time.monotonic() + opts.wait_s
    try:
        card = fetch_card(http, opts.federation, opts.profile, out / "model" / "card.json", deadline,
                          opts.training_backend)
        for p in card.programs:
            fetch_program(http, opts.federation, p, programs, deadline)
    finally:
        http.client.close()
    # the manifest the agent's program backend reads beside a training program (--training-program)
    manifest = [{"path": p.file, **p.details} for p in card.programs]
    (programs / "manifest.json").write_text(json.dumps(manifest, indent=1))
    wheel = build_wheel(out / "wheels", opts.wheel)
    if opts.enrol_secret is not None:
        _write_private(out / "enrol-secret", opts.enrol_secret + "\n")
    if opts.ca_file is not None:
        shutil.copy2(opts.ca_file, out / "ca.pem")
    program = backend in TRAINING_RUNTIMES
    train = training_program(card, backend) if program else None
    if program and train is None:
        log.warning("the card lists no %s training program: the device will fetch one at its start", backend)
    spec = BundleSpec(server=opts.server, federation=opts.federation, profile=opts.profile,
                      name=opts.name or opts.profile, has_secret=opts.enrol_secret is not None,
                      has_ca=opts.ca_file is not None, training_program=train.file if train else None,
                      programs=[p.file for p in card.programs], wheel=wheel.name, install_dir=opts.install_dir,
                      user=opts.user, client_args=opts.client_args, model_id=card.model_id,
                      training_backend=opts.training_backend, torch_free=opts.torch_free,
                      own_images=opts.own_images or not opts.torch_free)
    for rel, (text, mode) in render_files(spec).items():
        (out / rel).write_text(text)
        os.chmod(out / rel, mode)
    # only what this device imports (its profile's runtimes), installed without declared dependencies
    roots = device_packages(_profile_runtimes(opts.profile)[0], backend, torch_free=opts.torch_free,
                            own_images=opts.own_images)
    (out / "requirements.txt").write_text(requirements_text(roots, None))
    (out / "requirements-aarch64.txt").write_text(requirements_text(roots, "aarch64"))


def _profile_runtimes(profile: str) -> tuple[str, str]:
    """The profile's inference runtime and training backend."""
    from device_profiles import get_profile

    prof = get_profile(profile)
    return prof.inference_runtime, prof.training_backend


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)
