"""Worker for the pipeline reshard tests: a 4-layer Qwen2 train net in `--src_pp` pipeline stages (x `--src_tp`) ->
an inference net without stages (`--dst dp,tp`, renamed `infer.`), online. Each rank saves its stage's source
checkpoint (`src_ckpt/rank_<r>/net.ckpt`) and strategy file (`src_strategy/strategy_<r>.ckpt`, its stage as
`current_stage`), the destination strategy, and the destination tensors it got (`dst_rank_<r>.npz`). `--tied`
ties the embedding and the head (the first and the last stage hold it); `--dst_dtype` is the destination's
parameter dtype."""
import argparse
import dataclasses
import os

import mindspore as ms
import numpy as np
import worker_setup
from support.configs import tiny_qwen2_config

from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.parallel.layers import load_full_state, random_full_state
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.reshard import Resharder
from mindrlhf.parallel.strategy import net_layouts, write_strategy_file

STAGED = dict(num_layers=4, n_kv_heads=2)  # the tiny Qwen2 (support.configs) with 4 layers to split


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--src_tp", type=int, default=1)
    parser.add_argument("--src_pp", type=int, default=2)
    parser.add_argument("--dst", required=True, help="dp,tp of the destination (infer) net")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--dst_dtype", default="float32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_setup.graph_mode_on_cpu()
    world, rank = worker_setup.init_communication()
    src_layout = Layout.for_world(1, args.src_tp, world, rank, pp=args.src_pp).init_groups()
    dst_layout = Layout.for_world(*map(int, args.dst.split(",")), world, rank).init_groups()
    cfg = tiny_qwen2_config(**STAGED, tie_word_embeddings=args.tied)
    full = random_full_state(Qwen2ForCausalLM(cfg), Layout(), seed=9)
    src_net = Qwen2ForCausalLM(cfg, src_layout)
    load_full_state(src_net, full, src_layout)
    dst_net = Qwen2ForCausalLM(dataclasses.replace(cfg, compute_dtype=args.dst_dtype,
                                                   param_init_type=args.dst_dtype), dst_layout)
    dst_net.update_parameters_name("infer.")

    os.makedirs(f"{args.out}/src_ckpt/rank_{rank}", exist_ok=True)
    ms.save_checkpoint(src_net, f"{args.out}/src_ckpt/rank_{rank}/net.ckpt")
    src_strategy = write_strategy_file(f"{args.out}/src_strategy/strategy_{rank}.ckpt",
                                       net_layouts(src_net, src_layout), stage=src_layout.stage)
    dst_strategy = write_strategy_file(f"{args.out}/dst_strategy_{rank}.ckpt", net_layouts(dst_net, dst_layout))
    name_map = {name: "infer." + name for name in full}
    resharder = Resharder(src_net, dst_net, src_strategy, dst_strategy, name_map, bucket_bytes=4096,
                          src_pipeline=src_layout)
    resharder.run()
    resharder.run()  # the next step reuses the plan and the compiled graphs
    np.savez(f"{args.out}/dst_rank_{rank}.npz", **{p.name: p.asnumpy() for p in dst_net.get_parameters()})


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
