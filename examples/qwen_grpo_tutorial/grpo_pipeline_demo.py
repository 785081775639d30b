"""GRPO end to end in one process on the bundled tiny model: the pieces a GRPO step is made of, composed.

    python examples/qwen_grpo_tutorial/grpo_pipeline_demo.py --mindrecord data/gsm8k_sample.mindrecord

Per step: sample `num_samples` responses per prompt with the inference net (static KV cache), score them
with the rule rewards, normalise advantages within each group, score the responses with the reference
net, take one clipped policy-gradient step (+ beta * KL) on the training net, and reshard the new weights
into the inference net online. Idle nets are swapped out around each phase (bookkeeping only on CPU).
This runs on one device; the multi-rank trainer (`grpo_one_stage.py`) builds on the same library calls.
"""
from __future__ import annotations

import argparse
import logging
import time
from typing import NamedTuple

import mindspore as ms
from mindspore import nn

from mindrlhf.algorithms import GRPOLossCell, group_advantages
from mindrlhf.data import PromptDataset
from mindrlhf.generation import GenerationConfig, Generator
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer
from mindrlhf.parallel import INFER_WEIGHTS, OPTIMIZER_MOMENTS, REF_WEIGHTS, TRAIN_WEIGHTS, Layout, SwapManager
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.reshard import Resharder
from mindrlhf.parallel.strategy import net_layouts
from mindrlhf.reward import build_reward_fn
from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseLogProbs
from mindrlhf.parallel.spmd import SPMDTrainStep
from mindrlhf.utils.logging import format_metrics, setup_logging

logger = logging.getLogger("mindrlhf.demo")

# Which weight groups are on device in each phase; the rest are swapped to host memory.
PHASE_PLAN = {
    "generate": [INFER_WEIGHTS],
    "reference": [REF_WEIGHTS],
    "train": [TRAIN_WEIGHTS, OPTIMIZER_MOMENTS],
    "reshard": [TRAIN_WEIGHTS, INFER_WEIGHTS],
}


