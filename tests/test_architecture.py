"""The shape of the library (docs/architecture.md): packages import only packages below them, no two modules import
each other (imports inside functions count), and no function runs longer than a screen. And the shape of tests/:
each test module in the folder of what it tests, shared helpers in `support` (no test module imports another), the
repository's paths derived in one place, the worker scripts on one set-up."""
import ast
import re
from collections import Counter
from pathlib import Path

import pytest
from support.paths import LIBRARY, TESTS, WORKERS_DIR

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


# ---------------------------------------------------------------------------------------------- the tests' layout
ROOT_TEST_MODULES = {"test_architecture.py", "test_lint.py"}  # about the whole tree, not one package
# tests/'s own files beside them: the shared fixtures, and a shim benchmarks/model_forward.py still imports
ROOT_HELPERS = {"conftest.py"}
NOT_LIBRARY = {"tools", "examples", "benchmarks"}  # tests of the repository's scripts
# the only files that find the repository from their own location: support's paths and the workers' bootstrap,
# which must locate tests/ before it can import support
DERIVE_PATHS = {"support/paths.py", "workers/worker_setup.py"}


def files_under_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def where(path: Path) -> str:
    return path.relative_to(TESTS).as_posix()


def allowed_test_folders() -> set[str]:
    """The folders a test module may live in: a package or top-level module of mindrlhf, or a script folder."""
    packages = {p.name for p in LIBRARY.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in LIBRARY.glob("*.py") if p.stem != "__init__"}
    return packages | modules | NOT_LIBRARY


def test_each_test_module_lives_in_the_folder_of_what_it_tests():
    folders = allowed_test_folders()
    misplaced = []
    for path in files_under_tests():
        if not path.name.startswith("test_"):
            continue
        parts = path.relative_to(TESTS).parts
        if len(parts) == 1 and path.name not in ROOT_TEST_MODULES:
            misplaced.append(f"{where(path)}: only {sorted(ROOT_TEST_MODULES)} stay at tests/'s root")
        elif len(parts) > 1 and (len(parts) != 2 or parts[0] not in folders):
            misplaced.append(f"{where(path)}: not in tests/<folder>/ for a folder in {sorted(folders)}")
    assert not misplaced, "test modules out of place:\n" + "\n".join(misplaced)


def test_test_module_names_are_unique():
    """pytest imports the test folders (no __init__.py) by file name: two modules of one name would collide."""
    names = Counter(p.name for p in files_under_tests() if p.name.startswith("test_"))
    assert not [name for name, count in names.items() if count > 1], names.most_common(3)


def test_shared_helpers_live_in_support():
    stray = [where(p) for p in files_under_tests()
             if p.parent == TESTS and p.name not in ROOT_TEST_MODULES | ROOT_HELPERS]
    assert not stray, f"helper modules at tests/'s root (put them in tests/support/): {stray}"
    assert (TESTS / "support" / "__init__.py").is_file()


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module an import names, at any level: `from a import b` names a and a.b."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_test_module_or_worker_script_is_imported():
    """Tests share code through `support` (and fixtures through conftest.py): no file under tests/ imports a test
    module, and no test imports a worker script (the workers import only each other's set-up, worker_setup)."""
    workers = {p.stem for p in WORKERS_DIR.glob("*.py")} | {"workers"}
    bad = []
    for path in files_under_tests():
        in_workers = path.parent == WORKERS_DIR
        for name in imported_modules(ast.parse(path.read_text(encoding="utf-8"))):
            parts = name.split(".")
            if any(part.startswith("test_") for part in parts):
                bad.append(f"{where(path)} imports {name}")
            elif not in_workers and parts[0] in workers:
                bad.append(f"{where(path)} imports the worker script {name}")
    assert not bad, "imports that should go through tests/support:\n" + "\n".join(sorted(bad))


def derives_paths(tree: ast.Module) -> list[str]:
    """Where a module finds paths from its own location: `__file__`, `<path>.parents[...]`, `.parent.parent`,
    `dirname(dirname(...))`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "__file__":
            found.append(f"line {node.lineno}: __file__")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "parents":
            found.append(f"line {node.lineno}: .parents[...]")
        elif isinstance(node, ast.Attribute) and node.attr == "parent" and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parent":
            found.append(f"line {node.lineno}: .parent.parent")
        elif isinstance(node, ast.Call) and re.search(r"dirname$", ast.unparse(node.func)) and node.args and \
                isinstance(node.args[0], ast.Call) and re.search(r"dirname$", ast.unparse(node.args[0].func)):
            found.append(f"line {node.lineno}: dirname(dirname(...))")
    return found


def test_only_support_paths_derives_the_repository_root():
    bad = [f"{where(path)} {found}" for path in files_under_tests() if where(path) not in DERIVE_PATHS
           for found in derives_paths(ast.parse(path.read_text(encoding="utf-8")))]
    assert not bad, "paths derived from a file's location (take them from support.paths):\n" + "\n".join(bad)


def top_level_imports(tree: ast.Module) -> list[str]:
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("worker", sorted(p.name for p in WORKERS_DIR.glob("*.py") if p.stem != "worker_setup"))
def test_worker_scripts_use_the_shared_set_up(worker):
    """Each worker imports `worker_setup` (sys.path to tests/ and the repository) before `support`, and leaves
    MindSpore's context and communication set-up to it."""
    tree = ast.parse((WORKERS_DIR / worker).read_text(encoding="utf-8"))
    names = top_level_imports(tree)
    assert "worker_setup" in names, f"{worker}: no `import worker_setup` at module level"
    first_support = next((i for i, name in enumerate(names) if name.split(".")[0] == "support"), len(names))
    assert names.index("worker_setup") < first_support, f"{worker}: imports support before worker_setup"
    own = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("set_context"):
            own.append(f"line {node.lineno}: set_context (worker_setup.graph_mode_on_cpu)")
        elif isinstance(node, ast.ImportFrom) and node.module == "mindspore.communication" and \
                any(alias.name == "init" for alias in node.names):
            own.append(f"line {node.lineno}: communication init (worker_setup.init_communication)")
    assert not own, f"{worker} sets up on its own: {own}"
