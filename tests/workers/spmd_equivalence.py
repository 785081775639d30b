"""Worker for the SPMD equivalence tests: forward, loss, gradients and `UPDATES` AdamW steps of a tiny Qwen2, and
the GRPO loss with global token weights on responses of unequal lengths per data-parallel rank, and the PPO
critic's values, clipped value loss and gradients on the same responses.

Run with one process (reference, no msrun) or under msrun with `--dp/--tp`, one case or several in turn
(`--cases`, `worker_setup.run_cases`); each rank writes `<out>/rank_<r>.npz` with its logits, loss, local gradients
and local weights after the steps (and, in a parallel run, after the same steps over micro-batches: the tests compare
those with the one-process whole-batch steps), and per aggregation its shares of the GRPO outputs and its local GRPO
gradients, and the critic's values, value-loss shares and local gradients (not with LoRA adapters: `--lora_rank`).

Compiling a graph is most of its cost on CPU (each distinct graph a few seconds, per rank), so a graph serves what it
can: the GRPO and value loss graphs also return the log-probs and values they read (`WithInput`), which a first call
gives to make the old log-probs and values of the calls that count (no separate forward graphs).
"""
import argparse

import mindspore as ms
import numpy as np
import worker_setup
from mindspore import nn, ops
from support.batches import grpo_batch
from support.cells import WeightedNLLLoss
from support.configs import TINY_QWEN2, tiny_qwen2_config

from mindrlhf.algorithms import GRPOLossCell, ValueLossCell, aggregation_weights
from mindrlhf.algorithms.policy_cells import GRPOLossNet, ValueLossNet
from mindrlhf.configs.lora import LoraConfig
from mindrlhf.engine.batches import prompt_micro_batches
from mindrlhf.models.qwen2 import Qwen2ForCausalLM, Qwen2ForValue
from mindrlhf.optim import AdamW
from mindrlhf.parallel.layers import init_random_weights, param_split_axes, param_split_shards
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.spmd import MicroBatchedTrainStep, SPMDGradients, SPMDTrainStep

LEARNING_RATE, UPDATES = 1e-3, 3  # AdamW steps before the weights are saved (saved too: the tests' tolerance unit)


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


def micro_batched_results(cfg, layout, ids, labels, mask, max_grad_norm, dp_sums):
    """The updates of `main` (same initial weights, loss and clip) taken over 1-row micro-batches: gradients
    accumulated in buffers, reduced over dp in place (through `dp_sums` when given), clipped inside AdamW."""
    net = Qwen2ForCausalLM(cfg, layout)
    init_random_weights(net, layout, seed=0)
    weights = (mask / mask.sum()).astype(np.float32)
    step = MicroBatchedTrainStep(WeightedNLLLoss(net), AdamW(net.trainable_params(), learning_rate=LEARNING_RATE,
                                                            weight_decay=0.01), layout, max_grad_norm=max_grad_norm,
                                 dp_sums=dp_sums)
    losses, norms = [], []
    for _ in range(UPDATES):
        outputs, norm = step(prompt_micro_batches(dict(input_ids=ids, labels=labels, mask=mask, weights=weights), 1, 1))
        losses.append(outputs[0])
        norms.append(norm)
    result = {"micro_losses": np.array(losses), "micro_grad_norms": np.array(norms)}
    result.update({f"micro_weight/{p.name}": p.asnumpy() for p in net.trainable_params()})
    return result


class WithInput(nn.Cell):
    """A loss cell whose outputs are followed by its first input (the log-probs or values a loss net feeds it), without
    gradient: the loss net's graph returns them too."""

    def __init__(self, loss_cell: nn.Cell):
        super().__init__(auto_prefix=False)
        self.loss_cell = loss_cell
        self.OUTPUTS = loss_cell.OUTPUTS + ("input",)
        self.with_kl = getattr(loss_cell, "with_kl", False)  # which inputs GRPOLossNet names (INPUTS)

    def construct(self, read, *inputs):
        return self.loss_cell(read, *inputs) + (ops.stop_gradient(read),)


