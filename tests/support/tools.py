"""The repository's scripts as the tests drive them: the commands' thin files (tools/convert_weight.py,
tools/transform_checkpoint.py: in-process tests call `mindrlhf.cli.<command>.main` instead) run in a fresh
interpreter, and the developer tools that are no package command (tools/sft_policy.py, make_tiny_tokenizer.py,
fetch_smollm2.py) imported as modules."""
import importlib.util
import subprocess
import sys

from support.msrun import run_command
from support.paths import ROOT, TOOLS

CONVERT_WEIGHT = TOOLS / "convert_weight.py"
TRANSFORM_CHECKPOINT = TOOLS / "transform_checkpoint.py"


def tool_module(name: str):
    """tools/<name>.py imported as module `name` (its functions callable in-process)."""
    path = TOOLS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up
    spec.loader.exec_module(module)
    return module


def run_convert_weight(*args) -> subprocess.CompletedProcess:
    """tools/convert_weight.py in a fresh interpreter (~2-4 s each on a busy 2-core machine: used sparingly)."""
    return run_command([sys.executable, CONVERT_WEIGHT, *args], None, 300, cwd=str(ROOT))
