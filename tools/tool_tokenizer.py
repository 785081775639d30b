"""Writes a copy of a tokenizer folder whose chat template renders tools, for a model whose own template does not
(SmolLM2-135M-Instruct, the bundled arithmetic policy): tool calling in the Hermes convention of Qwen2.5's template,
model_configs/templates/hermes_tools.jinja by default. The copy holds tokenizer.json (built from vocab.json +
merges.txt when the folder has none), tokenizer_config.json (the folder's special tokens; its own chat_template
dropped), generation_config.json when the folder has one, and chat_template.jinja. It encodes text to the ids the
folder does (checked), so a model trained with the folder reads the copy unchanged.

    .venv/bin/python tools/tool_tokenizer.py --tokenizer_dir models/SmolLM2-135M-Instruct \\
        --output models/SmolLM2-135M-Instruct-tools
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer
from mindrlhf.models.tokenizer import HFTokenizer, load_tokenizer
from mindrlhf.tool_use import calculator, function_schema
from mindrlhf.utils.atomic import atomic_output

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "model_configs" / "templates" / "hermes_tools.jinja"
SAMPLE = [{"role": "user", "content": "What is 347 * 826? Ana has 12 boxes."},
          {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": '
                                           '"347 * 826"}}</tool_call>'},
          {"role": "tool", "content": "286622"}, {"role": "assistant", "content": "<answer>286622</answer>"}]


def write_tool_tokenizer(source: str, output: Path, template: Path) -> HFTokenizer:
    """The copy of `source` with `template` as its chat template, written to `output` (each file atomically); its
    tokenizer, checked to encode as `source` does."""
    original = load_tokenizer(source)
    output.mkdir(parents=True, exist_ok=True)
    if isinstance(original, Qwen2Tokenizer):
        with atomic_output(output / "tokenizer.json") as tmp:
            original.backend.save(tmp)
        config_path = Path(original.tokenizer_config_path) if original.tokenizer_config_path else None
    else:
        _copy(Path(source) / "tokenizer.json", output)
        config_path = Path(source) / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path and config_path.is_file() else {}
    config.pop("chat_template", None)
    with atomic_output(output / "tokenizer_config.json") as tmp:
        Path(tmp).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if (Path(source) / "generation_config.json").is_file():
        _copy(Path(source) / "generation_config.json", output)
    _copy(template, output, "chat_template.jinja")
    copy = HFTokenizer(output)
    check_same_ids(original, copy, source)
    return copy


def _copy(path: Path, folder: Path, name: str | None = None) -> None:
    with atomic_output(folder / (name or path.name)) as tmp:
        shutil.copyfile(path, tmp)


def check_same_ids(original, copy: HFTokenizer, source: str) -> None:
    """The copy encodes a tool conversation (rendered by its own template) to `original`'s ids, and renders tools."""
    text = copy.apply_chat_template(SAMPLE, tools=[function_schema(calculator)])
    if not copy.supports_tools or copy.encode(text) != original.encode(text):
        raise SystemExit(f"error: the copy of {source} does not encode as the folder does (or renders no tools)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer_dir", required=True, help="the tokenizer folder to copy")
    parser.add_argument("--output", required=True, help="the folder to write (replaced when it exists)")
    parser.add_argument("--chat_template", default=str(TEMPLATE), help="a Jinja chat template that renders tools")
    args = parser.parse_args(argv)
    try:
        tokenizer = write_tool_tokenizer(args.tokenizer_dir, Path(args.output), Path(args.chat_template))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {tokenizer!r} with the chat template {args.chat_template}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
