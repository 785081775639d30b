"""Worker: sampled and greedy generation of a tiny Qwen2 under a layout, and a sampled rollout with tool turns whose
handler answers differently on each rank (shared over the tp group: every rank must append rank 0's answers); each
rank saves what it generated."""
import argparse

import numpy as np
import worker_setup
from support.configs import tiny_qwen2_config
from support.tool_handlers import CountingTool

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation import Generator
from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.parallel.array_collectives import ArrayCollectives
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.layout import Layout
from mindrlhf.tool_use import GroupToolTurns

GENERATION = dict(vocab_size=128, n_kv_heads=2, seq_length=64)  # the tiny Qwen2's overrides
PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2], [7, 7, 21, 22, 23, 24, 25, 26, 27, 28]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_setup.graph_mode_on_cpu()
    layout, world = Layout(), 1
    if args.tp > 1:
        world, rank = worker_setup.init_communication()
        layout = Layout.for_world(1, args.tp, world, rank).init_groups()
    net = Qwen2ForCausalLM(tiny_qwen2_config(**GENERATION), layout)
    init_random_weights(net, layout, seed=11)
    base = dict(max_new_tokens=12, eos_token_ids=[3], pad_token_id=0, prompt_buckets=[16], seed=7)
    sampled = Generator(net, GenerationConfig(num_generations=4, temperature=0.9, top_p=0.95, **base)).generate(
        PROMPTS, return_log_probs=True)
    greedy = Generator(net, GenerationConfig(num_generations=1, do_sample=False, **base)).generate(PROMPTS)
    tools = CountingTool(salt=layout.rank)
    if args.tp > 1:
        tools = GroupToolTurns(tools, ArrayCollectives(world, layout.rank), layout.tp_group, layout.tp_rank == 0)
    tool_config = GenerationConfig(num_generations=4, temperature=1.5, max_tool_calling_iterations=2,
                                   max_tool_response_tokens=6, **{**base, "eos_token_ids": list(range(1, 128, 7))})
    rollout = Generator(net, tool_config, tools=tools).generate(PROMPTS)
    worker_setup.save_rank_results(args.out, layout.rank, dict(
        sampled=sampled.response_ids, sampled_mask=sampled.response_mask, log_probs=sampled.log_probs,
        greedy=greedy.response_ids, tool_rollout=rollout.response_ids, tool_mask=rollout.tool_mask,
        tool_salts=np.array([call["salt"] for calls in rollout.tool_calls for call in calls])))


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
