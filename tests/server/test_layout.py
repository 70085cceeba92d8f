"""The server's shape, checked: it imports nothing of the simulator (nor the removed ``pfl_edge.local``), holds
no bare ``assert`` (invariants raise InternalError), and keeps files and functions small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[2] / "server"
FILES = sorted(SERVER.rglob("*.py"))
FORBIDDEN = ("pfl_edge.sim", "pfl_edge.local")


def _imports(tree: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_the_files_are_found() -> None:
    names = {p.relative_to(SERVER).as_posix() for p in FILES}
    assert {"states.py", "migrations.py", "services/rounds.py", "routers/blobs.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(SERVER).as_posix())
def test_server_module_shape(path: Path) -> None:
    source = path.read_text()
    tree = ast.parse(source)
    bad = [m for m in _imports(tree) if m.startswith(FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}"
    asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not asserts, f"{path.name}: bare assert on lines {asserts}; raise InternalError"
    assert len(source.splitlines()) <= 400
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None and node.end_lineno - node.lineno < 60, node.name
