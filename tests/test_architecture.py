"""The shape of the library (docs/architecture.md): packages import only packages below them, no two modules import
each other (imports inside functions count), no function runs longer than a screen nor a class past 250 lines, the
modules of `MINDSPORE_FREE` import without MindSpore and an import sits inside a function only for that (or a reason
in `DEFERRED_IMPORTS`). And the shape of tests/:
each test module in the folder of what it tests, shared helpers in `support` (no test module imports another), the
repository's paths derived in one place, the worker scripts on one set-up."""
import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support.paths import BENCHMARKS, EXAMPLES, LIBRARY, TESTS, TOOLS, WORKERS_DIR

# bottom to top; a package may import itself and those before it
LAYERS = ["utils", "optim", "configs", "parallel", "models", "data", "tool_use", "reward", "algorithms", "generation",
          "checkpoint", "engine", "trainer", "cli"]
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250  # a class that grows past it holds more than one job (the trainer's loop was 403 lines)
# Modules that import without loading MindSpore (2-3 s), so that what they serve answers at once: the configs and
# the job's checks (`mindrlhf-train --help` and a bad flag import trainer.launch), the memory plan, the numpy math,
# the data and tokenizer tools, postmortem ("pkg.*": the package and every module in it). They import MindSpore, or
# a library module that loads it, inside the function that needs it; every other import sits at the top of its
# module unless DEFERRED_IMPORTS gives a reason (docs/architecture.md, "Imports").
MINDSPORE_FREE = [
    "mindrlhf.configs.*", "mindrlhf.utils.*", "mindrlhf.data.*", "mindrlhf.tool_use.*", "mindrlhf.reward.*",
    "mindrlhf.algorithms", "mindrlhf.algorithms.advantages", "mindrlhf.algorithms.aggregation",
    "mindrlhf.algorithms.kl", "mindrlhf.algorithms.policy_loss", "mindrlhf.algorithms.ppo",
    "mindrlhf.models.qwen2", "mindrlhf.models.qwen2.config", "mindrlhf.models.qwen2.tokenizer",
    "mindrlhf.models.tokenizer", "mindrlhf.models.tokenizer_base",
    "mindrlhf.parallel.layout", "mindrlhf.parallel.shared_memory", "mindrlhf.parallel.host_setup",
    "mindrlhf.engine.batches", "mindrlhf.engine.memory_budget", "mindrlhf.engine.memory_plan", "mindrlhf.engine.sizing",
    "mindrlhf.engine.step_shape",
    "mindrlhf.checkpoint.step",
    "mindrlhf.trainer.plan", "mindrlhf.trainer.specs", "mindrlhf.trainer.launch", "mindrlhf.trainer.metrics",
]
# the other imports that stay inside a function: (importing module, imported module) -> why
DEFERRED_IMPORTS = {
    ("mindrlhf.data.sources", "pyarrow"): "optional: only Parquet input needs it (its absence is a DataError)",
    ("mindrlhf.data.sources", "pyarrow.parquet"): "optional: only Parquet input needs it",
    ("mindrlhf.models.qwen2.convert", "torch"): "a test-only dependency: only PyTorch .bin weights need it",
    ("mindrlhf.trainer.metrics", "tensorboardX"): "1.5 s to import, only for --tensorboard_dir",
    ("mindrlhf.trainer.plot", "matplotlib"): "only the progress plot needs it; its backend is set before pyplot loads",
    ("mindrlhf.trainer.plot", "matplotlib.pyplot"): "only the progress plot needs it",
    ("mindrlhf.reward.rules", "math_verify"): "0.7 s to import (sympy) in every process of a job: only a gold answer "
                                              "that is not a number needs it",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(LIBRARY.rglob("*.py"))}


def named_modules(node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The modules an import statement names: `from a import b` names a, and a.b when that is in `known`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or not node.module:
        return []
    return [node.module] + [f"{node.module}.{alias.name}" for alias in node.names
                            if f"{node.module}.{alias.name}" in known]


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """The library modules `tree` imports, at any level (`from pkg import mod` names the module)."""
    return {name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in named_modules(node, known) if name in known}


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


def test_no_library_tool_example_or_benchmark_edits_sys_path():
    """mindrlhf is installed (tools/bootstrap.sh: an editable install), so its commands, tools, examples and benchmarks
    import it as any user's code does; a `sys.path` edit would hide a missing install or a wrong checkout. (A
    benchmark imports its sibling modules by name: run as a script, its own folder is on sys.path.)"""
    scripts = [path for folder in (LIBRARY, TOOLS, EXAMPLES) for path in sorted(folder.rglob("*.py"))]
    scripts += sorted(BENCHMARKS.glob("*.py"))  # not the git-ignored virtualenv beside them (benchmarks/.venv-trl)
    edits = [f"{path.relative_to(LIBRARY.parent)}:{node.lineno}"
             for path in scripts
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.path.insert", "sys.path.append")]
    assert not edits, "sys.path edited at " + ", ".join(edits)


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


def test_classes_hold_one_job():
    long = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"classes longer than {MAX_CLASS_LINES} lines: " + ", ".join(long)


# ---------------------------------------------------------------------------------------- imports inside functions
def library_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(LIBRARY.rglob("*.py"))}


def function_local_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports inside function bodies (each once, however deeply nested), in line order."""
    inside = {node for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))}
    return sorted(inside, key=lambda node: node.lineno)


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: outside functions and `if TYPE_CHECKING:` blocks."""
    skipped = set(function_local_imports(tree))
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING"):
            skipped.update(node for node in ast.walk(block) if isinstance(node, (ast.Import, ast.ImportFrom)))
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in skipped]


