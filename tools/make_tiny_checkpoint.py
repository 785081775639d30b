"""Builds the bundled tiny policy `model_configs/tiny/tiny_sft.ckpt`: the tiny Qwen2 fine-tuned (SFT) on the
bundled GSM8K-style sample, answers written in the R1 format `<think>...</think><answer>N</answer>`.

    .venv/bin/python tools/make_tiny_checkpoint.py [--steps 400] [--output model_configs/tiny/tiny_sft.ckpt]

A random tiny model earns no reward at all, so GRPO on it has no signal; after this SFT the tiny model
mostly follows the format (format reward > 0) and sometimes gets an answer right, so the bundled GRPO
run (`bash run_grpo.sh`) shows rewards and advantages that move. Deterministic for a given seed on one
machine; the checkpoint is written atomically.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mindrlhf.algorithms.policy_cells import ResponseNLLLoss  # noqa: E402
from mindrlhf.data import build_prompt, pad_rows, read_problems  # noqa: E402
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer  # noqa: E402
from mindrlhf.parallel.layers import init_random_weights  # noqa: E402
from mindrlhf.parallel.spmd import SPMDTrainStep  # noqa: E402
from mindrlhf.utils.atomic import atomic_output  # noqa: E402
from mindrlhf.utils.logging import setup_logging  # noqa: E402

logger = logging.getLogger("mindrlhf.tools.make_tiny_checkpoint")
TINY = ROOT / "model_configs" / "tiny"
PROMPT_WIDTH, RESPONSE_WIDTH = 160, 96


def r1_completion(gsm8k_answer: str) -> str:
    """`reasoning #### N` -> `<think>\\nreasoning\\n</think>\\n<answer>N</answer>` (calculator notes removed)."""
    reasoning, _, answer = gsm8k_answer.rpartition("####")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
    return f"<think>\n{reasoning}\n</think>\n<answer>{answer.strip()}</answer>"


def build_examples(tokenizer, data_path, template):
    prompts, responses = [], []
    for problem in read_problems(data_path):
        prompt = tokenizer.encode(build_prompt(problem.question, template))
        response = tokenizer.encode(r1_completion(problem.answer)) + [tokenizer.eos_token_id]
        if len(prompt) <= PROMPT_WIDTH and len(response) <= RESPONSE_WIDTH:
            prompts.append(prompt)
            responses.append(response)
    return prompts, responses


def train(steps: int, batch_size: int, learning_rate: float, seed: int, data_path, template="r1_think"):
    """SFT of the seeded tiny model; returns (model, per-step losses)."""
    config = Qwen2Config.from_yaml(TINY / "model.yaml")
    tokenizer = Qwen2Tokenizer(TINY / "tokenizer" / "vocab.json", TINY / "tokenizer" / "merges.txt")
    prompts, responses = build_examples(tokenizer, data_path, template)
    model = Qwen2ForCausalLM(config)
    init_random_weights(model, seed=seed)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=learning_rate, weight_decay=0.0)
    step = SPMDTrainStep(ResponseNLLLoss(model), optimizer)
    rng = np.random.default_rng(seed)
    losses = []
    order = np.array([], np.int64)
    for index in range(steps):
        if len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(len(prompts))])
        picked, order = order[:batch_size], order[batch_size:]
        prompt_ids, prompt_mask = pad_rows([prompts[i] for i in picked], PROMPT_WIDTH, tokenizer.pad_token_id)
        response_ids, response_mask = pad_rows([responses[i] for i in picked], RESPONSE_WIDTH, tokenizer.pad_token_id,
                                               side="right")
        (loss, _), _ = step(*(ms.Tensor(a) for a in (prompt_ids, prompt_mask, response_ids, response_mask)))
        losses.append(float(loss.asnumpy()))
        if (index + 1) % 50 == 0 or index == 0:
            logger.info("step %d/%d | loss %.4f", index + 1, steps, losses[-1])
    return model, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=str(ROOT / "examples/qwen_grpo_tutorial/data/gsm8k_sample.jsonl"))
    parser.add_argument("--output", default=str(TINY / "tiny_sft.ckpt"))
    args = parser.parse_args(argv)
    setup_logging()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    model, losses = train(args.steps, args.batch_size, args.learning_rate, args.seed, args.data)
    with atomic_output(args.output, ".ckpt") as tmp:
        ms.save_checkpoint(model, tmp)
    logger.info("wrote %s (final loss %.4f, first %.4f)", args.output, losses[-1], losses[0])


if __name__ == "__main__":
    main()
