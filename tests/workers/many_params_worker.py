"""Worker for the test that the graphs looping over every parameter compile within graph mode's call depth limit
at a real model's parameter count (SmolLM2-135M has 272, Qwen2.5-0.5B 290, Qwen2.5-7B 339): graph mode unrolls
those loops into nested calls, so their call depth grows with the parameter count, and a loop body that nests one
call more per iteration exceeds the default limit (1000) only at that size.

Compiling ~300 parameters' loops costs minutes (the cost is one op per parameter), so the model is smaller and the
limit shrinks with it: `CALL_DEPTH_PER_PARAMETER` (1000 / 315, the default limit over the 315 parameters this test
used to build) times the parameter count. The trainer's graphs need ~2-2.7 calls per parameter (they fail at 150,
compile at 200 for 75 parameters); a real model's whole train step at 272 parameters compiles in
tests/tools/test_smollm2.py (dp=1).

2 ranks. A 6-layer model of width 8 (75 parameters: 12 per layer, and the embedding, the final norm and the
head) in data parallel takes `UPDATES` clipped AdamW updates two ways from the same weights: 1-row micro-batches of
a globally normalised loss, accumulated and then summed over dp in place (the GRPO trainer's), and the whole batch
in one fused step with the dp reduction a mean, both with the dp sums through shared memory
(`mindrlhf.parallel.shared_memory`, the trainer's default on one CPU host). Then the micro-batched net is resharded
into a tp=2 net. Each rank writes `rank_<r>.npz`: both nets' weights (`micro/`,
`whole/`) and grad norms, the resharded shards (`infer/`) with their split axes (`axis/`), the call depth limit.
"""
import argparse
import math

import mindspore as ms
import numpy as np
import worker_setup
from support.cells import WeightedNLLLoss

from mindrlhf.engine.batches import prompt_micro_batches
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.optim import AdamW
from mindrlhf.parallel.host_setup import share_data_parallel_sums
from mindrlhf.parallel.layers import init_random_weights, param_split_axes
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.reshard import Resharder
from mindrlhf.parallel.spmd import MicroBatchedTrainStep
from mindrlhf.parallel.strategy import net_layouts

CONFIG = dict(vocab_size=32, hidden_size=8, num_layers=6, num_heads=2, n_kv_heads=2, intermediate_size=16,
              seq_length=16, max_position_embedding=32, theta=10000.0, qkv_has_bias=True)
LEARNING_RATE, UPDATES, CLIP = 1e-3, 2, 0.05  # the clip is below the gradient norm: every update is clipped
CALL_DEPTH_PER_PARAMETER = 1000 / 315


def train(layout, dp_sums, reduction: str, micro_batch_rows: int, ids, labels, mask):
    """A fresh net after `UPDATES` updates of `MicroBatchedTrainStep` (this rank's rows, in micro-batches of
    `micro_batch_rows`, 0 = all; the dp sums through `dp_sums`), and its grad norms."""
    net = Qwen2ForCausalLM(Qwen2Config(**CONFIG), layout)
    init_random_weights(net, layout, seed=0)
    tokens = mask.sum() if reduction == "mean" else mask.sum() * layout.dp  # equal token counts per rank
    weights = (mask / tokens).astype(np.float32)
    step = MicroBatchedTrainStep(WeightedNLLLoss(net), AdamW(net.trainable_params(), learning_rate=LEARNING_RATE),
                                 layout, grad_reduction=reduction, max_grad_norm=CLIP, dp_sums=dp_sums)
    rows = micro_batch_rows or len(ids)
    columns = dict(input_ids=ids, labels=labels, mask=mask, weights=weights)
    norms = [step(prompt_micro_batches(columns, rows, 1))[1] for _ in range(UPDATES)]
    return net, np.array(norms)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_setup.graph_mode_on_cpu()
    world, rank = worker_setup.init_communication()
    layout = Layout.for_world(world, 1, world, rank).init_groups()
    num_params = len(Qwen2ForCausalLM(Qwen2Config(**CONFIG), layout).trainable_params())
    worker_setup.set_max_call_depth(math.ceil(CALL_DEPTH_PER_PARAMETER * num_params))
    # the dp sums through shared memory, as the trainer's on one CPU host: in the fused step's graph, chained over
    # every gradient, and in place on the micro-batches' buffers
    dp_sums = share_data_parallel_sums("auto", [layout], world, rank)
    assert list(dp_sums) == [layout.dp_group], dp_sums
    rng = np.random.RandomState(1)
    ids = rng.randint(0, CONFIG["vocab_size"], (2 * world, 12)).astype(np.int32)
    labels, mask = np.roll(ids, -1, axis=1), np.ones(ids.shape, np.int32)
    mine = slice(2 * rank, 2 * rank + 2)
    result = {}
    nets = {}
    for name, reduction, rows in (("micro", "sum", 1), ("whole", "mean", 0)):
        nets[name], result[f"{name}_norms"] = train(layout, dp_sums[layout.dp_group], reduction, rows, ids[mine],
                                                    labels[mine], mask[mine])
        result.update({f"{name}/{p.name}": p.asnumpy() for p in nets[name].trainable_params()})
    result["num_params"] = np.array(len(nets["micro"].trainable_params()))
    result["max_call_depth"] = np.array(ms.get_context("max_call_depth"))

    infer_layout = Layout.for_world(1, world, world, rank).init_groups()
    infer_net = Qwen2ForCausalLM(Qwen2Config(**CONFIG), infer_layout)
    infer_net.update_parameters_name("infer.")
    Resharder(nets["micro"], infer_net, net_layouts(nets["micro"], layout), net_layouts(infer_net, infer_layout),
              {p.name: "infer." + p.name for p in nets["micro"].get_parameters()}).run()
    result.update({f"infer/{p.name[len('infer.'):]}": p.asnumpy() for p in infer_net.get_parameters()})
    result.update({f"axis/{name[len('infer.'):]}": np.array(-1 if axis is None else axis)
                   for name, axis in param_split_axes(infer_net).items()})
    worker_setup.save_rank_results(args.out, rank, result)


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
