"""Worker for the online reshard tests: train-layout net -> infer-layout net (renamed, optionally fp16/bf16).

Each rank saves its source checkpoint (`src_ckpt/rank_<r>/net.ckpt`) and both strategy files, runs the
online reshard and writes the destination tensors it got to `dst_rank_<r>.npz`. `--dst_dtype` may list
several dtypes (`float32,bfloat16`): the first destination is written as above, each further one (a
separate net, same layout) to `dst_<dtype>_rank_<r>.npz`. bfloat16 tensors are stored as float32 (numpy
has no bfloat16; the widening is exact).
"""
import argparse
import os

import mindspore as ms
import numpy as np
import worker_setup
from support.configs import TINY_QWEN2, tiny_qwen2_config

from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.parallel.layers import load_full_state, param_split_axes, param_split_shards
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.reshard import PACK_BELOW_BYTES, Resharder
from mindrlhf.parallel.strategy import full_shapes_from_local, net_layouts, write_strategy_file


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", required=True, help="dp,tp of the source (train) net")
    parser.add_argument("--dst", required=True, help="dp,tp of the destination (infer) net")
    parser.add_argument("--dst_dtype", default="float32")
    parser.add_argument("--bucket_bytes", type=int, default=4096)
    parser.add_argument("--pack_below_bytes", type=int, default=PACK_BELOW_BYTES)
    parser.add_argument("--n_kv_heads", type=int, default=TINY_QWEN2["n_kv_heads"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_setup.graph_mode_on_cpu()
    world, rank = worker_setup.init_communication()
    src_layout = Layout.for_world(*map(int, args.src.split(",")), world, rank).init_groups()
    dst_layout = Layout.for_world(*map(int, args.dst.split(",")), world, rank).init_groups()

    config = dict(n_kv_heads=args.n_kv_heads, tie_word_embeddings=False)  # the tiny Qwen2's overrides
    src_net = Qwen2ForCausalLM(tiny_qwen2_config(**config), src_layout)
    rng = np.random.RandomState(0)
    axes = param_split_axes(src_net)
    full = full_shapes_from_local(src_layout, axes, {p.name: p.shape for p in src_net.get_parameters()},
                                  param_split_shards(src_net, src_layout.tp))
    load_full_state(src_net, {n: rng.standard_normal(s).astype(np.float32) for n, s in sorted(full.items())},
                    src_layout)
    dtypes = args.dst_dtype.split(",")
    dst_nets = {}
    for dtype in dtypes:
        dst_cfg = tiny_qwen2_config(**config, compute_dtype=dtype, param_init_type=dtype)
        dst_nets[dtype] = Qwen2ForCausalLM(dst_cfg, dst_layout)
        dst_nets[dtype].update_parameters_name("infer.")

    os.makedirs(f"{args.out}/src_ckpt/rank_{rank}", exist_ok=True)
    ms.save_checkpoint(src_net, f"{args.out}/src_ckpt/rank_{rank}/net.ckpt")
    src_strategy = write_strategy_file(f"{args.out}/src_strategy_{rank}.ckpt", net_layouts(src_net, src_layout))
    dst_strategy = write_strategy_file(f"{args.out}/dst_strategy_{rank}.ckpt",
                                       net_layouts(dst_nets[dtypes[0]], dst_layout))

    name_map = {p.name: "infer." + p.name for p in src_net.get_parameters()}
    for i, (dtype, dst_net) in enumerate(dst_nets.items()):
        resharder = Resharder(src_net, dst_net, src_strategy, dst_strategy, name_map, bucket_bytes=args.bucket_bytes,
                              pack_below_bytes=args.pack_below_bytes)
        stats = resharder.run()
        stats_again = resharder.run()  # a second run (next GRPO step) reuses the plan and compiled graphs
        assert stats_again.bytes_sent == stats.bytes_sent
        out = f"{args.out}/dst_rank_{rank}.npz" if i == 0 else f"{args.out}/dst_{dtype}_rank_{rank}.npz"
        np.savez(out, **{p.name: _host(p) for p in dst_net.get_parameters()},
                 __bytes_sent=np.array(stats.bytes_sent), __buckets=np.array(stats.buckets))


def _host(param) -> np.ndarray:
    """The parameter as numpy; bfloat16 widened to float32 (exact)."""
    if param.dtype == ms.bfloat16:
        return param.astype(ms.float32).asnumpy()
    return param.asnumpy()


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
