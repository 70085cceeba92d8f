"""docs/protocol-changes.md keeps up with the device contract: every field a message's JSON Schema (docs/schemas)
has now that it did not have in version 1 is named there, and so is every message that version 1 did not have.

Version 1 is the first release that carried the protocol (``V1``, the last commit of issue 5's release). It
predates docs/schemas, so its messages are read from its source instead: the pydantic classes of
``pfl_edge/protocol.py`` and the answers ``server/app.py`` defined then (a schema's property names are the fields'
names: no aliases). A message added since is held to the fields of its first published schema (read with
``git show <commit>:docs/schemas/<name>.json``, the oldest version that has it), so a field added to it later must
be named too. The schemas checked are the working tree's, so a field added without an entry fails before it is
committed.

Named means either ``Message.field`` in backticks (a path through nested messages is fine:
``ModelCard.training.ditto``), or, within one bullet of the changelog, the message alone in backticks and the field
in backticks. A message is named by its name in backticks (alone or dotted). Needs git and the
history down to ``V1``: skipped, saying why, in a shallow clone or a tree without git."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
CHANGES = REPO / "docs" / "protocol-changes.md"
SCHEMAS = REPO / "docs" / "schemas"
#: version 1: 976e24b, 2026-11-29, the last commit of the first release with pfl_edge/protocol.py (issue 5)
V1 = "976e24bbbc4388f2b3e66bf68d4ff08852f96938"
V1_SOURCES = ("pfl_edge/protocol.py", "server/app.py")


def _git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, input=stdin, capture_output=True, text=True, check=False)


@cache
def _unavailable() -> str | None:
    """Why the history this test reads cannot be had here, or None."""
    if shutil.which("git") is None:
        return "git is not installed"
    if _git("rev-parse", "--git-dir").returncode != 0:
        return f"{REPO} is not a git checkout"
    if _git("cat-file", "-e", f"{V1}^{{commit}}").returncode != 0:
        shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        return (f"version 1's commit {V1[:12]} is not in this clone"
                + (" (a shallow clone: git fetch --unshallow)" if shallow else ""))
    return None


@pytest.fixture(autouse=True)
def _needs_history() -> None:
    why = _unavailable()
    if why is not None:
        pytest.skip(f"needs the repository's history: {why}")


def _v1_messages() -> dict[str, set[str]]:
    """Version 1's messages: class name -> its fields, from the sources of ``V1``."""
    out: dict[str, set[str]] = {}
    for path in V1_SOURCES:
        tree = ast.parse(_git("show", f"{V1}:{path}").stdout)
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = {s.target.id for s in node.body
                                  if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return out


def _defs(stem: str, doc: dict[str, Any]) -> dict[str, set[str]]:
    """Every object a schema file defines (the message itself, named by the file, and its ``$defs``) -> its
    property names."""
    items = [(stem, doc), *doc.get("$defs", {}).items()]
    return {name: set(body["properties"]) for name, body in items if isinstance(body.get("properties"), dict)}


def _current() -> dict[str, tuple[str, set[str]]]:
    """The working tree's schemas: object name -> (the file that defines it at the top or first, properties)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        if path.name == "index.json":
            continue
        for name, props in _defs(path.stem, json.loads(path.read_text(encoding="utf-8"))).items():
            if name == path.stem or name not in out:
                out[name] = (path.stem, props)
    return out


def _first_published() -> dict[str, set[str]]:
    """Each object's properties in the oldest committed schema that has it (docs/schemas' history, oldest first)."""
    log = _git("log", "--reverse", "--format=@%H", "--name-only", "--", "docs/schemas").stdout
    wanted: list[str] = []
    commit = ""
    for line in log.splitlines():
        if line.startswith("@"):
            commit = line[1:]
        elif line.endswith(".json") and not line.endswith("/index.json"):
            wanted.append(f"{commit}:{line}")
    batch = subprocess.run(["git", "cat-file", "--batch"], cwd=REPO, input="\n".join(wanted).encode() + b"\n",
                           capture_output=True, check=True).stdout
    first: dict[str, set[str]] = {}
    pos = 0
    for spec in wanted:
        header_end = batch.index(b"\n", pos)
        header = batch[pos:header_end].split()
        pos = header_end + 1
        if header[-1] == b"missing":  # the file was deleted by that commit
            continue
        size = int(header[2])
        doc = json.loads(batch[pos:pos + size])
        pos += size + 1
        for name, props in _defs(Path(spec.split(":", 1)[1]).stem, doc).items():
            first.setdefault(name, props)
    return first


def _items(text: str) -> list[str]:
    """The changelog's items: each bullet (a line starting ``- `` and the indented lines that continue it), each
    heading and each paragraph."""
    return re.split(r"(?m)^(?=- |#|\S)", text)


def _names_message(text: str, name: str) -> bool:
    return re.search(rf"`{re.escape(name)}(?:\.[A-Za-z_][\w.]*)?`", text) is not None


def _names_field(text: str, items: list[str], owners: tuple[str, ...], field: str) -> bool:
    """``Owner.field`` (or ``Owner.x.field``) in backticks anywhere, or in one item the owner alone in backticks
    and the field in backticks."""
    for owner in owners:
        if re.search(rf"`{re.escape(owner)}(?:\.\w+)*\.{re.escape(field)}`", text):
            return True
    return any(f"`{field}`" in i and any(f"`{o}`" in i for o in owners) for i in items)


def _unnamed() -> tuple[list[str], list[str], list[str]]:
    """(new messages not named, added fields not named, removed fields not named)."""
    text = CHANGES.read_text(encoding="utf-8")
    items = _items(text)
    v1, first = _v1_messages(), _first_published()
    messages: list[str] = []
    added: list[str] = []
    removed: list[str] = []
    for name, (stem, props) in sorted(_current().items()):
        if name in v1:
            base = v1[name]
        else:
            base = first.get(name, props)  # an object only the working tree has: its fields are its first
            if not _names_message(text, name):
                messages.append(name)
        owners = (name,) if stem == name else (name, stem)
        added += [f"{name}.{f}" for f in sorted(props - base) if not _names_field(text, items, owners, f)]
        removed += [f"{name}.{f}" for f in sorted(base - props) if not _names_field(text, items, owners, f)]
    return messages, added, removed


def test_every_field_added_since_version_1_is_in_the_changelog() -> None:
    messages, added, removed = _unnamed()
    assert not added, (f"fields added to the protocol since version 1 ({V1[:7]}) that docs/protocol-changes.md does "
                       f"not name: {added}; add an entry (newest first) naming each as `Message.field`, its "
                       "commit and date, whether it breaks a device that refuses unknown fields, and what a device "
                       "must do")
    assert not removed, f"fields removed from the protocol that docs/protocol-changes.md does not name: {removed}"
    assert not messages, (f"messages added since version 1 that docs/protocol-changes.md does not name: {messages}; "
                          "name each (in backticks) in the entry of the change that added it")


def test_the_check_sees_a_field_without_an_entry() -> None:
    # the rule itself: a field named nowhere is found, one named either way is not
    text = ("### `abc1234` 2026-12-07: a change\n- *Messages*: `Task.round_hint`, and in `Enrolment` a field\n"
            "  `expires`.\n- *A device must*: read `Task.round_hint`; `weight` is ignored.\n")
    items = _items(text)
    assert _names_field(text, items, ("Task",), "round_hint")
    assert _names_field(text, items, ("Enrolment",), "expires")
    assert not _names_field(text, items, ("Task",), "expires")
    assert not _names_field(text, items, ("Task",), "weight")
    assert not _names_field(text, items, ("UpdateRequest",), "weight")
    assert _names_field("`ModelCard.training.ditto`", [], ("TrainingInfo", "ModelCard"), "ditto")
    assert _names_message(text, "Enrolment") and not _names_message(text, "Enrol")


def test_version_1_is_read_as_the_protocol_it_was() -> None:
    v1 = _v1_messages()
    assert v1["Task"] == {"federation", "round", "algorithm", "base", "neighbours", "deadline", "final"}
    assert v1["EnrolRequest"] == {"federation", "enrol_secret", "profile", "name", "index", "nonce"}
    assert {"BlobStored", "MetricsStored", "Enrolment", "MetricsReport"} <= set(v1)
    assert "ModelCard" not in v1 and "ModelCard" in _first_published()


def test_every_commit_the_changelog_cites_exists() -> None:
    cited = sorted(set(re.findall(r"`([0-9a-f]{7,40})`", CHANGES.read_text(encoding="utf-8"))))
    assert cited, "docs/protocol-changes.md cites no commit"
    answer = _git("cat-file", "--batch-check", stdin="".join(f"{c}^{{commit}}\n" for c in cited)).stdout
    missing = [c for c, line in zip(cited, answer.splitlines(), strict=True) if line.endswith("missing")]
    assert not missing, f"docs/protocol-changes.md cites commits this repository does not have: {missing}"
