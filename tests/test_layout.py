"""The code's shape, checked: the running system (server, device runtime) imports nothing of the simulator (nor
the removed ``pfl_edge.local``), server and edge runtime never import each other, no package holds a bare
``assert`` (invariants raise InternalError), and files and functions stay small (a longer function says why in
a ``# long:`` comment)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pfl_edge", "server", "edge_runtime", "export", "device_profiles")
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
FORBIDDEN = {
    "server": ("pfl_edge.sim", "pfl_edge.local", "edge_runtime"),
    "edge_runtime": ("pfl_edge.sim", "pfl_edge.local", "server"),
    "export": ("edge_runtime", "server"),
    "pfl_edge": ("pfl_edge.local", "fastapi", "sqlalchemy", "paho", "amqtt", "httpx"),
}
ALLOWED = {"pfl_edge/cli"}  # the CLI imports the other packages (lazily, per subcommand)


def _imports(tree: ast.AST, package: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module if node.level == 0 else f"{package}.{node.module}"
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def test_the_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in FILES}
    assert {"server/states.py", "pfl_edge/algorithms/dispfl.py", "edge_runtime/agent.py"} <= names
    assert "pfl_edge/local.py" not in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_module_shape(path: Path) -> None:
    rel = path.relative_to(ROOT).as_posix()
    package = rel.split("/")[0]
    source = path.read_text()
    tree = ast.parse(source)
    if not any(rel.startswith(a) for a in ALLOWED):
        bad = [m for m in _imports(tree, package) if m.startswith(FORBIDDEN.get(package, ()))]
        assert not bad, f"{rel} imports {bad}"
    asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not asserts, f"{rel}: bare assert on lines {asserts}; raise InternalError"
    assert len(source.splitlines()) <= 400, f"{rel} has {len(source.splitlines())} lines"
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            said = any("# long:" in line for line in lines[node.lineno - 1: node.lineno + 2])
            assert length <= 60 or said, f"{rel}:{node.lineno} {node.name} is {length} lines"
