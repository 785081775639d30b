"""Converts GSM8K-style JSON / JSONL problems into the prompt MindRecord that GRPO training reads.

    python examples/qwen_grpo_tutorial/rlhf_data.py \\
        --vocab_path model_configs/tiny/tokenizer/vocab.json \\
        --merges_file_path model_configs/tiny/tokenizer/merges.txt \\
        --file_path examples/qwen_grpo_tutorial/data/gsm8k_sample.jsonl \\
        --output_path /tmp/gsm8k_sample.mindrecord --template qwen_chat --max_prompt_length 256
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mindrlhf.data.mindrecord import DataError, convert_to_mindrecord  # noqa: E402
from mindrlhf.data.templates import TEMPLATE_NAMES  # noqa: E402
from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer  # noqa: E402

logger = logging.getLogger("rlhf_data")


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags (names as in MindRLHF's rlhf_data.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vocab_path", required=True, help="tokenizer vocab.json")
    parser.add_argument("--merges_file_path", required=True, help="tokenizer merges.txt")
    parser.add_argument("--file_path", required=True, help="input: a JSON list or JSONL of problems")
    parser.add_argument("--output_path", required=True, help="output MindRecord file (a .db index goes next to it)")
    parser.add_argument("--max_prompt_length", type=int, default=512,
                        help="prompts with more tokens are dropped (never truncated)")
    parser.add_argument("--template", choices=TEMPLATE_NAMES, default="qwen_chat",
                        help="qwen_chat: Qwen2.5 chat template; r1_think: chat template with the <think>/<answer> "
                             "system prompt; raw: the question text as is")
    parser.add_argument("--prompt_key", default="question", help="field holding the question")
    parser.add_argument("--answer_key", default="answer", help="field holding the gold answer")
    parser.add_argument("--skip_bad_lines", action="store_true",
                        help="skip and count malformed lines instead of stopping at the first one")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the conversion; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[rlhf_data] %(levelname)s %(message)s")
    try:
        tokenizer = Qwen2Tokenizer(args.vocab_path, args.merges_file_path)
        stats = convert_to_mindrecord(args.file_path, args.output_path, tokenizer, template=args.template,
                                      max_prompt_length=args.max_prompt_length, prompt_key=args.prompt_key,
                                      answer_key=args.answer_key, skip_bad_lines=args.skip_bad_lines)
    except (DataError, OSError, ValueError) as err:
        logger.error("%s", err)
        return 1
    logger.info("written: %d, dropped too long (> %d tokens): %d, bad lines: %d -> %s",
                stats.written, args.max_prompt_length, stats.dropped_too_long, stats.bad_lines, args.output_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
