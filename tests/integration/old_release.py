"""The previous release of the devices, for the slow tier's test that it still finishes against the current server
(issue 50 item 2, tests/integration/test_old_devices.py): its commit, its source tree materialised from git outside
the working tree, and its JavaScript device built there.

PREVIOUS_RELEASE is the one place the release is pinned. The project has no tags; at a release, set it to the full
hash of the release's last commit whose CI passed (``git rev-parse <commit>``), so that the next release's server is
checked against the devices now being shipped. A change that makes the old devices fail must bump the protocol version
and keep the old one served for its deprecation period (issue 50), not move this pin past the break."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
from pathlib import Path

__all__ = ["PREVIOUS_RELEASE", "REPO", "build_js", "materialise", "why_not_materialisable"]

# 93074b3: the last commit of a session whose CI passed and landed before devices got keys (a6ecac5) and the
# protocol's versioning work (issue 50); its devices enrol without a key and know nothing of either
PREVIOUS_RELEASE = "93074b31c0b28c1a4c24a842eb5f9bae1de0ef7f"
REPO = Path(__file__).resolve().parents[2]


def why_not_materialisable(commit: str = PREVIOUS_RELEASE) -> str | None:
    """Why the tree of ``commit`` cannot be had here (no git, not a checkout, a shallow clone without it), or None."""
    if shutil.which("git") is None:
        return "git is not installed"
    if not (REPO / ".git").exists():
        return f"{REPO} is not a git checkout"
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True)
    if found.returncode != 0:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                                 text=True).stdout.strip() == "true"
        return (f"the previous release's commit {commit[:12]} is not in this clone"
                + (" (a shallow clone: fetch with full history, e.g. git fetch --unshallow)" if shallow else ""))
    return None


def materialise(dest: Path, commit: str = PREVIOUS_RELEASE) -> Path:
    """``git archive`` of ``commit`` unpacked into ``dest`` (created; outside the working tree, nothing of the
    repository's state changes); returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=REPO, stdout=subprocess.PIPE)
    assert archive.stdout is not None
    untar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, capture_output=True)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(f"git archive {commit} | tar -x failed: {untar.stderr.decode(errors='replace')}")
    return dest


def build_js(tree: Path) -> Path:
    """Build the JavaScript device of a materialised tree; its entry point. Its node_modules: this checkout's
    devices/js/node_modules (linked) where both package-lock.json are the same file and that is installed, else
    ``npm ci`` from the registry."""
    js = tree / "devices" / "js"
    ours = REPO / "devices" / "js"
    if (ours / "node_modules").is_dir() and filecmp.cmp(js / "package-lock.json", ours / "package-lock.json",
                                                        shallow=False):
        (js / "node_modules").symlink_to(ours / "node_modules", target_is_directory=True)
    else:
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=js, check=True, capture_output=True, timeout=600)
    subprocess.run(["npm", "run", "build"], cwd=js, check=True, capture_output=True, timeout=300)
    return js / "dist" / "bin" / "device.js"
