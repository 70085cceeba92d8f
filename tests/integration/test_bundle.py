"""A device bundle end to end: ``pfl-edge bundle`` against a running server, and its start.sh run as a device beside
an ordinary agent device, the federation finishing with the bundle device's updates accepted in every round. Once
with ExecuTorch training (the bundled program; the bundle's venv: this checkout's, linked), once installed by its
own install.sh into a fresh virtual environment that sees neither this checkout nor its .venv (torch training: the
requirements then lack executorch, which would add its runtime's dependencies to the install)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_runtime.bundle_files import device_packages, pinned
from edge_runtime.fleet import Federation, start_server
from pfl_edge.modelcard import ModelCard
from pfl_edge.protocol import API_PREFIX

ROOT = Path(__file__).resolve().parents[2]
CONFIG: dict[str, Any] = dict(algorithm="fedper", model="cnn", dataset="synthetic", partition="pathological:2",
                              clients=2, rounds=2, samples_per_client=48, test_per_client=32, local_epochs=1,
                              batch_size=16, lr=0.05, workers=1, seed=3)
PROFILE = "raspberry-pi-4"  # inference onnxruntime, training torch (its own); executorch with --training-backend
BASE_PYTHON = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
# never on a device: the server's, and executorch's build and export tools (its declared dependencies)
SERVER_ONLY = ("fastapi", "uvicorn", "starlette", "sqlalchemy", "psycopg", "psycopg-binary", "pydantic-settings",
               "matplotlib", "onnx")
BUILD_ONLY = ("coremltools", "pandas", "scikit-learn", "torchao", "hydra-core", "pytorch-tokenizers", "protobuf",
              "jinja2", "fsspec")


def _clean_env(home: Path) -> dict[str, str]:
    """The environment of a machine that has never seen this checkout: no PYTHONPATH, no virtual environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith("PFL_")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))]
    env.update(PATH=os.pathsep.join(path), HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               MPLCONFIGDIR=str(home / ".mpl"))
    return env


