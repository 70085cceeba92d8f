"""The code's shape, checked: every package imports only what docs/design.md's table allows (the running system
nothing of the simulator or the CLI, server and edge runtime never each other, the server's process no program
runtime, the core no web, broker or database library), no two modules import each other even through others, no
package holds a bare ``assert`` (invariants raise InternalError), and files and functions stay small (a longer
function says why in a ``# long:`` comment)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pfl_edge", "server", "edge_runtime", "export", "device_profiles")
FILES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
# docs/design.md's table, "may import": the project's packages each may import (its own too)
MAY_IMPORT = {
    "pfl_edge": {"pfl_edge"},
    "device_profiles": {"pfl_edge", "device_profiles"},
    "export": {"pfl_edge", "device_profiles", "export"},
    "server": {"pfl_edge", "device_profiles", "server"},
    "edge_runtime": {"pfl_edge", "device_profiles", "export", "edge_runtime"},
}
# and what none of them may, within what the table allows: the simulator and the CLI are not part of the running
# system; the server's process runs neither ONNX Runtime nor ExecuTorch (export.worker runs in a child of its own)
NEVER = {
    "server": ("pfl_edge.sim", "pfl_edge.cli", "pfl_edge.local", "onnx", "onnxruntime", "executorch", "torchao"),
    "edge_runtime": ("pfl_edge.sim", "pfl_edge.cli", "pfl_edge.local"),
    "export": ("pfl_edge.cli",),
    "device_profiles": ("pfl_edge.cli",),
    "pfl_edge": ("pfl_edge.local",),
}
# the core's third-party libraries ("never web, broker or database libraries"); the rest is the standard library
CORE_LIBRARIES = {"torch", "numpy", "pydantic", "matplotlib", "tqdm", "rich", "safetensors", "PIL",
                  "tomli",  # pfl_edge.compat's tomllib on Python 3.10 (a device)
                  "ray",  # ray: the optional extra, pfl_edge/sim/ray_backend.py alone, imported lazily
                  "opacus",  # the privacy accountant, pfl_edge/privacy.py, imported lazily (never on a device)
                  "cryptography"}  # secure aggregation's X25519, HKDF, AES (pfl_edge/secagg/crypto.py)
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
        imported = [m for m in _imports(tree, package) if m.split(".")[0] != "__future__"]
        bad = [m for m in imported if m.startswith(NEVER[package])
               or (m.split(".")[0] in PACKAGES and m.split(".")[0] not in MAY_IMPORT[package])
               or (package == "pfl_edge" and m.split(".")[0] not in (*PACKAGES, *CORE_LIBRARIES)
                   and m.split(".")[0] not in sys.stdlib_module_names)]
        assert not bad, f"{rel} imports {bad}, which docs/design.md's table does not allow"
    asserts = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)]
    assert not asserts, f"{rel}: bare assert on lines {asserts}; raise InternalError"
    assert len(source.splitlines()) <= 400, f"{rel} has {len(source.splitlines())} lines"
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            said = any("# long:" in line for line in lines[node.lineno - 1: node.lineno + 2])
            assert length <= 60 or said, f"{rel}:{node.lineno} {node.name} is {length} lines"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (never run, so never part of a cycle)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(n.lineno for n in ast.walk(sub) if isinstance(n, ast.Import | ast.ImportFrom))
    return lines


def _graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, at module level or inside a function (a lazy import that
    closes a cycle still ties the two together)."""
    modules = {_module(p): p for p in FILES}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                if node.level:
                    base = base[:len(base) - node.level + 1]
                    frm = ".".join([*base, node.module] if node.module else base)
                else:
                    frm = node.module or ""
                targets = [f"{frm}.{a.name}" if f"{frm}.{a.name}" in modules else frm for a in node.names]
            graph[mod].update(t for t in targets if t in modules and t != mod)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    graph = _graph()
    assert "server.services.artefacts" in graph and graph["server.app"], "the import graph was not read"
    assert not _cycles(graph), _cycles(graph)


