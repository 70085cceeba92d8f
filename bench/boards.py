"""arm64 Debian "boards" under emulation, for tests and benchmarks that need a device's own platform (aarch64
wheels, Debian's Python 3.11 on bookworm, the Raspberry Pi OS base, or 3.13 on trixie) on an x86_64 machine.

A board is a Debian arm64 root filesystem built once with mmdebstrap into a cache outside the checkout, run through
qemu-aarch64-static (registered with binfmt_misc, flag F, so a plain chroot runs arm64 programs without a copy of
qemu inside) in its own mount namespace: /proc, /sys and /dev are bound in there and vanish with the last process,
however it ends (timeout, SIGKILL). The board shares the host's network namespace, so a server on the host's
127.0.0.1 is reachable from inside, and it reads the host's pip configuration (copied in, with the local indexes it
names bound read-only), so pip on the board uses the same index or mirror as the host.

    python bench/boards.py build bookworm trixie       # build (once) and describe each board
    python bench/boards.py shell bookworm -- uname -m  # run a command on a board
    python bench/boards.py copy bookworm bundles/pi /opt/pfl-edge-device  # put a folder on a board

From a test (bench/ on sys.path): ``prerequisites()`` (None, or why it cannot run here), ``rootfs(suite)``,
``copy_in``, ``run``/``popen``, and a cache of installed virtual environments (``venv_key``, ``cached_venv``,
``save_venv``) so that a bundle's install.sh, 10+ minutes under emulation, runs once per set of requirements.

Needs root and the Debian packages mmdebstrap and qemu-user-static. Cache: $PFL_BOARDS_CACHE, default
/var/cache/pfl-edge/boards.
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import fcntl
import hashlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

SUITES = {"bookworm": "3.11", "trixie": "3.13"}  # Debian suite -> its python3
ARCH = "arm64"
# python3-venv brings ensurepip's pip wheel; pip then installs binary wheels only: no compiler, no headers
PACKAGES = ("python3", "python3-venv", "ca-certificates")
BUNDLE_DIR = "/opt/pfl-edge-device"  # where tests install a bundle: its venv (BUNDLE_DIR/venv) cannot move
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
BOARD_CPUINFO = "/etc/pfl-board/cpuinfo"  # on the board; bound over its /proc/cpuinfo (see cpuinfo_text)
# the CPU qemu emulates: a Raspberry Pi 4's. qemu's default ("max") has pointer authentication, whose emulation
# is slow, and trixie's binaries (BTI/PAC-marked) use it everywhere: Python on trixie ran 4x slower under it
QEMU_CPU = os.environ.get("PFL_BOARDS_QEMU_CPU", "cortex-a72")
BOARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the host's environment that pip (and Python's ssl) on the board needs to reach the same index the same way
PASS_ENV_PREFIXES = ("PIP_",)
PASS_ENV = ("http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE",
            "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
CERT_ENV = ("PIP_CERT", "PIP_CLIENT_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
# pip settings naming files (copied in) or indexes and link folders (local ones bound in read-only)
PIP_FILE_KEYS = ("cert", "client-cert", "constraint", "requirement")
PIP_LOCATION_KEYS = ("index-url", "extra-index-url", "find-links")


def cache_dir() -> Path:
    """Outside the checkout: a rootfs is some 200 MB of root-owned files that no git command should see."""
    return Path(os.environ.get("PFL_BOARDS_CACHE", "/var/cache/pfl-edge/boards"))


# ------------------------------------------------------------------------------------------------ prerequisites
def ensure_binfmt() -> None:
    """Mount binfmt_misc if the host has not, and register qemu-aarch64 from Debian's qemu-user-static entry.

    Inside a container nobody runs systemd-binfmt, so the package's entry is installed but not registered. Debian's
    line carries flag F: the kernel opens the interpreter at registration, so it works inside any chroot."""
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True, capture_output=True)
    if not (BINFMT / "qemu-aarch64").exists():
        head, flags = QEMU_CONF.read_text().strip().rsplit(":", 1)  # flags: the last field (Debian's: OPF)
        if "F" not in flags:
            flags += "F"
        with contextlib.suppress(FileExistsError):  # another process registered it meanwhile
            (BINFMT / "register").write_text(f"{head}:{flags}\n")


def _missing_tools() -> list[str]:
    return [t for t in ("mmdebstrap", "qemu-aarch64-static", "chroot", "unshare", "mount", "tar")
            if shutil.which(t) is None]


def prerequisites() -> str | None:
    """None when boards can run here, else a sentence saying what is missing (a test's skip reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "boards need root (mmdebstrap, chroot, mounts)"
    missing = _missing_tools()
    if missing:
        return f"boards need {', '.join(missing)} (apt-get install mmdebstrap qemu-user-static)"
    if not QEMU_CONF.exists():
        return f"boards need {QEMU_CONF} (apt-get install qemu-user-static)"
    try:
        ensure_binfmt()
    except (OSError, subprocess.CalledProcessError) as e:
        return f"binfmt_misc cannot be mounted or qemu-aarch64 registered: {e}"
    status = BINFMT / "qemu-aarch64"
    if not status.exists() or not status.read_text().startswith("enabled"):
        return "qemu-aarch64 is not registered (enabled) with binfmt_misc"
    return None


# ------------------------------------------------------------------------------------------------------- rootfs
@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """One builder per cache entry: pytest-xdist workers or two shells may ask for the same board at once."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _debstrap_cmd(suite: str, target: Path) -> list[str]:
    """mmdebstrap (root mode) mounts /proc, /sys and /dev in target while it runs; in a mount namespace of its own
    those go with it even when it is killed, and never outlive it under a folder that is then removed."""
    return ["unshare", "--mount", "--propagation", "private",
            "mmdebstrap", f"--arch={ARCH}", "--variant=minbase", f"--include={','.join(PACKAGES)}",
            "--aptopt=Acquire::Retries \"3\"", suite, str(target)]


def rootfs(suite: str, *, log: bool = False) -> Path:
    """The cached arm64 rootfs of suite, built on first use (some minutes) into a temporary folder beside it and
    renamed into place, so an interrupted build leaves no half rootfs, only a temporary folder the next build
    removes."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: one of {sorted(SUITES)}")
    final = cache_dir() / f"{suite}-{ARCH}"
    if (final / "usr/bin/python3").exists():
        return final
    why = prerequisites()
    if why is not None:
        raise RuntimeError(why)
    with _locked(f"{suite}-{ARCH}"):
        if (final / "usr/bin/python3").exists():  # built by whoever held the lock
            return final
        for stale in cache_dir().glob(f".{suite}-{ARCH}.tmp*"):
            _remove_tree(stale)
        tmp = Path(tempfile.mkdtemp(prefix=f".{suite}-{ARCH}.tmp", dir=cache_dir()))
        tmp.chmod(0o755)  # the board's own / (mkdtemp's 0700 also keeps apt's _apt user out of its lists)
        try:
            out = None if log else subprocess.PIPE
            proc = subprocess.run(_debstrap_cmd(suite, tmp), stdout=out, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "QEMU_CPU": QEMU_CPU})
            if proc.returncode != 0:
                raise RuntimeError(f"mmdebstrap {suite} failed ({proc.returncode}): {(proc.stdout or '')[-3000:]}")
            tmp.rename(final)
        except BaseException:
            _remove_tree(tmp)
            raise
    return final


