"""Converts GSM8K-style problems (JSON list, JSONL or Parquet; one file or a folder) into the prompt MindRecord.

    python examples/qwen_grpo_tutorial/rlhf_data.py --tokenizer_dir model_configs/tiny/tokenizer \\
        --file_path examples/qwen_grpo_tutorial/data/gsm8k_sample.jsonl \\
        --output_path /tmp/gsm8k_sample.mindrecord --template qwen_chat --max_prompt_length 256

MindRLHF's form works too: `--vocab_path vocab.json --merges_file_path merges.txt --file_path /path/to/raw/data/
--output_path /path/to/mindrecord/`. A `--file_path` folder stands for every *.json, *.jsonl and *.parquet file
directly inside it, read in sorted file-name order (records in file order within each file), all written to one
MindRecord. An `--output_path` that is a folder (existing, or ending with '/') gets `<folder>/prompts.mindrecord`;
pass that file to the trainer's --mind_dataset_dir. Parquet files (e.g. openai/gsm8k's `question`/`answer`, or
MATH-style `--prompt_key problem --answer_key solution`) need pyarrow (requirements.txt). The same command is
installed as `mindrlhf-prepare-data`.
"""
from __future__ import annotations

import argparse
import logging
import sys

from mindrlhf.configs.cli import OneLineErrorParser
from mindrlhf.data.mindrecord import DEFAULT_OUTPUT_NAME, DataError, convert_to_mindrecord
from mindrlhf.data.stage_records import convert_stage_data
from mindrlhf.data.templates import GSM8K_INSTRUCTION, TEMPLATE_NAMES
from mindrlhf.models.tokenizer import load_tokenizer
from mindrlhf.tool_use import load_tools

logger = logging.getLogger("rlhf_data")


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (names as in MindRLHF's rlhf_data.py)."""
    parser = OneLineErrorParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tokenizer_dir", default=None,
                        help="Hugging Face tokenizer folder: tokenizer.json (+ tokenizer_config.json), or vocab.json + "
                             "merges.txt")
    parser.add_argument("--vocab_path", default=None, help="Qwen tokenizer vocab.json (instead of --tokenizer_dir)")
    parser.add_argument("--merges_file_path", default=None, help="Qwen tokenizer merges.txt (with --vocab_path)")
    parser.add_argument("--file_path", required=True,
                        help="input: a JSON list, JSONL or Parquet file of problems, or a folder: every *.json, "
                             "*.jsonl and *.parquet file directly inside it, read in sorted file-name order (each "
                             "file's records in their order)")
    parser.add_argument("--output_path", required=True,
                        help="output MindRecord file (a .db index goes next to it; an existing pair is replaced), "
                             "or a folder (existing, or ending with '/'): then <folder>/" + DEFAULT_OUTPUT_NAME)
    parser.add_argument("--max_prompt_length", type=int, default=512,
                        help="prompts with more tokens are dropped (never truncated)")
    parser.add_argument("--template", choices=TEMPLATE_NAMES, default="qwen_chat",
                        help="chat: the tokenizer's chat template; qwen_chat: the Qwen2.5 chat template; r1_think: "
                             "the tokenizer's chat template with the <think>/<answer> system prompt; raw: the "
                             "question text as is")
    parser.add_argument("--instruction", default="",
                        help="text appended to every question after a space; 'gsm8k' stands for verl's "
                             f"GSM8K instruction ({GSM8K_INSTRUCTION!r}), which the hash_format reward checks")
    parser.add_argument("--tools", nargs="*", default=[],
                        help="tools offered to the model in the prompts (the chat template renders their schemas): "
                             "built-ins (calculator, python) or package.module:function, as the job's --tools")
    parser.add_argument("--prompt_key", default="question",
                        help="field (Parquet: column) holding the question, e.g. 'problem' for MATH")
    parser.add_argument("--answer_key", default="answer",
                        help="field (Parquet: column) holding the gold answer, e.g. 'solution' for MATH")
    parser.add_argument("--kind", choices=("prompts", "sft", "pairwise", "auto"), default="prompts",
                        help="prompts: questions and gold answers for the RL jobs; sft: conversations (Alpaca "
                             "instruction/input/output, ShareGPT conversations, or chat messages) with the "
                             "assistant's tokens marked for training; pairwise: preference pairs (prompt/chosen/"
                             "rejected, strings or messages); auto: sft or pairwise, from the first record's fields")
    parser.add_argument("--max_length", type=int, default=2048,
                        help="sft and pairwise: rows with more tokens (a pair: its prompt and longer answer) are "
                             "dropped (never truncated)")
    parser.add_argument("--skip_bad_lines", action="store_true",
                        help="skip and count malformed lines (Parquet: rows) instead of stopping at the first one")
    parser.add_argument("--allow_non_numeric_answers", action="store_true",
                        help="accept answers with neither a gold number nor a final \\boxed{...} LaTeX answer (MATH's "
                             "solutions, which the accuracy reward checks by meaning, need no flag); for custom reward "
                             "functions")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[rlhf_data] %(levelname)s %(message)s")
    if args.kind != "prompts":
        return _convert_stage_data(args)
    try:
        tokenizer = load_tokenizer(args.tokenizer_dir, args.vocab_path, args.merges_file_path)
        instruction = GSM8K_INSTRUCTION if args.instruction == "gsm8k" else args.instruction
        tools = [tool.schema for tool in load_tools(args.tools)]
        stats = convert_to_mindrecord(args.file_path, args.output_path, tokenizer, template=args.template,
                                      max_prompt_length=args.max_prompt_length, prompt_key=args.prompt_key,
                                      answer_key=args.answer_key, skip_bad_lines=args.skip_bad_lines,
                                      numeric_answers=not args.allow_non_numeric_answers,
                                      instruction=instruction, tools=tools)
    except (DataError, OSError, ValueError) as err:  # a ToolDefinitionError too
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(stats.input_files) > 1:
        logger.info("read %d files: %s", len(stats.input_files), ", ".join(stats.input_files))
    logger.info("written: %d, dropped too long (> %d tokens): %d, bad lines: %d -> %s",
                stats.written, args.max_prompt_length, stats.dropped_too_long, stats.bad_lines, stats.output_path)
    return 0


def _convert_stage_data(args) -> int:
    """`--kind sft|pairwise|auto`: conversations or preference pairs, through the tokenizer's chat template."""
    try:
        tokenizer = load_tokenizer(args.tokenizer_dir, args.vocab_path, args.merges_file_path)
        stats = convert_stage_data(args.file_path, args.output_path, tokenizer, args.kind, args.max_length,
                                   args.skip_bad_lines)
    except (DataError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logger.info("%s -> %s", stats.summary(), stats.output_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
