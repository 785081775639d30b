"""Worker for the SPMD equivalence tests: forward, loss, gradients and 3 AdamW steps of a tiny Qwen2.

Run with one process (reference, no msrun) or under msrun with `--dp/--tp`; each rank writes
`<out>/rank_<r>.npz` with its logits, loss, local gradients and local weights after the steps.
"""
import argparse
import os

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.parallel import Layout
from mindrlhf.parallel.layers import init_random_weights, param_split_axes
from mindrlhf.parallel.spmd import SPMDGradients, SPMDTrainStep

CONFIG = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=4, intermediate_size=64,
              seq_length=32, max_position_embedding=64, theta=10000.0, qkv_has_bias=True)


class NLLLoss(nn.Cell):
    """Token-mean negative log-likelihood of the labels (this rank's slice of the batch), as (loss, loss)."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, labels, mask):
        logp = self.model.log_probs(input_ids, labels, mask)
        m = mask.astype(ms.float32)
        loss = -(logp * m).sum() / m.sum()
        return loss, ops.stop_gradient(loss)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compute_dtype", default="float32")
    args = parser.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if args.dp * args.tp > 1:
        from mindspore.communication import get_group_size, get_rank, init
        init()
        layout = Layout.for_world(args.dp, args.tp, get_group_size(), get_rank()).init_groups()
    else:
        layout = Layout()
    cfg = Qwen2Config(**CONFIG, compute_dtype=args.compute_dtype)
    net = Qwen2ForCausalLM(cfg, layout)
    axes = param_split_axes(net)
    init_random_weights(net, layout, seed=0)

    rng = np.random.RandomState(1)
    global_batch, seq = 4, 16
    ids = rng.randint(0, cfg.vocab_size, (global_batch, seq)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    mask = np.ones((global_batch, seq), np.int32)
    mask[1, :3] = 0  # left padding, equal token counts per dp shard keep the token-mean exact
    mask[3, :3] = 0
    per = global_batch // layout.dp
    sl = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    ids_l, labels_l, mask_l = (ms.Tensor(a[sl]) for a in (ids, labels, mask))

    logits = net(ids_l, mask_l).asnumpy()
    loss_net = NLLLoss(net)
    _, grads = SPMDGradients(loss_net, net.trainable_params(), layout)(ids_l, labels_l, mask_l)
    first_grads = {p.name: g.asnumpy() for p, g in zip(net.trainable_params(), grads)}
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
    step = SPMDTrainStep(loss_net, optimizer, layout)
    losses = []
    for _ in range(3):
        loss, _ = step(ids_l, labels_l, mask_l)
        losses.append(float(loss.asnumpy()))
    result = {"logits": logits, "losses": np.array(losses)}
    result.update({f"grad/{k}": v for k, v in first_grads.items()})
    result.update({f"weight/{p.name}": p.asnumpy() for p in net.trainable_params()})
    result.update({f"axis/{k}": np.array(-1 if v is None else v) for k, v in axes.items()})
    os.makedirs(args.out, exist_ok=True)
    np.savez(os.path.join(args.out, f"rank_{layout.rank}.npz"), **result)


if __name__ == "__main__":
    main()
