"""The layering the README's Layout section promises, checked on the source (as SpecForge's architecture test).

Layers, lowest first: the package root `draftsmith` (config, errors, file integrity, tracking) <- models
<- data <- eval <- train <- scripts. A module imports only from its own layer or lower ones, every import
of a project module sits at the top of its file (no function-local imports hiding a cycle), and the
module graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package folder -> (import prefix, layer rank)
LAYERS = {"draftsmith": ("draftsmith", 0), "models": ("draftsmith.models", 1), "data": ("draftsmith.data", 2),
          "eval": ("draftsmith.eval", 3), "train": ("draftsmith.train", 4), "scripts": ("draftsmith.scripts", 5)}


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    prefix = LAYERS[folder][0]
    inner = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = [p for p in inner if p != "__init__"]
    return ".".join([prefix, *parts]) if parts else prefix


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS and parts[1] != "draftsmith":
        return LAYERS[parts[1]][1]
    return 0


def project_imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported draftsmith module, at top level?, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / `try:` blocks at the top count as top level
        if isinstance(node, (ast.If, ast.Try)):
            top_level |= {id(child) for child in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            if name == "draftsmith" or name.startswith("draftsmith."):
                found.append((name, id(node) in top_level, node.lineno))
    return found


def all_modules() -> dict[str, Path]:
    modules = {}
    for folder in LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            modules[module_name(path)] = path
    return modules


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an import refers to (`from draftsmith.eval import bench` -> the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_imports_go_one_way_and_sit_at_the_top():
    modules = all_modules()
    problems = []
    for module, path in modules.items():
        for name, top, line in project_imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if not top:
                problems.append(f"{where}: function-local import of {name}")
            if layer_of(name) > layer_of(module):
                problems.append(f"{where}: {module} (layer {layer_of(module)}) imports {name} (layer {layer_of(name)})")
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    modules = all_modules()
    graph = {m: sorted({r for name, _, _ in project_imports(p) if (r := resolve(name, modules)) and r != m})
             for m, p in modules.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for child in graph[node]:
            if state.get(child) == 1:
                return stack[stack.index(child):] + [child]
            if child not in state:
                cycle = visit(child)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for module in graph:
        if module not in state:
            cycle = visit(module)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", ["draftsmith.models.target", "draftsmith.data.sources", "draftsmith.eval.decode.decoder"])
def test_layer_map_is_what_the_readme_says(name):
    assert name in all_modules()


# Inside eval: the decode core <- the policies <- the harness (bench, methods, report, ...).
EVAL_SUBLAYERS = (("draftsmith.eval.decode", ("draftsmith.eval.decode",)),
                  ("draftsmith.eval.policies", ("draftsmith.eval.decode", "draftsmith.eval.policies")))


@pytest.mark.parametrize("package,allowed", EVAL_SUBLAYERS)
def test_decode_core_and_policies_import_only_below_them(package, allowed):
    problems = []
    for module, path in all_modules().items():
        if not module.startswith(package):
            continue
        for name, _, line in project_imports(path):
            if name.startswith("draftsmith.eval") and not name.startswith(allowed):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {module} imports {name}")
    assert not problems, "\n".join(problems)
