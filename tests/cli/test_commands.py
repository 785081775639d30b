"""The installed commands (setup.py's console scripts, `mindrlhf.cli`): each runs from the virtualenv's bin folder,
and the tutorial's paths are the same commands."""
import ast
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from support.msrun import run_command
from support.paths import README, ROOT

COMMANDS = {  # console script -> (its module in mindrlhf.cli, the tutorial path that calls the same entry)
    "mindrlhf-train": ("train", "examples/qwen_grpo_tutorial/grpo_one_stage.py"),
    "mindrlhf-sft": ("stages", "examples/qwen_grpo_tutorial/sft.py"),
    "mindrlhf-reward": ("stages", "examples/qwen_grpo_tutorial/reward.py"),
    "mindrlhf-dpo": ("stages", "examples/qwen_grpo_tutorial/dpo.py"),
    "mindrlhf-prepare-data": ("prepare_data", "examples/qwen_grpo_tutorial/rlhf_data.py"),
    "mindrlhf-convert-weight": ("convert_weight", "tools/convert_weight.py"),
    "mindrlhf-transform-checkpoint": ("transform_checkpoint", "tools/transform_checkpoint.py"),
}


def entry_of(command: str) -> str:
    """A command's function: a job's entry adds its exit handling (`launch.run_script`), a stage's is named after it."""
    if command == "mindrlhf-train":
        return "run"
    if COMMANDS[command][0] == "stages":
        return command.removeprefix("mindrlhf-")
    return "main"


def test_the_installed_console_scripts_are_the_cli_modules():
    installed = {e.name: e.value for e in entry_points(group="console_scripts") if e.name.startswith("mindrlhf")}
    assert installed == {name: f"mindrlhf.cli.{module}:{entry_of(name)}" for name, (module, _) in COMMANDS.items()}
    readme = README.read_text()
    for name, (_, path) in COMMANDS.items():  # the README's table of commands
        assert f"| `{name}` | `{path}` |" in readme, name


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_runs_from_the_virtualenv(command):
    done = run_command([Path(sys.executable).parent / command, "--help"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"usage: {command} "), done.stdout[:300]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_tutorial_paths_call_the_same_entry(command):
    """Each thin file imports its command's entry and calls it under `__main__`, and does nothing else (no
    `sys.path` edit, no code of its own): a user's `python tools/convert_weight.py ...` is `mindrlhf-convert-weight`."""
    module, path = COMMANDS[command]
    entry = entry_of(command)
    tree = ast.parse((ROOT / path).read_text())
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [(f"mindrlhf.cli.{module}", [entry])]
    main_block = [node for node in tree.body if isinstance(node, ast.If)]
    assert len(main_block) == 1 and ast.unparse(main_block[0].test) == "__name__ == '__main__'"
    assert entry + "()" in ast.unparse(main_block[0])
    others = [node for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom, ast.If, ast.Expr))]
    assert others == [], ast.unparse(others[0])
