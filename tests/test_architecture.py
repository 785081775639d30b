"""The shape of the library (docs/architecture.md): packages import only packages below them, no two modules import
each other (imports inside functions count), and no function runs longer than a screen."""
import ast
from pathlib import Path

import pytest

LIBRARY = Path(__file__).parents[1] / "mindrlhf"
# bottom to top; a package may import itself and those before it
LAYERS = ["utils", "optim", "configs", "parallel", "models", "data", "reward", "algorithms", "generation",
          "checkpoint", "engine", "trainer"]
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(LIBRARY.rglob("*.py"))}


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The library modules `tree` imports, at any level (`from pkg import mod` names the module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in known}


def package_of(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_packages_import_only_the_packages_below_them():
    trees = modules()
    upward = []
    for module, tree in trees.items():
        mine = package_of(module)
        if mine not in LAYERS:
            continue
        for target in imported(tree, set(trees)):
            theirs = package_of(target)
            if theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that run upward: " + ", ".join(sorted(upward))
    assert set(LAYERS) >= {package_of(m) for m in trees if package_of(m)}, "a package missing from LAYERS"


def test_no_import_cycle_between_modules():
    trees = modules()
    graph = {module: imported(tree, set(trees)) - {module} for module, tree in trees.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(cycles)


@pytest.mark.parametrize("package", LAYERS)
def test_functions_fit_a_screen(package):
    long = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if package_of(module_name(path)) != package:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions longer than a screen: " + ", ".join(long)