def _remove_tree(path: Path) -> None:
    """rmtree, but never into a mount (a killed builder's /proc or /dev, had one leaked): unmount those first."""
    prefix = str(path.resolve()) + "/"
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()]
    for m in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", m], check=False, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def clone(suite: str, dest: Path) -> Path:
    """A private copy of suite's rootfs (cp -a, a few seconds), for a test that must not leave traces in the cache."""
    src = rootfs(suite)
    subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], check=True)
    return dest


# ------------------------------------------------------------------------------------- the host's pip, copied in
def _pip_config_files() -> list[Path]:
    """pip's global and user configuration files, in pip's own order (site files belong to a venv, not the host)."""
    files = [Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"), Path.home() / ".pip/pip.conf",
             Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "pip/pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return [f for f in files if f.is_file()]


def _pip_settings() -> dict[str, list[str]]:
    """Every value the host's pip configuration and PIP_* variables give the keys that name files or locations."""
    found: dict[str, list[str]] = {k: [] for k in (*PIP_FILE_KEYS, *PIP_LOCATION_KEYS)}
    for f in _pip_config_files():
        cp = configparser.RawConfigParser()
        with contextlib.suppress(configparser.Error):
            cp.read(f)
        for section in cp.sections():
            for key in found:
                if cp.has_option(section, key):
                    found[key] += cp.get(section, key).split()
    for key in found:
        found[key] += os.environ.get("PIP_" + key.upper().replace("-", "_"), "").split()
    return found


def _local_path(location: str) -> Path | None:
    if location.startswith("file:"):
        return Path(unquote(urlparse(location).path))
    return Path(location) if location.startswith("/") else None


def host_files() -> list[Path]:
    """Files copied onto a board at the same path before each run: pip's configuration, the files it names
    (certificate bundles, constraints), the CA bundles named by the environment, resolv.conf."""
    files = [*_pip_config_files(), Path("/etc/resolv.conf")]
    xdg = Path("/etc/xdg/pip")
    if xdg.is_dir():
        files += [p for p in xdg.rglob("*") if p.is_file()]
    settings = _pip_settings()
    for key in PIP_FILE_KEYS:
        files += [p for v in settings[key] if (p := _local_path(v)) is not None]
    files += [Path(os.environ[v]) for v in CERT_ENV if os.environ.get(v)]
    seen: dict[Path, None] = {}
    for f in files:
        if f.is_file():
            seen.setdefault(f.resolve() if f.is_symlink() else f, None)
    return list(seen)


def host_dirs() -> list[Path]:
    """Local package folders the host's pip reads (file:// indexes, find-links): bound read-only at the same path."""
    dirs: dict[Path, None] = {}
    settings = _pip_settings()
    for key in PIP_LOCATION_KEYS:
        for v in settings[key]:
            p = _local_path(v)
            if p is None or not p.exists():
                continue
            # a file:// simple index links to its files by relative paths (../../files/...): bind its parent
            top = p.parent if key != "find-links" and p.name == "simple" else p
            dirs.setdefault(top if top.is_dir() else top.parent, None)
    return list(dirs)


def cpuinfo_text(cpus: int | None = None) -> str:
    """An arm64 /proc/cpuinfo, a Raspberry Pi 4's (Cortex-A72), one entry per host CPU up to its four cores.

    qemu-user (Debian bookworm's 7.2) shows programs the host's x86 /proc/cpuinfo; the cpuinfo library in
    onnxruntime's aarch64 wheels finds no ARM processor there and crashes at ``import onnxruntime`` (SIGSEGV).
    Newer qemu (8.2+) emulates the file itself; binding this one over it works with either."""
    n = cpus or min(4, len(os.sched_getaffinity(0)))
    cpu = ("BogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\n"
           "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n")
    body = "\n".join(f"processor\t: {i}\n{cpu}" for i in range(n))
    return f"{body}\nHardware\t: BCM2835\nRevision\t: c03111\nModel\t\t: Raspberry Pi 4 Model B Rev 1.1\n"


def sync_host_config(root: Path) -> None:
    """Copy the host's pip configuration and resolv.conf in: cheap, and every run sees the host's current ones.
    Also the board's own /proc/cpuinfo (cpuinfo_text)."""
    fake = root / BOARD_CPUINFO.lstrip("/")
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_text(cpuinfo_text())
    for f in host_files():
        dest = root / str(f).lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink():  # e.g. resolv.conf -> ../run/...: would write outside, or nowhere
            dest.unlink()
        shutil.copyfile(f, dest)


def board_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for the board (the host's PATH and venv mean nothing there) plus the host's PIP_*,
    proxy and CA variables, QEMU_CPU (read by qemu, binfmt-started), then env on top."""
    out = {"PATH": BOARD_PATH, "HOME": str(Path.home()), "LANG": "C.UTF-8", "TERM": "dumb", "QEMU_CPU": QEMU_CPU}
    for k, v in os.environ.items():
        if k.startswith(PASS_ENV_PREFIXES) or k in PASS_ENV:
            out[k] = v
    out.update(env or {})
    return out


# -------------------------------------------------------------------------------------------------------- running
def _mount_script(root: Path) -> list[str]:
    """Shell lines that bind what Python and pip need into root, in a mount namespace of their own (so no
    unmounting is ever needed: they go with the namespace's last process, also on SIGKILL)."""
    r = shlex.quote(str(root))
    lines = [f"mount --rbind /proc {r}/proc", f"mount --rbind /sys {r}/sys", f"mount --rbind /dev {r}/dev",
             f"mount --bind {r}{BOARD_CPUINFO} {r}/proc/cpuinfo"]
    for d in host_dirs():
        target = f"{r}/{shlex.quote(str(d).lstrip('/'))}"
        lines += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(d))} {target}",
                  f"mount -o remount,bind,ro {target}"]
    return lines