def module_level_graph() -> dict[str, set[str]]:
    """Library module -> the modules importing it imports too: its package and what its module level imports."""
    files = library_files()
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[module] = {name for node in module_level_imports(tree) for name in named_modules(node, files)}
        graph[module] |= {module.rsplit(".", 1)[0]} if "." in module else set()
    return graph


def mindspore_chain(module: str, graph: dict[str, set[str]]) -> list[str] | None:
    """The shortest chain of module-level imports by which importing `module` loads MindSpore (`module`, ...,
    `mindspore...`), or None. Modules outside the library count as free (the subprocess test checks them)."""
    came_from, queue = {module: ""}, [module]
    for name in queue:
        if name.split(".")[0] == "mindspore":
            chain = [name]
            while came_from[chain[-1]]:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for target in sorted(graph.get(name, ())):
            if target not in came_from:
                came_from[target] = name
                queue.append(target)
    return None


def mindspore_free_modules(known) -> list[str]:
    """`MINDSPORE_FREE` with each "pkg.*" spelled out."""
    found = [m for m in known if any(m == entry or (entry.endswith(".*") and (m + ".").startswith(entry[:-1]))
                                     for entry in MINDSPORE_FREE)]
    assert {entry for entry in MINDSPORE_FREE if entry.removesuffix(".*") in known} == set(MINDSPORE_FREE), \
        "MINDSPORE_FREE names a module that does not exist"
    return found


def test_mindspore_free_modules_import_no_mindspore_at_module_level():
    graph = module_level_graph()
    chains = [" -> ".join(chain) for module in mindspore_free_modules(graph)
              if (chain := mindspore_chain(module, graph))]
    assert not chains, "MINDSPORE_FREE modules that load MindSpore when imported (import it inside the function " \
                       "that needs it):\n" + "\n".join(chains)


def test_mindspore_free_modules_import_without_loading_it():
    """All of them imported in one fresh interpreter (if together they load no MindSpore, none does), one by one,
    naming the first after which MindSpore is loaded."""
    script = ("import importlib, sys\n"
              "for name in sys.argv[1:]:\n"
              "    importlib.import_module(name)\n"
              "    if 'mindspore' in sys.modules:\n"
              "        print(name)\n"
              "        break\n")
    names = mindspore_free_modules(library_files())
    done = subprocess.run([sys.executable, "-c", script, *names], cwd=LIBRARY.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert not done.stdout.strip(), f"importing {done.stdout.strip()} loads MindSpore (see MINDSPORE_FREE)"


def test_the_jobs_entry_points_load_no_deferred_import():
    """The RL job's and the stages' entry points (imported by every process of a launch, msrun's scheduler too) leave
    the deferred imports to the functions that need them."""
    deferred = sorted({name.split(".")[0] for _, name in DEFERRED_IMPORTS})
    script = ("import sys\n"
              "import mindrlhf.cli.train, mindrlhf.cli.stages\n"
              f"print(sorted(set({deferred!r}) & set(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=LIBRARY.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the entry points import {done.stdout.strip()} (see DEFERRED_IMPORTS)"


def import_problem(module: str, node, free: set[str], graph: dict[str, set[str]]) -> str | None:
    """Why a function-local import should sit at the top of its module, or None when it may stay: the module is
    MindSpore-free and the import loads MindSpore, or `DEFERRED_IMPORTS` gives the reason."""
    names = named_modules(node, graph)
    if all((module, name) in DEFERRED_IMPORTS for name in names):
        return None
    if module not in free:
        return f"{module} is not in MINDSPORE_FREE"
    if not any(mindspore_chain(name, graph) for name in names):
        return "it loads no MindSpore"
    return None


def test_imports_inside_functions_are_needed():
    """An import sits at the top of its module unless the module is MindSpore-free and the import loads MindSpore,
    or `DEFERRED_IMPORTS` says why (an optional or slow dependency of one function)."""
    graph, files = module_level_graph(), library_files()
    free = set(mindspore_free_modules(files))
    free |= {m for m in files if any(f.startswith(m + ".") for f in free)}  # their packages load with them
    misplaced = []
    for module, path in files.items():
        for node in function_local_imports(ast.parse(path.read_text(encoding="utf-8"))):
            problem = import_problem(module, node, free, graph)
            if problem:
                misplaced.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno} {ast.unparse(node)} ({problem})")
    assert not misplaced, "imports inside functions that belong at the top of their module:\n" + "\n".join(misplaced)


# ---------------------------------------------------------------------------------------------- the tests' layout
ROOT_TEST_MODULES = {"test_architecture.py", "test_lint.py"}  # about the whole tree, not one package
# tests/'s own files beside them: the shared fixtures, and a shim benchmarks/model_forward.py still imports
ROOT_HELPERS = {"conftest.py"}
# tests of the repository's scripts, of the suite's own and of the user documents
NOT_LIBRARY = {"tools", "examples", "benchmarks", "suite", "docs"}
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
