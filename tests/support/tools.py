"""The repository's tools/*.py scripts as the tests drive them: imported as a module (`main(argv)` in-process,
cheaper) or run in a fresh interpreter."""
import importlib.util
import subprocess
import sys

from support.msrun import run_command
from support.paths import ROOT, TOOLS

CONVERT_WEIGHT = TOOLS / "convert_weight.py"
TRANSFORM_CHECKPOINT = TOOLS / "transform_checkpoint.py"


def script_module(path, name: str):
    """The script at `path` imported as module `name` (its `main`, `build_parser`, ... callable in-process)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up
    spec.loader.exec_module(module)
    return module


def transform_checkpoint_tool():
    """tools/transform_checkpoint.py as a module."""
    return script_module(TRANSFORM_CHECKPOINT, "transform_checkpoint_tool")


def run_convert_weight(*args) -> subprocess.CompletedProcess:
    """tools/convert_weight.py in a fresh interpreter (~2-4 s each on a busy 2-core machine: used sparingly)."""
    return run_command([sys.executable, CONVERT_WEIGHT, *args], None, 300, cwd=str(ROOT))
