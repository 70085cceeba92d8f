"""docs/architecture.md matches the code: every file and folder its tree names exists, every module of the
packages is in the tree (directly, or under a folder listed without its files), and every name it puts in
backticks is defined somewhere in the code (a renamed or removed function fails here, not in a reader's hands)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("pfl_edge", "server", "edge_runtime", "export", "device_profiles")
_NAME = re.compile(r"(?<![\w/.])([A-Za-z_]\w*(?:\.py|/))(?=[,\s]|$)")


def _tree() -> tuple[dict[str, int], set[str]]:
    """Paths the tree names (relative to the root, folders ending in /) with their line, and the folders listed
    with children of their own."""
    text = DOC.read_text()
    block = text[text.index("```\n") + 4:]
    block = block[:block.index("```")]
    named: dict[str, int] = {}
    with_children: set[str] = set()
    top = sub = ""
    for n, line in enumerate(block.splitlines(), 1):
        indent = len(line) - len(line.lstrip())
        if not line.strip() or indent > 6:  # a description's continuation
            continue
        names_col = re.split(r"\s{2,}", line.strip())[0]
        names_col = re.sub(r"\([^)]*\)", "", names_col)
        for name in _NAME.findall(names_col):
            if indent == 0:
                top = sub = name
                path = name
            elif indent == 2:
                path = top + name
                if name.endswith("/"):
                    sub = path
            else:
                path = sub + name
                with_children.add(sub)
            named[path] = n
    return named, with_children


def test_every_path_the_tree_names_exists() -> None:
    named, _ = _tree()
    assert len(named) > 60, "the tree was not read"
    missing = [f"{p} (line {n} of the tree)" for p, n in named.items() if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_module_is_in_the_tree() -> None:
    named, with_children = _tree()
    left_out = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if f.name in ("__init__.py", "__main__.py") or rel in named:
                continue
            folder = rel.rsplit("/", 1)[0] + "/"
            if folder in named and folder not in with_children:  # a folder named without its files
                continue
            left_out.append(rel)
    assert not left_out, f"modules docs/architecture.md does not place: {left_out}"


def _defined() -> set[str]:
    names: set[str] = set()
    pattern = re.compile(r"^\s*(?:(?:async\s+)?def|class)\s+(\w+)|^\s*(\w+)\s*(?::[^=\n]*)?=|^\s*(\w+)\s*:", re.M)
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            for m in pattern.finditer(f.read_text()):
                names.add(next(g for g in m.groups() if g))
    return names


def test_every_name_in_backticks_is_defined() -> None:
    text = DOC.read_text()
    defined = _defined()
    checked, unknown = 0, []
    for span in re.findall(r"`([^`\n]+)`", text):
        if "/" in span:
            assert (ROOT / span.split()[0]).exists(), f"{span!r} names a path that does not exist"
            continue
        m = re.fullmatch(r"([A-Za-z_][\w.]*)(\(.*\))?", span)
        if m is None:
            continue
        checked += 1
        if m.group(1).split(".")[-1] not in defined:
            unknown.append(span)
    assert checked > 40, "the names were not read"
    assert not unknown, f"docs/architecture.md names what the code does not define: {unknown}"