def _argv(root: Path, argv: Sequence[str], cwd: str) -> list[str]:
    """unshare (a private mount namespace, the host's network) -> sh (the mounts) -> chroot -> argv in cwd."""
    script = "set -e\n" + "\n".join(_mount_script(root)) + (
        f"\nexec chroot {shlex.quote(str(root))} /bin/sh -c 'cd \"$0\" && exec \"$@\"' {shlex.quote(cwd)} "
        + " ".join(shlex.quote(a) for a in argv))
    return ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", script]


def _prepare(root: Path) -> None:
    why = prerequisites()
    if why is not None:
        raise RuntimeError(why)
    sync_host_config(root)
    Path(root, str(Path.home()).lstrip("/")).mkdir(parents=True, exist_ok=True)


def popen(root: Path, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str = "/",
          **kwargs: Any) -> subprocess.Popen[str]:
    """argv running on the board, for long-lived device processes. Its own session: stop it with
    ``stop(proc)``, which signals the whole group (the chroot's processes included)."""
    _prepare(root)
    kwargs.setdefault("text", True)
    return subprocess.Popen(_argv(root, argv, cwd), env=board_env(env), start_new_session=True, **kwargs)


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM, grace: float = 10.0) -> int:
    """Signal proc's process group, then SIGKILL it after grace seconds; the board's mounts go with it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run(root: Path, argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float,
        cwd: str = "/", check: bool = False) -> subprocess.CompletedProcess[str]:
    """argv on the board, its output captured (text). On timeout the whole process group is killed and
    subprocess.TimeoutExpired raised, with what it had printed."""
    proc = popen(root, argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGKILL, 5)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
    done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def copy_in(root: Path, src: Path, dest: str = BUNDLE_DIR) -> Path:
    """Copy folder src to dest on the board (replacing what was there); returns its host path."""
    target = root / dest.lstrip("/")
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(src, target, symlinks=True)
    return target


# ---------------------------------------------------------------------------------- installed virtual environments
def venv_key(suite: str, requirements: Path | str, wheel: Path | None = None, extra: str = "") -> str:
    """What an installed venv depends on: the board's suite, the requirements file's text, the wheel's bytes (and
    anything else the caller names, e.g. the install script's text)."""
    h = hashlib.sha256()
    text = requirements.read_text() if isinstance(requirements, Path) else requirements
    for part in (suite, ARCH, text, extra):
        h.update(part.encode() + b"\0")
    if wheel is not None:
        h.update(wheel.read_bytes())
    return f"{suite}-{h.hexdigest()[:16]}"