def _algorithm_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that compare an algorithm's name: ``x.algorithm == ...``, ``algorithm in (...)``,
    ``cfg.algorithm.startswith(...)``, or a registered name compared with anything but a program ``mode``."""

    def about_algorithm(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "algorithm") or (isinstance(n, ast.Name)
                                                                            and n.id == "algorithm")

    def a_name(n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return n.value in names
        return isinstance(n, ast.Tuple | ast.List | ast.Set) and any(a_name(e) for e in n.elts)

    def a_mode(n: ast.AST) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "mode") or (isinstance(n, ast.Name) and n.id == "mode")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(about_algorithm(x) for x in sides) or (any(a_name(x) for x in sides)
                                                          and not any(a_mode(x) for x in sides)):
                lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and about_algorithm(node.func.value)):
            lines.append(node.lineno)
    return lines


def test_only_the_algorithms_compare_an_algorithms_name() -> None:
    from pfl_edge.algorithms import list_algorithms

    names = set(list_algorithms())
    assert _algorithm_comparisons(ast.parse('if cfg.algorithm == "fedper": pass'), names) == [1]
    assert _algorithm_comparisons(ast.parse('x = "dispfl" in kinds'), names) == [1]
    assert _algorithm_comparisons(ast.parse('ok = mode in ("fedper", "dispfl")'), names) == []  # program modes
    found = {}
    for path in FILES:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("pfl_edge/algorithms/"):
            continue
        lines = _algorithm_comparisons(ast.parse(path.read_text()), names)
        if lines:
            found[rel] = lines
    assert not found, f"ask the algorithm (its class's traits or methods) instead of comparing its name: {found}"


def _trait_reads(tree: ast.AST, traits: set[str]) -> list[int]:
    """Lines that read one of an algorithm class's traits (``algo.decentral``, ``cls.sparse_masks``, ...)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr in traits]


def test_only_the_algorithms_read_their_traits() -> None:
    """The server, the device, the simulator and the config ask an algorithm's methods (what the server
    publishes, keeps and serves, which programs a device needs, how a round deploys); the class traits that
    answer them are read inside pfl_edge/algorithms only."""
    from pfl_edge.algorithms import Algorithm

    traits = {k for k, v in vars(Algorithm).items() if not k.startswith("_") and isinstance(v, bool | str)
              and k != "name"} | {"keeps"}
    assert {"decentral", "sends_initial_model", "final_evaluation", "sparse_masks", "on_devices", "keeps",
            "program_mode", "deploys_finetuned", "finetunes_personal"} <= traits
    assert _trait_reads(ast.parse("if fm.algorithm().decentral: pass"), traits) == [1]
    found = {}
    for path in [*FILES, *sorted((ROOT / "bench").glob("*.py"))]:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("pfl_edge/algorithms/"):
            continue
        lines = _trait_reads(ast.parse(path.read_text()), traits)
        if lines:
            found[rel] = lines
    assert not found, f"ask the algorithm's methods instead of reading its traits: {found}"


def _calls(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that call a method of one of ``names`` (``algo.sampled(t)``, ``fm.algorithm().initial_upload()``)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr in names]


def test_who_takes_part_in_a_round_is_defined_once() -> None:
    """The server and the device ask ``Algorithm.participation(t)`` (its draw and whether an initial model comes
    first) and the server filters on it in one place (``Planner._who``); nothing outside the algorithms asks
    for the draw or the initial model on its own, so no second copy of the rule can drift."""
    assert _calls(ast.parse("x = fm.algorithm().sampled(t)"), {"sampled"}) == [1]
    found = {}
    for path in FILES:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("pfl_edge/algorithms/"):
            continue
        lines = _calls(ast.parse(path.read_text()), {"sampled", "initial_upload", "relays_uploads",
                                                     "merges_partial_sums", "final_task"})
        if lines:
            found[rel] = lines
    assert not found, f"ask Algorithm.participation(t) (or closing(t), after the last round) instead: {found}"
    planner = (ROOT / "server" / "services" / "planning.py").read_text()
    server_reads = {p.relative_to(ROOT).as_posix(): len(_calls(ast.parse(p.read_text()), {"participation"}))
                    for p in FILES if p.relative_to(ROOT).parts[0] == "server"}
    assert planner.count(".participation(") == 2  # _who, and count_refused's round-1 question
    assert {k for k, v in server_reads.items() if v} == {"server/services/planning.py", "server/services/updates.py",
                                                          "server/services/metrics.py"}, server_reads


