"""No code path a config can select on a device without torch reaches ``import torch`` (issue 47 item 1).

The runtime checks (tests/test_torch_free_imports.py, the compatibility matrix's torch-free devices) see the paths
they run; this one reads the source. From the device's entry points (``pfl-edge client`` and the agent) it follows
every module-level import of the project, and inside every module it reaches it finds each import of torch (or
executorch, torchao, opacus, ``safetensors.torch``) and each function-level import of another project module. An
import is fine at module level under ``if TYPE_CHECKING``, or inside a ``try`` whose ``except`` takes ImportError
(the caller then says what to do instead). Every other one sits in a function named below, with the reason no
torch-free device calls it: a new one fails here until someone decides which side of that line it is on, and an
entry that names nothing any more fails too (so the list cannot rot)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("pfl_edge", "edge_runtime", "device_profiles", "export", "server")
HEAVY = ("torch", "executorch", "torchao", "opacus", "safetensors.torch")
ENTRIES = ("pfl_edge.cli.client", "edge_runtime.agent")
# the CLI's package imports every subcommand's module to build its parser; a device runs ``client`` only, so what
# the other subcommands import inside their functions (the server, the exporter, the simulator) is not its path
OTHER_SUBCOMMANDS = "pfl_edge.cli."

# why each group is never run by a device without torch
TORCH_ARRAYS = "only for torch arrays: the device without torch holds numpy arrays (arrays_kind), this branch is " \
               "taken when the value is a torch tensor"
TORCH_BACKEND = "a training or inference backend that needs torch or executorch; device_backend refuses it " \
                "(ConfigError) on a device without torch and picks onnxruntime"
COORDINATOR = "the simulator's or the server's side of a shared module: a device reads the result from its task " \
              "or enrolment (the graph, the draw, the initial model, epsilon) and never computes it"
SIMULATION = "the in-process simulator's composition (a device runs the algorithm's device_round, not this)"
EAGER = "eager PyTorch evaluation or model tracing: a device without torch evaluates with the ONNX program and " \
        "takes its model's skeleton from the card"

ALLOWED: dict[str, str] = {
    "device_profiles.check:_activation_elements": EAGER + " (check() measures an nn.Module: the server's fit check)",
    "edge_runtime.agent:Agent._setup": TORCH_ARRAYS,
    "edge_runtime.data:load_local_data": TORCH_ARRAYS + " (device_data calls load_local_arrays for numpy)",
    "edge_runtime.backends:TorchTrainer.__init__": TORCH_BACKEND,
    "edge_runtime.backends:TorchTrainer.step": TORCH_BACKEND,
    "edge_runtime.backends:_ExecuTorch.__init__": TORCH_BACKEND,
    "edge_runtime.backends:_ExecuTorch.run": TORCH_BACKEND,
    "edge_runtime.data:load_image_folder": TORCH_ARRAYS,
    "edge_runtime.program_backends:ProgramBackend.state": TORCH_ARRAYS,
    "edge_runtime.program_backends:_like": TORCH_ARRAYS,
    "edge_runtime.state:StateDir.load_tensors": TORCH_ARRAYS,
    "edge_runtime.state:StateDir.save_tensors": TORCH_ARRAYS,
    "edge_runtime.trainer:DeviceTrainer._vector": TORCH_ARRAYS,
    "edge_runtime.trainer:_eager_evaluate": EAGER,
    "edge_runtime.trainer:device_clients": TORCH_ARRAYS,
    "edge_runtime.training:TorchBackend._one": TORCH_BACKEND,
    "edge_runtime.training:TorchBackend.dense_gradients": TORCH_BACKEND,
    "edge_runtime.training:TorchBackend.train": TORCH_BACKEND,
    "pfl_edge.algorithms.central:CentralSimulation.round": SIMULATION,
    "pfl_edge.algorithms.central:CentralSimulation._trained": SIMULATION,
    "pfl_edge.algorithms.central:CentralSimulation._bounded": SIMULATION,
    "pfl_edge.algorithms.central_parts:aggregate_bases": COORDINATOR,
    "pfl_edge.algorithms.central:Central.partial_sum": COORDINATOR,
    "pfl_edge.algorithms.central:Central.aggregate": COORDINATOR,
    "pfl_edge.algorithms.dispfl:DisPFL.upload_norm_bound": COORDINATOR + " (the server's check of an upload's norm)",
    "pfl_edge.algorithms.dispfl:DisPFLSimulation.__init__": SIMULATION,
    "pfl_edge.algorithms.dispfl:DisPFLSimulation._payload": SIMULATION,
    "pfl_edge.algorithms.dispfl:DisPFLSimulation.round": SIMULATION,
    "pfl_edge.algorithms.dpsgd:DPSGDSimulation.round": SIMULATION,
    "pfl_edge.algorithms.participants:sample_participants": COORDINATOR + " (a device draws with sampled_slots)",
    "pfl_edge.algorithms.simulation:hamming_matrix": COORDINATOR,
    "pfl_edge.algorithms.simulation:mask_summary": COORDINATOR,
    "pfl_edge.arrays:_torch": TORCH_ARRAYS,
    "pfl_edge.checkpoint:build_model": EAGER,
    "pfl_edge.checkpoint:load_checkpoint": TORCH_ARRAYS + " (checkpoints of torch models; the state dir reads numpy)",
    "pfl_edge.checkpoint:save_checkpoint": TORCH_ARRAYS + " (checkpoints of torch models; the state dir writes numpy)",
    "pfl_edge.codec.decoding:decode": TORCH_ARRAYS + " (a device without torch decodes with arrays='numpy')",
    "pfl_edge.codec.encoding:_torch_float32": TORCH_ARRAYS,
    "pfl_edge.codec.encoding:_torch_mask": TORCH_ARRAYS,
    "pfl_edge.data.partition:ClientData.of": TORCH_ARRAYS + " (deal_arrays deals numpy)",
    "pfl_edge.data.registry:Dataset.__post_init__": TORCH_ARRAYS + " (deal_arrays deals numpy)",
    "pfl_edge.data.registry:Dataset.of": TORCH_ARRAYS + " (deal_arrays deals numpy)",
    "pfl_edge.data.sources:fashion_mnist_labels": TORCH_ARRAYS + " (deal_arrays reads the labels with numpy)",
    "pfl_edge.data.sources:synthetic_labels": TORCH_ARRAYS + " (deal_arrays deals from make_synthetic's labels)",
    "pfl_edge.federation:init_state": COORDINATOR,
    "pfl_edge.modelgraph:_layers": EAGER,
    "pfl_edge.modelgraph:_module_layer": EAGER,
    "pfl_edge.modelgraph:_simple": EAGER,
    "pfl_edge.modelgraph:_tracer": EAGER,
    "pfl_edge.modelgraph:describe_layers": EAGER,
    "pfl_edge.neighbourhood:neighbourhood_average": TORCH_ARRAYS + " (the simulator's stacks)",
    "pfl_edge.privacy:_calibrate": COORDINATOR,
    "pfl_edge.privacy:_epsilon": COORDINATOR,
    "pfl_edge.privacy:_like": TORCH_ARRAYS,
    "pfl_edge.privacy:private_mean": COORDINATOR,
    "pfl_edge.secagg.aggregate:apply_sum": COORDINATOR + " (the server adds the unmasked sum to the base)",
    "pfl_edge.seeding:generator": COORDINATOR + " (a device draws through seeding.MT)",
    "pfl_edge.topology:mixing_matrix": COORDINATOR,
}


@dataclass(frozen=True)
class Site:
    module: str
    where: str  # the enclosing function's qualified name, or "<module>"
    name: str  # the module imported
    line: int
    type_only: bool
    guarded: bool  # inside a try that catches ImportError / ModuleNotFoundError

    @property
    def key(self) -> str:
        return f"{self.module}:{self.where}"


def module_path(mod: str) -> Path | None:
    p = ROOT.joinpath(*mod.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.scope: list[str] = []
        self.type_only = self.guarded = 0
        self.sites: list[Site] = []

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_If(self, node: ast.If) -> None:
        if ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            self.type_only += 1
            for s in node.body:
                self.visit(s)
            self.type_only -= 1
            for s in node.orelse:
                self.visit(s)
        else:
            self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        caught = set()
        for h in node.handlers:
            if h.type is not None:
                caught |= {ast.unparse(t) for t in (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])}
        guard = int(bool(caught & {"ImportError", "ModuleNotFoundError"}))
        self.guarded += guard
        for s in node.body:
            self.visit(s)
        self.guarded -= guard
        for s in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(s)

    def _add(self, name: str, line: int) -> None:
        self.sites.append(Site(self.module, ".".join(self.scope) or "<module>", name, line, self.type_only > 0,
                               self.guarded > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._add(a.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.module.split(".")[: None if self.is_package else -1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        else:
            base = node.module or ""
        for a in node.names:  # ``from pkg import mod`` imports the submodule
            full = f"{base}.{a.name}"
            self._add(full if module_path(full) else base, node.lineno)


def sites_of(module: str) -> list[Site]:
    path = module_path(module)
    assert path is not None, module
    v = _Imports(module, path.name == "__init__.py")
    v.visit(ast.parse(path.read_text(), str(path)))
    return v.sites


def is_heavy(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def reach(entries: tuple[str, ...], allowed: dict[str, str]) -> tuple[set[str], list[Site], set[str]]:
    """The project modules the entries reach (module-level imports, and function-level ones outside ``allowed``
    functions), the heavy imports among them no rule excuses, and the ``allowed`` keys that matched a site."""
    seen: set[str] = set()
    todo = list(entries)
    bad: list[Site] = []
    used: set[str] = set()
    while todo:
        mod = todo.pop()
        if mod in seen or module_path(mod) is None:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # a submodule's import runs its packages
        for s in sites_of(mod):
            if s.type_only:
                continue
            if s.key in allowed:
                used.add(s.key)
                continue
            if s.where != "<module>" and mod.startswith(OTHER_SUBCOMMANDS) and mod not in ENTRIES:
                continue
            if s.name.split(".")[0] in PROJECT:
                todo.append(s.name)
            elif is_heavy(s.name) and not s.guarded:
                bad.append(s)
    return seen, bad, used


def test_no_path_of_a_torch_free_device_imports_torch() -> None:
    seen, bad, used = reach(ENTRIES, ALLOWED)
    assert {"edge_runtime.agent", "pfl_edge.topology", "pfl_edge.algorithms.dispfl", "pfl_edge.secagg"} <= seen
    assert not bad, "torch reached from a device without torch (guard it, or say in ALLOWED why no device without " \
        "torch runs it):\n" + "\n".join(f"  {s.module}:{s.line} in {s.where}: import {s.name}" for s in bad)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"ALLOWED names functions that import no torch (remove them): {stale}"


def test_the_scan_sees_lazy_imports_and_what_excuses_them(tmp_path: Path) -> None:
    """The scanner itself, on the cases it decides: a lazy torch import is found, TYPE_CHECKING and an
    ImportError guard excuse it, an allowed function excuses it and its lazy project imports, and a project
    module imported inside a function is followed (the DisPFL graph's bug was a lazy import)."""
    src = ROOT / "pfl_edge" / "topology.py"
    sites = sites_of("pfl_edge.topology")
    assert any(s.name == "torch" and s.where == "mixing_matrix" and not s.guarded for s in sites)
    assert any(s.name == "torch" and s.type_only for s in sites)
    # the bug of issue 47, put back: the graph drawn by torch.randperm inside neighbours
    v = _Imports("pfl_edge.topology", False)
    v.visit(ast.parse(src.read_text().replace("    k = int(arg)\n", "    import torch\n    k = int(arg)\n", 1)))
    assert any(s.name == "torch" and s.where == "neighbours" for s in v.sites)
    guarded = _Imports("m", False)
    guarded.visit(ast.parse("def f():\n    try:\n        import torch\n    except ImportError:\n        pass\n"))
    assert [s.guarded for s in guarded.sites] == [True]
    # without its excuse, the agent's torch-arrays branch is reported
    _, bad, _ = reach(ENTRIES, {k: v for k, v in ALLOWED.items() if k != "edge_runtime.agent:Agent._setup"})
    assert [s.key for s in bad] == ["edge_runtime.agent:Agent._setup"]