class DemoResult(NamedTuple):
    metrics: dict
    policy: Qwen2ForCausalLM
    infer_net: Qwen2ForCausalLM
    ref_net: Qwen2ForCausalLM
    swap: SwapManager


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="model_configs/tiny/model.yaml", help="model YAML")
    parser.add_argument("--vocab_path", default="model_configs/tiny/tokenizer/vocab.json")
    parser.add_argument("--merges_file_path", default="model_configs/tiny/tokenizer/merges.txt")
    parser.add_argument("--mindrecord", required=True, help="prompt MindRecord written by rlhf_data.py")
    parser.add_argument("--load_checkpoint", default=None, help="policy .ckpt (default: seeded random weights)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=2, help="prompts per step")
    parser.add_argument("--num_samples", type=int, default=4, help="responses per prompt (GRPO group size)")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.01, help="KL coefficient")
    parser.add_argument("--reward_funcs", nargs="+", default=["accuracy", "format"])
    parser.add_argument("--reward_weights", nargs="+", type=float, default=[1.0, 0.5])
    parser.add_argument("--ref_sync_steps", type=int, default=0, help="copy policy -> reference every N steps (0 = never)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def renamed_copy(config, prefix, layout):
    net = Qwen2ForCausalLM(config, layout)
    net.update_parameters_name(prefix)
    return net


def main(argv=None):
    args = parse_args(argv)
    setup_logging()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    config = Qwen2Config.from_yaml(args.config)
    tokenizer = Qwen2Tokenizer(args.vocab_path, args.merges_file_path)
    layout = Layout()

    policy = Qwen2ForCausalLM(config, layout)
    if args.load_checkpoint:
        ms.load_param_into_net(policy, ms.load_checkpoint(args.load_checkpoint), strict_load=True)
    else:
        init_random_weights(policy, layout, seed=args.seed)
    infer_net = renamed_copy(config, "infer.", layout)
    ref_net = renamed_copy(config, "ref.", layout)
    optimizer = nn.AdamWeightDecay(policy.trainable_params(), learning_rate=args.learning_rate, weight_decay=0.0)

    train_layouts = net_layouts(policy, layout)
    to_infer = Resharder(policy, infer_net, train_layouts, net_layouts(infer_net, layout),
                         {n: "infer." + n for n in train_layouts})
    to_ref = Resharder(policy, ref_net, train_layouts, net_layouts(ref_net, layout), {n: "ref." + n for n in train_layouts})
    to_infer.run()
    to_ref.run()

    swap = SwapManager()
    swap.register(TRAIN_WEIGHTS, policy.trainable_params())
    swap.register(OPTIMIZER_MOMENTS, [p for p in optimizer.get_parameters() if p.name.startswith(("adam_m", "adam_v"))])
    swap.register(INFER_WEIGHTS, infer_net.trainable_params())
    swap.register(REF_WEIGHTS, ref_net.trainable_params())

    def enter(phase):
        resident = PHASE_PLAN[phase]
        swap.apply_plan(phase, resident=resident, offloaded=[g for g in swap.groups if g not in resident])

    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, num_generations=args.num_samples,
                                  temperature=args.temperature, eos_token_ids=tokenizer.stop_token_ids,
                                  pad_token_id=tokenizer.pad_token_id, prompt_buckets=[64, 128, 256],
                                  seed=args.seed)
    generator = Generator(infer_net, gen_config)
    dataset = PromptDataset(args.mindrecord, args.batch_size, tokenizer.pad_token_id, seed=args.seed)
    rewards_fn = build_reward_fn(args.reward_funcs, args.reward_weights)
    ref_log_probs = ResponseLogProbs(ref_net, args.temperature)
    loss_net = GRPOLossNet(policy, GRPOLossCell(beta=args.beta), args.temperature)
    train_step = SPMDTrainStep(loss_net, optimizer, layout)
    logger.info("policy %.2fM parameters, %d prompts, %d steps x %d prompts x %d samples",
                config.num_parameters() / 1e6, dataset.num_samples, args.steps, args.batch_size, args.num_samples)

    for step in range(1, args.steps + 1):
        timings = {}
        batch = dataset.next_batch()

        enter("generate")
        start = time.perf_counter()
        rollout = generator.generate(batch["prompt_ids"], batch["attention_mask"], return_log_probs=True)
        timings["gen_s"] = time.perf_counter() - start
        completions = tokenizer.batch_decode(
            [ids[mask.astype(bool)].tolist() for ids, mask in zip(rollout.response_ids, rollout.response_mask)],
            skip_special_tokens=True)
        solutions = [s for s in batch["solution"] for _ in range(args.num_samples)]
        rewards, per_function = rewards_fn(completions, solutions)
        advantages = group_advantages(rewards, args.num_samples)

        enter("reference")
        start = time.perf_counter()
        inputs = [ms.Tensor(a) for a in (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                          rollout.response_mask)]
        ref_logp = ref_log_probs(*inputs)
        timings["ref_s"] = time.perf_counter() - start

        enter("train")
        start = time.perf_counter()
        # One update per batch: the sampling policy is the "old" policy (ratio 1 at the first update).
        loss, pg_loss, kl, clipfrac, _ = train_step(*inputs, ms.Tensor(rollout.log_probs), ref_logp,
                                                    ms.Tensor(advantages))
        timings["train_s"] = time.perf_counter() - start

        enter("reshard")
        start = time.perf_counter()
        to_infer.run()
        if args.ref_sync_steps and step % args.ref_sync_steps == 0:
            to_ref.run()
        timings["reshard_s"] = time.perf_counter() - start

        tokens = int(rollout.response_mask.sum())
        metrics = {"step": f"{step}/{args.steps}", "reward": float(rewards.mean())}
        metrics.update({name: float(values.mean()) for name, values in per_function.items()})
        metrics.update({"loss": float(loss.asnumpy()), "pg_loss": float(pg_loss.asnumpy()),
                        "kl": float(kl.asnumpy()), "clipfrac": float(clipfrac.asnumpy()),
                        "resp_len": float(rollout.response_lengths.mean())})
        metrics.update({k: round(v, 3) for k, v in timings.items()})
        metrics["gen_tok/s"] = round(tokens / timings["gen_s"], 1)
        logger.info(format_metrics(metrics))
    logger.info("sample completion: %r", completions[0][:200])
    logger.info("swap: %s", swap.summary())
    return DemoResult(metrics, policy, infer_net, ref_net, swap)


if __name__ == "__main__":
    main()
