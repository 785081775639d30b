"""Trains the tiny bundled byte-level BPE tokenizer (model_configs/tiny/tokenizer/) on the sample data.

The result is a GPT-2/Qwen style `vocab.json` + `merges.txt` pair that `Qwen2Tokenizer` loads: the 256
byte symbols plus the learned merges (about 1000 entries in all), trained with Qwen2's NFC normaliser and
pre-tokenizer, so any text (any Unicode) still encodes losslessly. Qwen's special tokens follow the vocabulary
(ids len(vocab), +1, +2) and are declared in `tokenizer_config.json` as in a Qwen2.5 folder, so that
`transformers.AutoTokenizer` gives the same ids. Training is deterministic: the same inputs give byte-identical
files.

    python tools/make_tiny_tokenizer.py [--data FILE.jsonl] [--vocab_size 1000] [--output_dir DIR]
"""
from __future__ import annotations

import argparse
import json
import logging
import os

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

from mindrlhf.data.templates import R1_THINK_SYSTEM_PROMPT
from mindrlhf.models.qwen2.tokenizer import (
    ENDOFTEXT,
    IM_END,
    QWEN25_DEFAULT_SYSTEM_PROMPT,
    SPECIAL_TOKENS,
    qwen2_pre_tokenizer,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "data", "gsm8k_sample.jsonl")
DEFAULT_OUTPUT = os.path.join(ROOT, "model_configs", "tiny", "tokenizer")
MERGES_HEADER = "#version: 0.2"

logger = logging.getLogger("make_tiny_tokenizer")


def corpus_texts(data_path: str) -> list[str]:
    """Training texts: questions and answers of the sample data, the system prompts and chat role names.

    Special-token strings are left out on purpose: they are added tokens, never BPE pieces.
    """
    texts = [QWEN25_DEFAULT_SYSTEM_PROMPT, R1_THINK_SYSTEM_PROMPT, "system\n", "user\n", "assistant\n"]
    with open(data_path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question, answer = record["question"], record["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SystemExit(f"{data_path}:{line_no}: expected a JSON object with question and answer "
                                 f"({err})") from None
            final = answer.rsplit("####", 1)[-1].strip()
            texts += [question, answer, f"<think>\n{answer}\n</think>\n<answer>{final}</answer>"]
    return texts


def train_tiny_bpe(texts: list[str], vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE with Qwen2's pre-tokenizer; returns (vocab, merges in rank order)."""
    tokenizer = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = qwen2_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in model["merges"]]
    return dict(model["vocab"]), merges


def tokenizer_config(vocab_size: int) -> dict:
    """`tokenizer_config.json` of a Qwen2 tokenizer whose BPE vocabulary has `vocab_size` entries: the special
    tokens as added tokens right after it, `<|im_end|>` ending a turn, `<|endoftext|>` padding."""
    added = {str(vocab_size + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, token in enumerate(SPECIAL_TOKENS)}
    return {"add_prefix_space": False, "added_tokens_decoder": added, "bos_token": None,
            "clean_up_tokenization_spaces": False, "eos_token": IM_END, "errors": "replace", "pad_token": ENDOFTEXT,
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def write_tokenizer_files(vocab: dict[str, int], merges: list[tuple[str, str]], output_dir: str) -> None:
    """Writes vocab.json (sorted by id, one entry a line), merges.txt (`#version` header) and
    tokenizer_config.json."""
    os.makedirs(output_dir, exist_ok=True)
    ordered = dict(sorted(vocab.items(), key=lambda item: item[1]))
    with open(os.path.join(output_dir, "vocab.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(ordered, ensure_ascii=False, indent=0) + "\n")
    with open(os.path.join(output_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write(MERGES_HEADER + "\n")
        f.writelines(f"{left} {right}\n" for left, right in merges)
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(tokenizer_config(len(vocab)), indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="GSM8K-style JSONL to train on")
    parser.add_argument("--vocab_size", type=int, default=1000, help="vocabulary size incl. the 256 byte symbols")
    parser.add_argument("--output_dir", default=DEFAULT_OUTPUT,
                        help="where vocab.json, merges.txt and tokenizer_config.json go")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.vocab_size < 256:
        raise SystemExit(f"--vocab_size must be at least 256 (the byte symbols), got {args.vocab_size}")
    vocab, merges = train_tiny_bpe(corpus_texts(args.data), args.vocab_size)
    write_tokenizer_files(vocab, merges, args.output_dir)
    logger.info("wrote %s: %d tokens (%d merges); special tokens have ids %d..%d",
                args.output_dir, len(vocab), len(merges), len(vocab), len(vocab) + 2)


if __name__ == "__main__":
    main()
