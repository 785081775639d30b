"""Worker: sampled and greedy generation of a tiny Qwen2 under a layout; each rank saves what it generated."""
import argparse
import os

import mindspore as ms
import numpy as np

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation import Generator
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.layout import Layout

CONFIG = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=64,
              seq_length=64, max_position_embedding=64, theta=10000.0)
PROMPTS = [[5, 9, 17], [3, 1, 4, 1, 5, 9, 2], [7, 7, 21, 22, 23, 24, 25, 26, 27, 28]]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    layout = Layout()
    if args.tp > 1:
        from mindspore.communication import get_group_size, get_rank, init
        init()
        layout = Layout.for_world(1, args.tp, get_group_size(), get_rank()).init_groups()
    net = Qwen2ForCausalLM(Qwen2Config(**CONFIG), layout)
    init_random_weights(net, layout, seed=11)
    base = dict(max_new_tokens=12, eos_token_ids=[3], pad_token_id=0, prompt_buckets=[16], seed=7)
    sampled = Generator(net, GenerationConfig(num_generations=4, temperature=0.9, top_p=0.95, **base)).generate(
        PROMPTS, return_log_probs=True)
    greedy = Generator(net, GenerationConfig(num_generations=1, do_sample=False, **base)).generate(PROMPTS)
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank_{layout.rank}.npz"), sampled=sampled.response_ids,
             sampled_mask=sampled.response_mask, log_probs=sampled.log_probs, greedy=greedy.response_ids)


if __name__ == "__main__":
    main()