def _bundle(fed: Federation, tmp: Path, backend: str | None) -> Path:
    token, secret = tmp / "admin-token", tmp / "enrol-secret"
    token.write_text(fed.admin_token + "\n")
    secret.write_text(fed.secret + "\n")
    out = tmp / "device-bundle"
    cmd = [sys.executable, "-m", "pfl_edge", "bundle", "--profile", PROFILE, "--server", fed.url, "--federation",
           fed.fed, "--out", str(out), "--name", "bundled", "--admin-token-file", str(token), "--enrol-secret-file",
           str(secret), "--client-arg=--partition-id=1", "--wait", "300",
           *(["--training-backend", backend] if backend else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _pins(path: Path) -> dict[str, str]:
    """A requirements file's pins that apply to this Python (a line's marker evaluated here), name -> version."""
    from packaging.requirements import Requirement

    pins = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line.split("  #")[0])
            if req.marker is None or req.marker.evaluate():
                pins[req.name] = str(req.specifier).removeprefix("==")
    return pins


def _requirements(out: Path, executorch: bool) -> None:
    """requirements.txt: the device's packages only, each pinned to this environment's version."""
    pins = _pins(out / "requirements.txt")
    for name, version in pins.items():
        assert version == metadata.version(name).split("+")[0], name
    for name in ("torch", "numpy", "safetensors", "pydantic", "pydantic-core", "httpx", "httpcore", "h11", "anyio",
                 "certifi", "idna", "paho-mqtt", "pillow", "onnxruntime", "sympy", "cryptography"):
        assert name in pins, name
    assert ("executorch" in pins) == executorch and ("flatbuffers" in pins) == executorch
    assert not set(pins) & set(SERVER_ONLY + BUILD_ONLY), sorted(set(pins) & set(SERVER_ONLY + BUILD_ONLY))
    assert sorted(_pins(out / "requirements-aarch64.txt")) == sorted(pins)
    assert "--no-deps --no-compile -r" in (out / "install.sh").read_text()


def _check_contents(out: Path, fed: Federation, executorch: bool) -> None:
    """The bundle's files against the server: the card as served, every program's bytes by the card's sha256."""
    card = ModelCard.model_validate_json((out / "model" / "card.json").read_bytes())
    assert card.federation == fed.fed and card.profile == PROFILE
    kinds = sorted((p.kind, p.runtime) for p in card.programs)
    assert kinds == [("inference", "onnxruntime"), *([("training", "executorch")] if executorch else [])]
    for p in card.programs:
        data = (out / "model" / "programs" / p.file).read_bytes()
        assert len(data) == p.bytes and hashlib.sha256(data).hexdigest() == p.sha256
        served = fed.http.get(p.url, headers={"Authorization": f"Bearer {fed.admin_token}"})
        assert served.status_code == 200 and served.content == data
    device = json.loads((out / "device.json").read_text())
    assert (device["server"], device["federation"], device["profile"], device["name"]) == (
        fed.url, fed.fed, PROFILE, "bundled")
    assert (out / "enrol-secret").read_text().strip() == fed.secret
    assert (out / "enrol-secret").stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700
    unit = (out / "pfl-edge-device.service").read_text()
    assert "User=pfl" in unit and "Restart=on-failure" in unit and "WorkingDirectory=/opt/pfl-edge-device" in unit
    start = (out / "start.sh").read_text()
    if executorch:
        train = next(p.file for p in card.programs if p.kind == "training")
        assert device["training_program"] == f"model/programs/{train}"
        assert f"--training-program \"$here/model/programs/{train}\"" in start and "--training-backend" in start
    else:
        assert device["training_program"] is None and "--training-program" not in start
    _requirements(out, executorch)


def _install(out: Path, home: Path) -> tuple[float, str]:
    """install.sh into the bundle, run from outside the checkout; its seconds and output."""
    if not BASE_PYTHON.exists():
        pytest.skip(f"no base interpreter at {BASE_PYTHON}")
    env = {**_clean_env(home), "PYTHON": str(BASE_PYTHON), "TORCH_INDEX_URL": ""}  # pip's own index config here
    t0 = time.monotonic()
    proc = subprocess.run(["sh", str(out / "install.sh")], cwd=home, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    took = time.monotonic() - t0
    probe = ("import sys, json, importlib.util as u, importlib.metadata as m, pfl_edge, edge_runtime; "
             "print(json.dumps([pfl_edge.__file__, sys.path, sorted(d.metadata['Name'] for d in m.distributions()), "
             f"[n for n in {['fastapi', 'uvicorn', 'sqlalchemy', 'psycopg', 'matplotlib']!r} if u.find_spec(n)]]))")
    where = subprocess.run([str(out / "venv" / "bin" / "python"), "-c", probe], cwd=home, env=_clean_env(home),
                           capture_output=True, text=True, check=True).stdout
    imported, path, dists, server = json.loads(where)
    assert Path(imported).resolve().is_relative_to((out / "venv").resolve()), imported
    assert str(ROOT) not in " ".join(path), path
    assert server == [], server  # the device runs without the server's packages
    pins = list(_pins(out / "requirements.txt"))
    from packaging.utils import canonicalize_name

    venv_own = {"pip", "setuptools"}  # what python -m venv puts there itself (setuptools: up to Python 3.11)
    assert sorted({canonicalize_name(d) for d in dists} - venv_own) == sorted([*pins, "pfl-edge"]), dists
    return took, proc.stdout


def _run_bundle_device(fed: Federation, out: Path, home: Path, log: Path, *, profile: str,
                       extra: list[str] | None = None, timeout_s: float = 240) -> dict[str, Any]:
    """The bundle's start.sh (run from ``home``, outside the checkout) and one ordinary agent device of
    ``profile``, to the end of the federation; the bundle device's record on the server."""
    with log.open("wb") as f:
        device = subprocess.Popen(["sh", str(out / "start.sh"), "-v"], cwd=home, env=_clean_env(home), stdout=f,
                                  stderr=subprocess.STDOUT)
    try:
        fed.start_device(0, profile, extra=extra)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if fed.info()["state"] == "finished" and device.poll() is not None and fed.devices[0].poll() is not None:
                break
            assert device.poll() in (None, 0), log.read_text()[-3000:]
            time.sleep(1.0)
        assert fed.info()["state"] == "finished" and device.returncode == 0, log.read_text()[-3000:]
    finally:
        if device.poll() is None:
            device.terminate()
            device.wait(15)
    devices = fed.get(f"{API_PREFIX}/federations/{fed.fed}/devices")
    bundled: dict[str, Any] = next(d for d in devices if d["name"] == "bundled")
    return bundled


def _run_federation(fed: Federation, out: Path, home: Path, log: Path, executorch: bool) -> None:
    """The bundle device beside an ordinary one, to the end: its updates are accepted in every round."""
    bundled = _run_bundle_device(fed, out, home, log, profile=PROFILE)
    assert bundled["profile"] == PROFILE and bundled["index"] == 1 and bundled["last_round"] == CONFIG["rounds"]
    metrics = fed.get(f"{API_PREFIX}/federations/{fed.fed}/metrics")
    assert [r["round"] for r in metrics["rounds"] if r["round"] >= 1] == list(range(1, CONFIG["rounds"] + 1))
    for rnd in metrics["rounds"]:
        if rnd["round"] >= 1:
            assert rnd["updates"] == 2 and bundled["device_id"] in rnd["devices"], rnd
    if executorch:  # it trained with the bundled ExecuTorch program, not one it fetched (or made) into its state
        fetched = out / "state" / "programs"
        assert not fetched.exists() or not any(fetched.iterdir())


def test_a_bundle_device_takes_part(tmp_path: Path) -> None:
    """The bundle of a device training with torch (its profile's backend: no training program, no executorch in
    its requirements) and its start.sh as a device (its venv: this checkout's, linked)."""
    fed = start_server(tmp_path / "run")
    try:
        fed.create(f"b{int(time.time() * 1000) % 10**9}", CONFIG, deadline_s=300.0)
        out = _bundle(fed, tmp_path, None)
        _check_contents(out, fed, executorch=False)
        (out / "venv").symlink_to(Path(sys.executable).parents[1])
        home = tmp_path / "elsewhere"
        home.mkdir()
        _run_federation(fed, out, home, tmp_path / "bundle-device.log", executorch=False)
    finally:
        fed.close()


@pytest.mark.slow  # a fresh virtual environment with torch and ExecuTorch installed: 1-3 minutes
def test_a_bundle_installs_into_a_fresh_environment_and_takes_part(tmp_path: Path) -> None:
    """install.sh into a fresh virtual environment (the device's requirements only, each without its declared
    dependencies; its check: imports, a torch step, the ONNX program, the ExecuTorch training program), then its
    start.sh as a device training with the bundled ExecuTorch program."""
    t0 = time.monotonic()
    fed = start_server(tmp_path / "run")
    try:
        fed.create(f"b{int(time.time() * 1000) % 10**9}", CONFIG, deadline_s=600.0)
        started = time.monotonic() - t0
        t0 = time.monotonic()
        out = _bundle(fed, tmp_path, "executorch")
        _check_contents(out, fed, executorch=True)
        built = time.monotonic() - t0
        home = tmp_path / "elsewhere"
        home.mkdir()
        installed, said = _install(out, home)
        card = ModelCard.model_validate_json((out / "model" / "card.json").read_bytes())
        files = {p.kind: p.file for p in card.programs}
        assert [ln.split(" (")[0] for ln in said.splitlines() if ln.startswith("ok: ")] == [
            "ok: imports", "ok: torch training step", f"ok: inference {files['inference']}",
            f"ok: training {files['training']}"], said
        t1 = time.monotonic()
        _run_federation(fed, out, home, tmp_path / "bundle-device.log", executorch=True)
        ran = time.monotonic() - t1
        print(f"server up in {started:.0f} s, bundle built and checked in {built:.0f} s, installed in "
              f"{installed:.0f} s, federation ran {ran:.0f} s")
    finally:
        fed.close()
        shutil.rmtree(tmp_path / "device-bundle" / "venv", ignore_errors=True)


# ------------------------------------------------------------------------------- the device's requirements
@pytest.mark.parametrize(("inference", "training"), [("onnxruntime", "torch"), ("onnxruntime", "executorch"),
                                                     ("executorch", "executorch")])
def test_the_requirements_are_what_a_device_imports(inference: str, training: str) -> None:
    """The lean set per profile kind: the agent's packages and their dependencies, the profile's runtimes, each at
    this environment's version; none of the server's or of executorch's build tools."""
    pins = dict(pinned(device_packages(inference, training)))
    assert all(v == metadata.version(n).split("+")[0] for n, v in pins.items()), pins
    agent = {"torch", "typing-extensions", "sympy", "mpmath", "numpy", "safetensors", "pydantic", "pydantic-core",
             "annotated-types", "typing-inspection", "httpx", "httpcore", "h11", "anyio", "certifi", "idna",
             "paho-mqtt", "pillow", "tqdm", "cryptography", "cffi"}
    et = {"executorch", "flatbuffers", "ruamel-yaml", "tabulate", "filelock", "networkx"}
    want = agent | ({"onnxruntime"} if inference == "onnxruntime" else set()) | (et if "executorch" in (
        inference, training) else set())
    assert set(pins) == want
    assert not set(pins) & set(SERVER_ONLY + BUILD_ONLY)


@pytest.mark.parametrize("machine", [None, "aarch64"])
def test_a_torch_free_bundles_requirements_install_on_python_3_10(machine: str | None) -> None:
    """Every pin of a torch-free bundle admits Python 3.10 (its Requires-Python, as installed here), or has an
    older pin for Python < 3.11 (OLDER_PYTHONS), and what the pinned packages need on 3.10 only (a dependency with
    a python_version marker: anyio's exceptiongroup) is pinned for it; no package is pinned twice for one Python.
    (The slow test installs such a bundle on Python 3.10 for real.)"""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from edge_runtime.bundle_files import OLDER_PYTHONS, requirements_text

    text = requirements_text(device_packages("executorch", "onnxruntime", torch_free=True), machine)
    reqs = [Requirement(ln.split("  #")[0]) for ln in text.splitlines() if ln and not ln.startswith("#")]
    for python in ("3.10", "3.11", "3.13"):
        env = {**default_environment(), "python_version": python, "python_full_version": f"{python}.0"}
        names = [r.name for r in reqs if r.marker is None or r.marker.evaluate(env)]
        assert len(names) == len(set(names)), (python, names)
        if python == "3.10":
            assert {"tomli", "exceptiongroup", "numpy", "onnxruntime"} <= set(names)
    on_310 = {r.name: str(r.specifier).removeprefix("==") for r in reqs
              if r.marker is None or r.marker.evaluate({**default_environment(), "python_version": "3.10"})}
    for name, version in on_310.items():
        if name in OLDER_PYTHONS and version == OLDER_PYTHONS[name][0]:
            continue  # the older pin: checked by the slow test's install on Python 3.10
        requires = metadata.distribution(name).metadata.get("Requires-Python") or ""
        assert SpecifierSet(requires).contains("3.10.0"), f"{name}=={version} needs Python {requires}: add it to " \
                                                          "OLDER_PYTHONS"
        for dep in metadata.distribution(name).requires or []:
            r = Requirement(dep)
            if r.marker is not None and "python_version" in str(r.marker) and "extra" not in str(r.marker) \
                    and r.marker.evaluate({**default_environment(), "python_version": "3.10"}) \
                    and not r.marker.evaluate():
                assert r.name in on_310, f"{name} needs {r.name} on Python 3.10"


@pytest.mark.slow  # asks the package index (no download: pip resolves each pin to a wheel by its name)
@pytest.mark.parametrize(("inference", "training", "torch_free", "python"), [
    ("onnxruntime", "torch", False, "3.11"), ("executorch", "executorch", False, "3.11"),
    ("executorch", "onnxruntime", True, "3.10"), ("executorch", "onnxruntime", True, "3.11"),
    ("executorch", "onnxruntime", True, "3.13")])
def test_the_aarch64_requirements_resolve_to_aarch64_wheels(tmp_path: Path, inference: str, training: str,
                                                            torch_free: bool, python: str) -> None:
    """requirements-aarch64.txt of a torch bundle (torch or ExecuTorch training) and of a torch-free one, resolved
    by pip for Linux aarch64 and the board's Python, binary wheels only: every pin has a wheel that installs there
    (manylinux aarch64, or pure Python). torch is resolved from the package index pip is configured with (PyPI's
    aarch64 torch: a CUDA build; install.sh takes the CPU build from download.pytorch.org/whl/cpu, which this
    test cannot reach)."""
    from packaging.requirements import Requirement

    from edge_runtime.bundle_files import requirements_text

    # pip evaluates markers for the interpreter it runs on, not --python-version: the board's lines, chosen here
    env = {"python_version": python, "python_full_version": f"{python}.0", "platform_machine": "aarch64",
           "sys_platform": "linux"}
    text = requirements_text(device_packages(inference, training, torch_free=torch_free), "aarch64")
    reqs = [Requirement(ln.split("  #")[0]) for ln in text.splitlines() if ln and ln[0] != "#"]
    mine = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
    req = tmp_path / "requirements-aarch64.txt"
    req.write_text("".join(f"{r.name}{r.specifier}\n" for r in mine))
    report = tmp_path / "report.json"
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_aarch64", "manylinux_2_27_aarch64",
                                             "manylinux_2_17_aarch64", "manylinux2014_aarch64")]
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
                           "--only-binary=:all:", *platforms, f"--python-version={python}", "--implementation=cp",
                           "--target", str(tmp_path / "t"), "-r", str(req), "--report", str(report), "-q"],
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0 and ("Could not fetch" in proc.stderr or "NewConnectionError" in proc.stderr):
        pytest.skip(f"the package index cannot be reached: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {r.name.lower().replace("_", "-") for r in mine}
    wheels = {i["metadata"]["name"].lower().replace("_", "-").replace(".", "-"):
              i["download_info"]["url"].rsplit("/", 1)[-1] for i in json.loads(report.read_text())["install"]}
    assert set(wheels) == {w.replace(".", "-") for w in want}, sorted(set(wheels) ^ want)
    for name, wheel in wheels.items():
        tags = wheel.removesuffix(".whl").split("-")[-1]
        assert "aarch64" in tags or tags == "any", (name, wheel)
        if tags != "any":
            assert f"cp{python.replace('.', '')}" in wheel or "abi3" in wheel, (name, wheel)


def test_the_install_check_names_a_missing_module(tmp_path: Path) -> None:
    """install.sh's check, in an environment where paho-mqtt is missing: it fails and says which module."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'paho':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from edge_runtime.bundle_check import main\n"
            f"sys.exit(main([{str(tmp_path)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and "module 'paho' is missing" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------- a hostile or busy server
def _http(handler: Any) -> Any:
    import httpx

    from edge_runtime.http import Http

    http = Http("http://127.0.0.1:9", 30.0)
    http.client = httpx.Client(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(handler))
    http.token = "admin-token"
    return http


def _info(data: bytes, **over: Any) -> Any:
    from pfl_edge.modelcard import ProgramInfo

    fields: dict[str, Any] = dict(file="m.pte", kind="training", runtime="executorch", mode="fedper",
                                  sha256=hashlib.sha256(data).hexdigest(), bytes=len(data),
                                  url="/v1/federations/f/programs/m.pte")
    return ProgramInfo(**{**fields, **over})


def test_a_program_is_fetched_after_503_retry_after_and_checked(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from edge_runtime import bundle

    data = os.urandom(5000)
    calls: list[httpx.Request] = []
    slept: list[float] = []
    monkeypatch.setattr(bundle.time, "sleep", slept.append)

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        if len(calls) < 3:
            return httpx.Response(503, headers={"Retry-After": "7"}, json={"detail": "exporting"})
        return httpx.Response(200, content=data)

    got = bundle.fetch_program(_http(handler), "f", _info(data), tmp_path, time.monotonic() + 60)
    assert got.read_bytes() == data and slept == [7.0, 7.0]
    assert all(c.headers["authorization"] == "Bearer admin-token" and c.url.path == "/v1/federations/f/programs/m.pte"
               for c in calls)


@pytest.mark.parametrize("served", ["other", "longer", "shorter"])
def test_a_program_unlike_its_card_is_refused(tmp_path: Path, served: str) -> None:
    import httpx

    from edge_runtime import bundle
    from pfl_edge.errors import PflEdgeError

    data = os.urandom(4000)
    body = {"other": os.urandom(4000), "longer": data + b"x", "shorter": data[:-1]}[served]
    http = _http(lambda req: httpx.Response(200, content=body))
    with pytest.raises(PflEdgeError, match="bytes"):
        bundle.fetch_program(http, "f", _info(data), tmp_path, time.monotonic() + 60)
    assert list(tmp_path.iterdir()) == []  # nothing of it is left to be mistaken for the program


@pytest.mark.parametrize(("field", "value"), [("file", "../start.sh"), ("file", ".hidden"),
                                              ("url", "https://elsewhere.example/p.pte"), ("url", "//evil/p.pte"),
                                              ("url", "/v1/../../etc/passwd")])
def test_a_card_cannot_name_another_file_or_host(tmp_path: Path, field: str, value: str) -> None:
    import httpx

    from edge_runtime import bundle
    from pfl_edge.errors import PflEdgeError

    calls: list[httpx.Request] = []
    def handler(req: httpx.Request) -> httpx.Response:
        calls.append(req)
        return httpx.Response(200, content=b"x")

    http = _http(handler)
    with pytest.raises(PflEdgeError):
        bundle.fetch_program(http, "f", _info(b"x", **{field: value}), tmp_path, time.monotonic() + 60)
    assert calls == []  # the admin token went nowhere


def test_a_failed_bundle_leaves_nothing(tmp_path: Path) -> None:
    from edge_runtime.bundle import BundleOptions, write_bundle
    from edge_runtime.fleet import free_port
    from edge_runtime.http import ServerUnavailable

    opts = BundleOptions(server=f"http://127.0.0.1:{free_port()}", federation="f", profile=PROFILE,
                         out=tmp_path / "b", admin_token="t", enrol_secret="s", wait_s=1.5)
    with pytest.raises(ServerUnavailable):
        write_bundle(opts)
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor its half-built folder (with the secret)


# ------------------------------------------------------------------------------- a device without torch
def _python(major: int, minor: int) -> str | None:
    """A CPython ``major.minor`` interpreter (on PATH, or pyenv's), or None."""
    import glob

    for cand in [shutil.which(f"python{major}.{minor}"),
                 *sorted(glob.glob(f"/root/.pyenv/versions/{major}.{minor}.*/bin/python{major}.{minor}"))]:
        if cand and subprocess.run([cand, "-c", f"import sys; assert sys.version_info[:2] == ({major}, {minor})"],
                                   capture_output=True).returncode == 0:
            return cand
    return None


TORCH_FREE: dict[str, dict[str, Any]] = {
    "fedper": dict(algorithm="fedper", kp=1),
    "dispfl": dict(algorithm="dispfl", densities=(0.5, 0.7), topology="full"),
}


@pytest.mark.slow  # installs numpy and onnxruntime into a fresh Python 3.10 venv: about a minute
@pytest.mark.needs_fmnist
def test_a_torch_free_bundle_takes_part_in_fedper_and_dispfl(tmp_path: Path) -> None:
    """pfl-edge bundle --torch-free, installed by its install.sh on Python 3.10 (JetPack 6's) into a fresh virtual
    environment where ``import torch`` and ``import executorch`` fail; its check (imports, an ONNX training
    program step on numpy arrays, the ONNX programs), then its start.sh as a device beside a torch device, to the
    end of a FedPer and of a DisPFL federation (one venv, two bundles). Each time it deploys the simulator's model
    for its slot; its environment's size is printed."""
    from safetensors.numpy import load_file

    from pfl_edge.checkpoint import load_checkpoint
    from pfl_edge.federation import FederationConfig
    from pfl_edge.sim import simulate

    py = _python(3, 10)
    if py is None:
        pytest.skip("no Python 3.10 here (pyenv's or on PATH)")
    venv: Path | None = None
    for algorithm, extra in TORCH_FREE.items():
        config = {**CONFIG, "dataset": "fashion-mnist", **extra}
        run = tmp_path / algorithm
        fed = start_server(run / "run")
        try:
            fed.create(f"f{int(time.time() * 1000) % 10**9}", config, deadline_s=600.0)
            token, secret = run / "admin-token", run / "enrol-secret"
            token.write_text(fed.admin_token + "\n")
            secret.write_text(fed.secret + "\n")
            out = run / "device-bundle"
            proc = subprocess.run([sys.executable, "-m", "pfl_edge", "bundle", "--profile", "phone-mid", "--server",
                                   fed.url, "--federation", fed.fed, "--out", str(out), "--name", "bundled",
                                   "--admin-token-file", str(token), "--enrol-secret-file", str(secret),
                                   "--client-arg=--partition-id=1", "--wait", "400", "--torch-free"],
                                  capture_output=True, text=True, timeout=500, check=False)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "--arrays numpy" in (out / "start.sh").read_text()
            card = ModelCard.model_validate_json((out / "model" / "card.json").read_bytes())
            train = [p for p in card.programs if p.kind == "training"]
            assert [(p.runtime, p.file.endswith(".onnx")) for p in train] == [("onnxruntime", True)]
            assert f'--training-program "$here/model/programs/{train[0].file}"' in (out / "start.sh").read_text()
            pins = (out / "requirements.txt").read_text()
            assert "\nonnxruntime==" in pins and 'tomli==2.5.0; python_version < "3.11"' in pins
            for absent in ("torch", "executorch", "executorch-numpy-runtime", "pillow", "sympy"):
                assert f"\n{absent}==" not in pins, absent
            home = run / "elsewhere"
            home.mkdir()
            if venv is None:  # install once, from the package index, with the bundle's own install.sh
                env = {**_clean_env(home), "PYTHON": py}
                t0 = time.monotonic()
                inst = subprocess.run(["sh", str(out / "install.sh")], cwd=home, env=env, capture_output=True,
                                      text=True, timeout=900, check=False)
                assert inst.returncode == 0, (inst.stdout[-2000:], inst.stderr[-3000:])
                said = [" ".join(ln.split()[:2]) for ln in inst.stdout.splitlines() if ln.startswith("ok: ")]
                assert said == ["ok: imports", "ok: program", "ok: inference", "ok: training"], inst.stdout
                venv = out / "venv"
                for module in ("torch", "executorch", "executorch_numpy_runtime"):
                    probe = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {module}"],
                                           capture_output=True, env=_clean_env(home), cwd=home)
                    assert probe.returncode != 0 and f"No module named '{module}'".encode() in probe.stderr
                version = subprocess.run([str(venv / "bin" / "python"), "-c",
                                          "import sys; print(sys.version_info[:2])"],
                                         capture_output=True, text=True, check=True).stdout.strip()
                assert version == "(3, 10)", version
                size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
                print(f"torch-free venv (Python 3.10): {size / 2**20:.0f} MiB, installed in "
                      f"{time.monotonic() - t0:.0f} s")
                # issue 47: under 150 MB, with what install.sh removes (bundle_files.UNUSED) gone
                assert size < 150 * 2**20, size / 2**20
                site = next(venv.glob("lib/python3*/site-packages"))
                assert not (site / "onnxruntime" / "tools").exists() and not list(site.glob("numpy/*/tests"))
            else:
                (out / "venv").symlink_to(venv)
            bundled = _run_bundle_device(fed, out, home, run / "bundle-device.log", profile="phone-mid",
                                         extra=["--training-backend", "torch"], timeout_s=400)
            assert bundled["index"] == 1 and bundled["last_round"] == config["rounds"]
            log = (run / "bundle-device.log").read_text()
            assert "onnxruntime" in log, log[-2000:]
        finally:
            fed.close()
        cfg = FederationConfig.from_dict(config)
        simulate(cfg, save_dir=run / "sim", progress=False)
        mine = load_file(str(out / "state" / "final.safetensors"))
        want = load_checkpoint(run / "sim" / "client_001.safetensors")[0]
        assert mine.keys() == want.keys()
        for k in mine:
            np.testing.assert_allclose(mine[k], want[k].numpy(), atol=5e-5, rtol=1e-4, err_msg=f"{algorithm} {k}")