def test_the_simulator_names_no_algorithm() -> None:
    """The simulator's one runner asks the algorithm for its ``Simulation``: no module of pfl_edge/sim imports an
    algorithm's own module (a new algorithm or family adds no simulator file)."""
    graph = _graph()
    families = {m for m in graph if m.startswith("pfl_edge.algorithms.")} - {
        "pfl_edge.algorithms.algorithm", "pfl_edge.algorithms.base", "pfl_edge.algorithms.simulation",
        "pfl_edge.algorithms.options"}
    assert "pfl_edge.algorithms.central" in families and "pfl_edge.algorithms.dispfl" in families
    found = {m: sorted(graph[m] & families) for m in graph if m.startswith("pfl_edge.sim") and graph[m] & families}
    assert not found, f"the simulator names algorithms: {found}"


def _module_level_imports(tree: ast.Module, package: str) -> list[str]:
    """What a module imports when it is imported (its top level, ``if TYPE_CHECKING`` blocks left out), not what
    its functions import when they run."""
    out: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out += _imports(node, package)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def test_the_cli_is_the_composition_root_and_the_core_never_loads_what_is_above_it() -> None:
    """The mission puts the CLI in pfl_edge/ ("the core, the protocol and the CLI"); issue 35 asked for it to move
    above the other packages. Kept where the mission puts it, it is held to what a package of its own above them
    would be: the one part of pfl_edge that imports server, edge_runtime or export (the rest of pfl_edge may not,
    test_module_shape), and only inside a subcommand's function, so importing pfl_edge, the CLI's parser included,
    loads none of them (checked in a fresh process)."""
    import subprocess

    above = ("server", "edge_runtime", "export")
    sample = "from server import x\nif TYPE_CHECKING:\n    import export\ndef f():\n    import edge_runtime\n"
    assert _module_level_imports(ast.parse(sample), "pfl_edge") == ["server", "server.x"]
    found = {}
    for path in sorted((ROOT / "pfl_edge" / "cli").glob("*.py")):
        top = [m for m in _module_level_imports(ast.parse(path.read_text()), "pfl_edge") if m.split(".")[0] in above]
        if top:
            found[path.name] = top
    assert not found, f"the CLI imports these when it is imported, not when a subcommand runs: {found}"
    script = ("import sys, pfl_edge, pfl_edge.cli, pfl_edge.sim, pfl_edge.algorithms\n"
              "pfl_edge.cli.build_parser()\n"
              f"print(sorted(m for m in sys.modules if m.split('.')[0] in {above!r}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing pfl_edge loaded {out.stdout.strip()}"


# what makes a round's result out of its updates: the algorithm's aggregate composes these (pfl_edge/algorithms),
# the server only hands it the round's updates, their norms and bounds, a merged sum or an unmasked sum
_AGGREGATING = {"clip_update", "clipped", "bounded", "aggregate_bases", "weighted_average", "robust_aggregate",
                "coordinate_median", "trimmed_mean", "masked_average", "private_mean", "secure_mean", "apply_sum",
                "neighbourhood_average", "dequantize_sum"}


def _aggregating_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Lines that import or name one of the functions that make an aggregate."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out += [(node.lineno, a.name) for a in node.names if a.name in _AGGREGATING]
        elif isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in _AGGREGATING:
                out.append((node.lineno, name))
    return out


def test_the_server_makes_no_aggregate_itself() -> None:
    """Issue 48: every published base is made by the algorithm's ``aggregate`` (the simulator's composition), so
    the server clips no update, computes no mean and applies no unmasked sum of its own."""
    assert _aggregating_uses(ast.parse("from pfl_edge.aggregate import clip_update\nx = m.apply_sum(a)")) == [
        (1, "clip_update"), (2, "apply_sum")]
    found = {p.relative_to(ROOT).as_posix(): uses for p in sorted((ROOT / "server").rglob("*.py"))
             if (uses := _aggregating_uses(ast.parse(p.read_text())))}
    assert not found, f"the server makes an aggregate itself; call Algorithm.aggregate instead: {found}"