GRPO_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def grpo_results(net, layout, params, dp_sums) -> dict[str, np.ndarray]:
    """This rank's shares of the GRPO outputs and its local gradients, per aggregation (weights global)."""
    data = grpo_batch(net.config.vocab_size)
    per = data["response_mask"].shape[0] // layout.dp
    mine = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    inputs = [ms.Tensor(data[k][mine]) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    loss_net = GRPOLossNet(net, WithInput(GRPOLossCell(beta=0.05, epsilon_low=0.05, epsilon_high=0.08,
                                                       kl_estimator="k3")))
    grads_of = SPMDGradients(loss_net, params, layout, grad_reduction="sum", dp_sums=dp_sums)
    advantages = ms.Tensor(data["advantages"][mine])

    def call(old_logp, ref_logp, name):
        """(the GRPO outputs but the log-probs, the policy's log-probs, the local gradients)."""
        weights = aggregation_weights(data["response_mask"], name).astype(np.float32)[mine]
        outputs, grads, _ = grads_of(*inputs, ms.Tensor(old_logp), ms.Tensor(ref_logp), advantages,
                                     ms.Tensor(weights))
        return outputs[:-2] + outputs[-1:], outputs[-2].asnumpy(), grads

    # the first call (old and reference log-probs 0, its outputs and gradients unused) gives the log-probs
    _, logp, _ = call(*np.zeros((2,) + inputs[2].shape, np.float32), GRPO_AGGREGATIONS[0])
    noise = data["noise"][:, mine]
    old_logp, ref_logp = logp + 0.1 * noise[0], logp + 0.3 * noise[1]  # ratios on both sides of the clip range
    result = {}
    for name in GRPO_AGGREGATIONS:
        outputs, _, grads = call(old_logp, ref_logp, name)
        result[f"grpo_outputs/{name}"] = np.array([float(o.asnumpy()) for o in outputs])
        result.update({f"grpo_grad_{name}/{p.name}": g.asnumpy() for p, g in zip(params, grads)})
    return result


def critic_results(cfg, layout, dp_sums) -> dict[str, np.ndarray]:
    """The PPO critic (value head on the backbone, random weights) on the GRPO batch's responses: this rank's
    values, its shares of (vf_loss, vf_clipfrac) under token-mean weights and its local gradients, and the
    critic's split axes."""
    critic = Qwen2ForValue(cfg, layout)
    critic.update_parameters_name("critic.")
    init_random_weights(critic, layout, seed=5)
    params = critic.trainable_params()
    data = grpo_batch(cfg.vocab_size)
    per = data["response_mask"].shape[0] // layout.dp
    mine = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    inputs = [ms.Tensor(data[k][mine]) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    weights = ms.Tensor(aggregation_weights(data["response_mask"], "token-mean").astype(np.float32)[mine])
    grads_of = SPMDGradients(ValueLossNet(critic, WithInput(ValueLossCell(0.2))), params, layout,
                             grad_reduction="sum", dp_sums=dp_sums)
    # the first call (old values and returns 0, its outputs and gradients unused) gives the values
    zeros = ms.Tensor(np.zeros(inputs[2].shape, np.float32))
    values = grads_of(*inputs, zeros, zeros, weights)[0][-1].asnumpy()
    old_values = values + 0.3 * data["noise"][0, mine]  # some tokens outside the clip range
    returns = values + data["noise"][1, mine]
    outputs, grads, _ = grads_of(*inputs, ms.Tensor(old_values.astype(np.float32)),
                                 ms.Tensor(returns.astype(np.float32)), weights)
    result = {"critic_values": values, "critic_outputs": np.array([float(o.asnumpy()) for o in outputs[:-1]])}
    result.update({f"critic_grad/{p.name}": g.asnumpy() for p, g in zip(params, grads)})
    result.update({f"axis/{k}": np.array(-1 if v is None else v) for k, v in param_split_axes(critic).items()})
    result.update({f"shards/{k}": np.array(v) for k, v in param_split_shards(critic, layout.tp).items()})
    return result


def parallel_layout(dp: int, tp: int, cpu_collectives: str):
    """(layout, dp_sums): this rank's layout (communication initialised when dp x tp > 1) and, with
    `cpu_collectives` "auto", the shared-memory group its dp gradient sums go through (else None)."""
    if dp * tp == 1:
        return Layout(), None
    world, rank = worker_setup.communication()
    layout = Layout.for_world(dp, tp, world, rank).init_groups()
    if cpu_collectives != "auto":
        return layout, None
    from mindrlhf.parallel.host_setup import share_data_parallel_sums

    groups = share_data_parallel_sums("auto", [layout], world, rank)
    assert list(groups) == [layout.dp_group], groups
    return layout, groups[layout.dp_group]


def main(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compute_dtype", default="float32")
    parser.add_argument("--n_kv_heads", type=int, default=TINY_QWEN2["n_kv_heads"],
                        help="fewer than --tp: each kv head is shared by tp / n_kv_heads ranks")
    parser.add_argument("--cpu_collectives", choices=("native", "auto"), default="native",
                        help="auto: the dp gradient sums through shared memory (mindrlhf.parallel.shared_memory)")
    parser.add_argument("--seq_parallel", action="store_true", help="parallel_config.use_seq_parallel")
    parser.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters on every linear layer (all-linear)")
    args = parser.parse_args(argv)
    worker_setup.graph_mode_on_cpu()
    layout, dp_sums = parallel_layout(args.dp, args.tp, args.cpu_collectives)
    cfg = tiny_qwen2_config(n_kv_heads=args.n_kv_heads, compute_dtype=args.compute_dtype)
    cfg.parallel_config.use_seq_parallel = args.seq_parallel
    cfg.lora = LoraConfig(lora_rank=args.lora_rank, lora_alpha=4.0)  # random B (init_random_weights): A learns too
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
    # the losses' global normalisation is the same code with adapters or without: the LoRA runs check the training
    with_losses = args.lora_rank == 0
    grpo = grpo_results(net, layout, net.trainable_params(), dp_sums) if with_losses else {}
    loss_net = NLLLoss(net)
    grads_of = SPMDGradients(loss_net, net.trainable_params(), layout, dp_sums=dp_sums)
    _, grads, grad_norm = grads_of(ids_l, labels_l, mask_l)
    first_grads = {p.name: g.asnumpy() for p, g in zip(net.trainable_params(), grads)}
    optimizer = AdamW(net.trainable_params(), learning_rate=LEARNING_RATE, weight_decay=0.01)
    # a clip well below the gradient norm, so that every update is clipped by the global norm
    clip = 0.25 * float(grad_norm.asnumpy())
    step = SPMDTrainStep(loss_net, optimizer, layout, max_grad_norm=clip, dp_sums=dp_sums)
    losses, norms = [], []
    for _ in range(UPDATES):
        (loss, _), norm = step(ids_l, labels_l, mask_l)
        losses.append(float(loss.asnumpy()))
        norms.append(float(norm.asnumpy()))
    result = {"logits": logits, "losses": np.array(losses), "grad_norms": np.array(norms),
              "first_grad_norm": grad_norm.asnumpy(), "adam/lr": np.array(LEARNING_RATE),
              "adam/updates": np.array(UPDATES)}
    result.update(grpo)
    if layout.dp * layout.tp > 1:  # the tests compare these with the reference's whole-batch updates
        result.update(micro_batched_results(cfg, layout, ids[sl], labels[sl], mask[sl], clip, dp_sums))
    if with_losses:
        result.update(critic_results(cfg, layout, dp_sums))
    result.update({f"grad/{k}": v for k, v in first_grads.items()})
    result.update({f"weight/{p.name}": p.asnumpy() for p in net.trainable_params()})
    result.update({f"axis/{k}": np.array(-1 if v is None else v) for k, v in axes.items()})
    result.update({f"shards/{k}": np.array(v) for k, v in param_split_shards(net, layout.tp).items()})
    worker_setup.save_rank_results(args.out, layout.rank, result)


if __name__ == "__main__":
    worker_setup.run_worker_script(lambda: worker_setup.run_cases(main))