def _venv_archive(key: str) -> Path:
    return cache_dir() / "venvs" / f"{key}.tar"


def cached_venv(root: Path, key: str, venv: str = f"{BUNDLE_DIR}/venv") -> bool:
    """Restore the venv saved under key at venv (the same path it was built at: a venv cannot move); False when
    there is none, and the caller installs (then ``save_venv``)."""
    archive = _venv_archive(key)
    if not archive.is_file():
        return False
    target = root / venv.lstrip("/")
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xf", str(archive), "-C", str(root)], check=True)
    return (target / "bin/python").exists()


def save_venv(root: Path, key: str, venv: str = f"{BUNDLE_DIR}/venv") -> Path:
    """Archive the board's venv under key (written beside, then renamed: a reader never sees half an archive)."""
    archive = _venv_archive(key)
    archive.parent.mkdir(parents=True, exist_ok=True)
    rel = venv.strip("/")
    fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tar", dir=archive.parent)
    os.close(fd)
    try:
        subprocess.run(["tar", "-cf", tmp, "-C", str(root), rel], check=True)
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return archive


def install_bundle(root: Path, suite: str, bundle: Path, *, timeout: float = 3600.0,
                   env: Mapping[str, str] | None = None) -> bool:
    """A device bundle at BUNDLE_DIR on the board with its venv installed: restored from the cache when the same
    requirements, wheel and install.sh were installed before on suite (True), else by the bundle's own install.sh,
    then saved (False). Raises RuntimeError with install.sh's output when it fails."""
    copy_in(root, bundle, BUNDLE_DIR)
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    key = venv_key(suite, bundle / "requirements-aarch64.txt", wheels[0] if wheels else None,
                   extra=(bundle / "install.sh").read_text())
    if cached_venv(root, key):
        return True
    r = run(root, ["/bin/sh", f"{BUNDLE_DIR}/install.sh"], env=env, timeout=timeout, cwd=BUNDLE_DIR)
    if r.returncode != 0:
        raise RuntimeError(f"install.sh failed ({r.returncode}) on {suite}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    save_venv(root, key)
    return False


# --------------------------------------------------------------------------------------------------------- the CLI
def du_mib(path: Path) -> float:
    """Disk usage in MiB (du: sparse files and hard links counted as the disk sees them)."""
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024


def _cmd_build(suites: list[str]) -> int:
    for suite in suites:
        t0 = time.monotonic()
        cached = (cache_dir() / f"{suite}-{ARCH}" / "usr/bin/python3").exists()
        root = rootfs(suite, log=True)
        took = time.monotonic() - t0
        t1 = time.monotonic()
        r = run(root, ["sh", "-c", "uname -m; python3 --version"], timeout=120)
        print(f"{suite}: {root} {'(cached)' if cached else f'built in {took:.0f} s'}, {du_mib(root):.0f} MiB; "
              f"{' '.join(r.stdout.split())} ({time.monotonic() - t1:.1f} s) {r.stderr.strip()}", flush=True)
    return 0


def _cmd_shell(suite: str, argv: list[str], cwd: str) -> int:
    root = rootfs(suite, log=True)
    proc = popen(root, argv or ["/bin/bash"], cwd=cwd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return stop(proc)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (once) each suite's rootfs and show it")
    b.add_argument("suites", nargs="*", metavar="SUITE", help=f"{', '.join(SUITES)} (default: all)")
    s = sub.add_parser("shell", help="run a command (default bash) on a board: shell SUITE -- CMD...")
    s.add_argument("suite", choices=list(SUITES))
    s.add_argument("--cwd", default="/")
    s.add_argument("argv", nargs=argparse.REMAINDER)
    c = sub.add_parser("copy", help="copy a folder of the host onto a board (replacing what was there)")
    c.add_argument("suite", choices=list(SUITES))
    c.add_argument("src", type=Path)
    c.add_argument("dest", nargs="?", default=BUNDLE_DIR, help=f"its path on the board (default {BUNDLE_DIR})")
    sub.add_parser("check", help="say whether boards can run here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.cmd == "check":
        why = prerequisites()
        print(why or f"ok: boards can run here (cache {cache_dir()})")
        return 0 if why is None else 1
    if a.cmd == "copy":
        if not a.src.is_dir():
            ap.error(f"{a.src} is not a folder")
        print(copy_in(rootfs(a.suite, log=True), a.src, a.dest))
        return 0
    if a.cmd == "build":
        unknown = set(a.suites) - set(SUITES)
        if unknown:
            ap.error(f"unknown suite(s) {', '.join(sorted(unknown))}: one of {', '.join(SUITES)}")
        return _cmd_build(a.suites or list(SUITES))
    return _cmd_shell(a.suite, a.argv[1:] if a.argv[:1] == ["--"] else a.argv, a.cwd)


if __name__ == "__main__":
    sys.exit(main())
