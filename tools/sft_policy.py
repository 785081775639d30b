"""Supervised fine-tuning of a seeded Qwen2 model on GSM8K-style JSONL, answers in the R1 form
`<think>reasoning</think><answer>N</answer>`, with the project's own training code (SPMD train step, AdamW,
learning-rate schedule). It builds the bundled policies:

    # run_grpo.sh's default policy (model_configs/arith/policy: config.json + model.safetensors + tokenizer),
    # ~17 min on 2 CPU cores: 1100 updates on worked solutions, then 200 in which half of the problems are
    # answered without the working, so that the policy often answers directly (and wrongly): GRPO's room
    .venv/bin/python tools/sft_policy.py --model_yaml model_configs/arith/train.yaml \
        --tokenizer_dir model_configs/arith/policy --data examples/qwen_grpo_tutorial/data/arithmetic_train.jsonl \
        --eval_data examples/qwen_grpo_tutorial/data/arithmetic_heldout.jsonl --steps 1300 --batch_size 16 \
        --learning_rate 1e-3 --warmup_steps 50 --direct_fraction 0.5 --direct_from_step 1100 \
        --output model_configs/arith/policy
    # the tests' tiny policy (model_configs/tiny/tiny_sft.ckpt), with the defaults
    .venv/bin/python tools/sft_policy.py

A random model earns no reward, so GRPO on it has no signal; after this SFT the model follows the format and
answers part of the problems right, which leaves GRPO room to improve. The output is written atomically and a
rerun with the same arguments on the same machine rebuilds it bit-identically (fixed seeds, one process).
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import mindspore as ms
import numpy as np

from mindrlhf.algorithms import aggregation_weights
from mindrlhf.algorithms.policy_cells import SFTLossNet
from mindrlhf.data.answers import r1_completion
from mindrlhf.data.mindrecord import read_problems
from mindrlhf.data.reader import pad_rows
from mindrlhf.data.templates import build_prompt
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.models.tokenizer import load_tokenizer
from mindrlhf.optim import AdamW, learning_rate_at
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.spmd import SPMDTrainStep
from mindrlhf.utils.atomic import atomic_output
from mindrlhf.utils.logging import setup_logging

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("mindrlhf.tools.sft_policy")
TINY = ROOT / "model_configs" / "tiny"
DATA = ROOT / "examples" / "qwen_grpo_tutorial" / "data"


def padded_width(rows, multiple: int = 16) -> int:
    """The longest row rounded up to `multiple` (one static shape for the whole run)."""
    return -(-max(len(row) for row in rows) // multiple) * multiple


class SFTData:
    """Tokenized prompts (chat template `template`), R1-form responses ending in EOS, and gold answers.

    `direct` marks a seeded `direct_fraction` of the problems whose answer can also be taught without the
    worked steps (`direct_responses`, see `r1_completion`).
    """

    def __init__(self, tokenizer, data_path, template: str = "r1_think", direct_fraction: float = 0.0,
                 seed: int = 0):
        problems = list(read_problems(data_path))
        self.direct = np.random.default_rng(seed).random(len(problems)) < direct_fraction
        self.prompts = [tokenizer.encode(build_prompt(p.question, template)) for p in problems]
        self.responses = [tokenizer.encode(r1_completion(p.answer)) + [tokenizer.eos_token_id] for p in problems]
        self.direct_responses = [tokenizer.encode(r1_completion(p.answer, direct=True)) + [tokenizer.eos_token_id]
                                 for p in problems]
        self.solutions = [p.answer for p in problems]

    def response(self, index: int, direct_phase: bool) -> list[int]:
        return self.direct_responses[index] if direct_phase and self.direct[index] else self.responses[index]


def heldout_accuracy(model, tokenizer, data: SFTData, batch_size: int = 50) -> float:
    """Greedy accuracy of `model` on every problem of `data`."""
    from mindrlhf.configs.generation import GenerationConfig
    from mindrlhf.generation import Generator
    from mindrlhf.trainer.evaluation import count_correct

    generator = Generator(model, GenerationConfig(
        max_new_tokens=padded_width(data.responses) + 16, num_generations=1, do_sample=False,
        eos_token_ids=tokenizer.stop_token_ids, pad_token_id=tokenizer.pad_token_id,
        prompt_buckets=[padded_width(data.prompts)]))
    return count_correct(generator, tokenizer, data.prompts, data.solutions, batch_size) / len(data.prompts)


def train(config: Qwen2Config, tokenizer, data: SFTData, steps: int, batch_size: int, learning_rate: float,
          seed: int, warmup_steps: int = 0, max_grad_norm: float = 1.0, direct_from_step: int = 0, on_step=None):
    """SFT of a model initialised from `seed` (constant learning rate after a linear warmup, so the model after
    k steps is the same whatever `steps` is); returns (model, per-step losses). From update `direct_from_step`
    on, the problems marked `data.direct` are taught with the bare answer. `on_step(k, model)` is called after
    every update."""
    model = Qwen2ForCausalLM(config)
    init_random_weights(model, seed=seed)
    optimizer = AdamW(model.trainable_params(), learning_rate=learning_rate, weight_decay=0.0)
    step = SPMDTrainStep(SFTLossNet(model), optimizer, max_grad_norm=max_grad_norm)
    prompt_width, response_width = padded_width(data.prompts), padded_width(data.responses)
    rng = np.random.default_rng(seed)
    order = np.array([], np.int64)
    losses = []
    started = time.perf_counter()
    for index in range(steps):
        if len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(len(data.prompts))])
        picked, order = order[:batch_size], order[batch_size:]
        optimizer.set_learning_rate(learning_rate_at(index, learning_rate, warmup_steps))
        prompt_ids, prompt_mask = pad_rows([data.prompts[i] for i in picked], prompt_width, tokenizer.pad_token_id)
        direct_phase = index >= direct_from_step
        response_ids, response_mask = pad_rows([data.response(i, direct_phase) for i in picked], response_width,
                                               tokenizer.pad_token_id, side="right")
        weights = aggregation_weights(response_mask, "token-mean").astype(np.float32)  # every response token
        (loss,), _ = step(*(ms.Tensor(a) for a in (prompt_ids, prompt_mask, response_ids, response_mask, weights)))
        losses.append(float(loss.asnumpy()))
        if (index + 1) % 50 == 0 or index == 0:
            logger.info("step %d/%d | loss %.4f | %.0f s", index + 1, steps, losses[-1], time.perf_counter() - started)
        if on_step is not None:
            on_step(index + 1, model)
    return model, losses


def save_policy(model, config: Qwen2Config, output: str, tokenizer_dir: str | None) -> None:
    """A `.ckpt` path gets a MindSpore checkpoint, anything else a Hugging Face folder (with the tokenizer)."""
    if output.endswith(".ckpt"):
        with atomic_output(output, ".ckpt") as tmp:
            ms.save_checkpoint(model, tmp)
        return
    from mindrlhf.models.qwen2.convert import write_hf_folder

    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    write_hf_folder(weights, config, output, tokenizer_dir=tokenizer_dir, source="the SFT model")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_yaml", default=str(TINY / "model.yaml"), help="model YAML (model_config is used)")
    parser.add_argument("--tokenizer_dir", default=str(TINY / "tokenizer"), help="vocab.json + merges.txt folder")
    parser.add_argument("--data", default=str(DATA / "gsm8k_sample.jsonl"), help="GSM8K-style training JSONL")
    parser.add_argument("--eval_data", default=None, help="held-out JSONL: report greedy accuracy at the end")
    parser.add_argument("--template", default="r1_think", help="prompt template (as rlhf_data.py --template)")
    parser.add_argument("--direct_fraction", type=float, default=0.0,
                        help="share of the problems (seeded choice) taught with the bare answer, without the worked "
                             "steps, from --direct_from_step on")
    parser.add_argument("--direct_from_step", type=int, default=0,
                        help="first update that uses the bare answers of --direct_fraction")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=str(TINY / "tiny_sft.ckpt"),
                        help="a .ckpt file, or a folder for a Hugging Face model (config.json + model.safetensors)")
    args = parser.parse_args(argv)
    setup_logging()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = Qwen2Config.from_yaml(args.model_yaml)
    tokenizer = load_tokenizer(args.tokenizer_dir)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"error: {args.model_yaml}: vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)}")
    data = SFTData(tokenizer, args.data, args.template, args.direct_fraction, args.seed)
    model, losses = train(config, tokenizer, data, args.steps, args.batch_size, args.learning_rate, args.seed,
                          args.warmup_steps, direct_from_step=args.direct_from_step)
    save_policy(model, config, args.output, args.tokenizer_dir)
    logger.info("wrote %s (%d parameters; loss first %.4f, last %.4f)", args.output, config.num_parameters(),
                losses[0], losses[-1])
    if args.eval_data:
        heldout = SFTData(tokenizer, args.eval_data, args.template)
        logger.info("held-out greedy accuracy: %.1f%% (%d problems)",
                    100 * heldout_accuracy(model, tokenizer, heldout), len(heldout.prompts))


if __name__ == "__main__":
    main()
