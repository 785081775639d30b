"""Worker for tests/parallel/test_optimizer_shard.py: a tiny Qwen2 (1 layer) trained `UPDATES` clipped AdamW steps
with plain `AdamW` and with `ShardedAdamW` (moments sharded over dp), whole-batch (`SPMDTrainStep`) and over 1-row
micro-batches (`MicroBatchedTrainStep`: buffers reduced in place, the optimizer in `ApplyGradients`); and a resume of
the sharded run: its weights and state saved after update `UPDATES - 1` with the trainer's checkpoint functions,
loaded into a new net (`load_rank_params`, as the trainer resumes), the last update taken again.

Run under msrun with `--dp/--tp`; each rank writes `<out>/rank_<r>.npz`.
"""
import argparse
import os

import mindspore as ms
import numpy as np
import worker_setup
from support.cells import ApplyGrads, WeightedNLLLoss
from support.configs import tiny_qwen2_config

from mindrlhf.checkpoint.step import is_optimizer_state, save_parameters
from mindrlhf.checkpoint.weights import load_rank_params
from mindrlhf.engine.batches import prompt_micro_batches
from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.optim import AdamW, ShardedAdamW
from mindrlhf.parallel.layers import init_random_weights
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.spmd import MicroBatchedTrainStep, SPMDTrainStep

LEARNING_RATE, UPDATES, MAX_GRAD_NORM = 1e-3, 3, 0.05  # the tiny model's gradient norm is ~3-4: clipping is on


def batch(layout, vocab_size):
    """This dp rank's rows of a global batch of 4, token weights normalised over the global batch."""
    rng = np.random.RandomState(1)
    ids = rng.randint(0, vocab_size, (4, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    weights = (mask / mask.sum()).astype(np.float32)
    per = 4 // layout.dp
    mine = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    return [a[mine] for a in (ids, np.roll(ids, -1, axis=1), mask, weights)]


def build(cfg, layout, sharded: bool):
    net = Qwen2ForCausalLM(cfg, layout)
    init_random_weights(net, layout, seed=0)
    kwargs = dict(learning_rate=LEARNING_RATE, weight_decay=0.01)
    optimizer = ShardedAdamW(net.trainable_params(), layout.dp, layout.dp_rank, layout.dp_group, **kwargs) \
        if sharded else AdamW(net.trainable_params(), **kwargs)
    return net, optimizer


def state_of(net, optimizer):
    """The optimizer's parameters that are not weights (as `TrainEngine.optimizer_state`)."""
    trained = {id(p) for p in net.trainable_params()}
    return [p for p in optimizer.get_parameters() if id(p) not in trained]


def train(cfg, layout, data, sharded: bool, micro: bool, updates=UPDATES, save_after=None, load=None):
    """(weights after `updates` updates, grad norms, the optimizer state). `save_after`: (update, path) to save the
    weights and optimizer state after; `load`: a path to load them from first (`load_rank_params`, as the trainer
    resumes: into a net just built, before its graphs compile)."""
    net, optimizer = build(cfg, layout, sharded)
    if load:
        load_rank_params(list(net.trainable_params()) + state_of(net, optimizer), load)
    loss_net = WeightedNLLLoss(net)
    if micro:
        step = MicroBatchedTrainStep(loss_net, optimizer, layout, grad_reduction="sum", max_grad_norm=MAX_GRAD_NORM)
    else:
        step = SPMDTrainStep(loss_net, optimizer, layout, grad_reduction="sum", max_grad_norm=MAX_GRAD_NORM)
    norms = []
    for update in range(updates):
        if micro:
            columns = dict(zip(("input_ids", "labels", "mask", "weights"), data))
            norms.append(step(prompt_micro_batches(columns, 1, 1))[1])
        else:
            norms.append(float(step(*(ms.Tensor(a) for a in data))[1].asnumpy()))
        if save_after is not None and update + 1 == save_after[0]:
            save_parameters(list(net.trainable_params()) + state_of(net, optimizer), save_after[1])
    # copies: a CPU Parameter's asnumpy() is a view of its memory
    weights = {p.name: np.array(p.asnumpy()) for p in net.trainable_params()}
    return weights, np.array(norms), {p.name: np.array(p.asnumpy()) for p in state_of(net, optimizer)}


ODD_SHAPES = {"odd.w": (5, 3), "odd.b": (7,), "odd.one": (1,)}  # padded slices; rank 1's slice of odd.one is padding


def odd_shapes(layout) -> dict:
    """`UPDATES` steps of AdamW and of ShardedAdamW on parameters whose sizes dp does not divide, the same
    gradients on every rank (scaled by 0.5, as a clip factor)."""
    from mindspore import Parameter, Tensor

    rng = np.random.default_rng(3)
    start = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in ODD_SHAPES.items()}
    grads = [tuple(Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in ODD_SHAPES.values())
             for _ in range(UPDATES)]
    result = {}
    for kind in ("plain", "sharded"):
        params = [Parameter(Tensor(value.copy()), name=name) for name, value in start.items()]
        kwargs = dict(learning_rate=LEARNING_RATE, weight_decay=0.1)
        optimizer = ShardedAdamW(params, layout.dp, layout.dp_rank, layout.dp_group, **kwargs) \
            if kind == "sharded" else AdamW(params, **kwargs)
        step = ApplyGrads(optimizer)
        for g in grads:
            step(g, Tensor(0.5, ms.float32))
        result.update({f"odd_{kind}/{p.name}": np.array(p.asnumpy()) for p in params})
        result.update({f"odd_{kind}_state/{p.name}": np.array(p.asnumpy()) for p in optimizer.moments2})
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_setup.graph_mode_on_cpu()
    world, rank = worker_setup.init_communication()
    layout = Layout.for_world(args.dp, args.tp, world, rank).init_groups()
    cfg = tiny_qwen2_config(num_layers=1)
    data = batch(layout, cfg.vocab_size)
    os.makedirs(args.out, exist_ok=True)
    saved = os.path.join(args.out, f"rank_{layout.rank}.ckpt")
    result = {"adam/lr": np.array(LEARNING_RATE), "adam/updates": np.array(UPDATES),
              "max_grad_norm": np.array(MAX_GRAD_NORM)}
    plain, result["plain_norms"], plain_state = train(cfg, layout, data, False, False)
    sharded, result["sharded_norms"], sharded_state = train(cfg, layout, data, True, False,
                                                            save_after=(UPDATES - 1, saved))
    resumed, result["resumed_norms"], _ = train(cfg, layout, data, True, False, 1, load=saved)
    micro, result["micro_norms"], _ = train(cfg, layout, data, True, True)
    for prefix, values in (("plain", plain), ("sharded", sharded), ("resumed", resumed), ("micro", micro),
                           ("plain_state", plain_state), ("sharded_state", sharded_state)):
        result.update({f"{prefix}/{name}": value for name, value in values.items()})
    result.update(odd_shapes(layout))
    result["saved_optimizer_entries"] = np.array(sorted(
        name for name in ms.load_checkpoint(saved) if is_optimizer_state(name)))
    worker_setup.save_rank_results(args.out, layout.rank, result)


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
