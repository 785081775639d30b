"""Worker for the online reshard tests: train-layout net (`--src dp,tp` or, in pipeline stages, `dp,tp,pp`) ->
infer-layout net (`--dst dp,tp`, renamed `infer.`, optionally fp16/bf16), online.

Each rank saves its source checkpoint (`src_ckpt/rank_<r>/net.ckpt`), its source strategy file
(`src_strategy/strategy_<r>.ckpt`, with its pipeline stage as `current_stage`) and the destination strategy file
(`dst_strategy_<r>.ckpt`), runs the online reshard (twice: the second run reuses the plan and the compiled graphs)
and writes the destination tensors it got to `dst_rank_<r>.npz`, with the run's bytes sent and buckets
(`__bytes_sent`, `__buckets`). `--dst_dtype` may list several dtypes (`float32,bfloat16`): the first destination is
written as above, each further one (a separate net, same layout) to `dst_<dtype>_rank_<r>.npz`. bfloat16 tensors
are stored as float32 (numpy has no bfloat16; the widening is exact). The model is the tiny Qwen2 with
`--num_layers`, `--n_kv_heads` and `--tied` (embedding and head tied: the first and the last stage hold it).
Several cases run in one process in turn (`--cases`, `worker_setup.run_cases`).
"""
import argparse
import dataclasses
import os

import mindspore as ms
import numpy as np
import worker_setup
from support.configs import TINY_QWEN2, tiny_qwen2_config

from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.parallel.layers import load_full_state, random_full_state
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.reshard import PACK_BELOW_BYTES, Resharder
from mindrlhf.parallel.strategy import net_layouts, write_strategy_file


def main(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", required=True, help="dp,tp[,pp] of the source (train) net")
    parser.add_argument("--dst", required=True, help="dp,tp of the destination (infer) net")
    parser.add_argument("--dst_dtype", default="float32")
    parser.add_argument("--bucket_bytes", type=int, default=4096)
    parser.add_argument("--pack_below_bytes", type=int, default=PACK_BELOW_BYTES)
    parser.add_argument("--num_layers", type=int, default=TINY_QWEN2["num_layers"])
    parser.add_argument("--n_kv_heads", type=int, default=TINY_QWEN2["n_kv_heads"])
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    worker_setup.graph_mode_on_cpu()
    world, rank = worker_setup.communication()
    dp, tp, pp = (list(map(int, args.src.split(","))) + [1])[:3]
    src_layout = Layout.for_world(dp, tp, world, rank, pp=pp).init_groups()
    dst_layout = Layout.for_world(*map(int, args.dst.split(",")), world, rank).init_groups()

    cfg = tiny_qwen2_config(num_layers=args.num_layers, n_kv_heads=args.n_kv_heads, tie_word_embeddings=args.tied)
    full = random_full_state(Qwen2ForCausalLM(cfg), Layout(), seed=9)
    src_net = Qwen2ForCausalLM(cfg, src_layout)
    load_full_state(src_net, full, src_layout)
    dtypes = args.dst_dtype.split(",")
    dst_nets = {}
    for dtype in dtypes:
        dst_nets[dtype] = Qwen2ForCausalLM(dataclasses.replace(cfg, compute_dtype=dtype, param_init_type=dtype),
                                           dst_layout)
        dst_nets[dtype].update_parameters_name("infer.")

    os.makedirs(f"{args.out}/src_ckpt/rank_{rank}", exist_ok=True)
    ms.save_checkpoint(src_net, f"{args.out}/src_ckpt/rank_{rank}/net.ckpt")
    src_strategy = write_strategy_file(f"{args.out}/src_strategy/strategy_{rank}.ckpt",
                                       net_layouts(src_net, src_layout), stage=src_layout.stage)
    dst_strategy = write_strategy_file(f"{args.out}/dst_strategy_{rank}.ckpt",
                                       net_layouts(dst_nets[dtypes[0]], dst_layout))

    name_map = {name: "infer." + name for name in full}
    for i, (dtype, dst_net) in enumerate(dst_nets.items()):
        resharder = Resharder(src_net, dst_net, src_strategy, dst_strategy, name_map, bucket_bytes=args.bucket_bytes,
                              pack_below_bytes=args.pack_below_bytes, src_pipeline=src_layout)
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
    worker_setup.run_worker_script(lambda: worker_setup.run_cases(main))
