"""Worker for the pipeline equivalence tests: `UPDATES` clipped AdamW steps of the GRPO loss on a tiny 4-layer
Qwen2 split into `--pp` pipeline stages (x `--tp`) over `--micro_batches`, and the same steps of the whole model in
one piece, in one process without communication (`--reference_only`, plain Python: it writes `<out>/rank_0.npz`
with the steps' summed loss-net outputs, gradient norms and weights, and the old/ref log-probs and the clip the
stages' run takes as inputs). The stages' run (msrun) reads that file (`--reference`); each rank writes
`<out>/rank_<r>.npz`: the summed loss-net outputs and gradient norms per update and its stage's weights after the
updates, with the split axes and lr. `--tied` ties the embedding and the head: the first and the last stage hold it
and sum its gradients. `--recompute full|selective` makes the stages' layers recompute their activations in the
backward pass and `--seq_parallel` cuts their residual stream along the sequence over tp (the one-piece run does
neither): the results must not change. Several cases run in one process in turn (`--cases`,
`worker_setup.run_cases`).
"""
import argparse
import dataclasses

import mindspore as ms
import numpy as np
import worker_setup
from support.batches import grpo_batch
from support.configs import tiny_qwen2_config

from mindrlhf.algorithms import GRPOLossCell, aggregation_weights
from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseHidden, ResponseLogProbs
from mindrlhf.configs.lora import LoraConfig
from mindrlhf.configs.recompute import RecomputeConfig
from mindrlhf.engine.batches import prompt_micro_batches
from mindrlhf.models.qwen2 import Qwen2ForCausalLM
from mindrlhf.optim import AdamW
from mindrlhf.parallel.layers import init_random_weights, param_split_axes
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.pipeline import PipelineTrainStep
from mindrlhf.parallel.spmd import SPMDGradients, SPMDTrainStep

LEARNING_RATE, UPDATES = 1e-3, 2
ONE_PIECE = "one_piece."


def loss_cell():
    return GRPOLossCell(beta=0.05, epsilon_low=0.05, epsilon_high=0.08, kl_estimator="k3")


def batch_arrays(cfg, old_logp, ref_logp) -> list[np.ndarray]:
    """The GRPO loss net's inputs: the batch, the old and ref log-probs, its advantages and token-mean weights."""
    data = grpo_batch(cfg.vocab_size)
    weights = aggregation_weights(data["response_mask"], "token-mean").astype(np.float32)
    return [data[k] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")] + [
        old_logp.astype(np.float32), ref_logp.astype(np.float32), data["advantages"], weights]


def one_piece(cfg) -> dict[str, np.ndarray]:
    """The whole model in one piece, in this process alone: old/ref log-probs, the clip and the expected updates."""
    whole = Qwen2ForCausalLM(cfg)
    init_random_weights(whole, Layout(), seed=0)
    whole.update_parameters_name(ONE_PIECE)
    data = grpo_batch(cfg.vocab_size)
    tensors = [ms.Tensor(data[k]) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    logp = ResponseLogProbs(whole)(*tensors).asnumpy()
    old_logp, ref_logp = logp + 0.1 * data["noise"][0], logp + 0.3 * data["noise"][1]
    arrays = batch_arrays(cfg, old_logp, ref_logp)
    whole_loss = GRPOLossNet(whole, loss_cell())
    _, _, first_norm = SPMDGradients(whole_loss, whole.trainable_params(), Layout(), grad_reduction="sum")(
        *[ms.Tensor(a) for a in arrays])
    clip = 0.5 * float(first_norm.asnumpy())  # every update is clipped by the global norm
    whole_step = SPMDTrainStep(whole_loss, AdamW(whole.trainable_params(), learning_rate=LEARNING_RATE),
                               Layout(), grad_reduction="sum", max_grad_norm=clip)
    whole_outputs, whole_norms = [], []
    for _ in range(UPDATES):
        outputs, norm = whole_step(*[ms.Tensor(a) for a in arrays])
        whole_outputs.append([float(o.asnumpy()) for o in outputs])
        whole_norms.append(float(norm.asnumpy()))
    result = {"whole_outputs": np.array(whole_outputs), "whole_norms": np.array(whole_norms),
              "old_logp": arrays[4], "ref_logp": arrays[5], "clip": np.array(clip),
              "tied": np.array(cfg.tie_word_embeddings), "lora_rank": np.array(cfg.lora.lora_rank)}
    result.update({f"whole/{p.name[len(ONE_PIECE):]}": p.asnumpy() for p in whole.trainable_params()})
    return result


def stages(args, cfg, reference) -> dict[str, np.ndarray]:
    """This rank's stage of the pipelined run, from the one-piece run's inputs (`reference`)."""
    world, rank = worker_setup.communication()
    layout = Layout.for_world(1, args.tp, world, rank, pp=args.pp).init_groups()
    arrays = batch_arrays(cfg, reference["old_logp"], reference["ref_logp"])
    clip = float(reference["clip"])
    recompute = RecomputeConfig(recompute=args.recompute == "full", select_recompute=args.recompute == "selective")
    parallel = dataclasses.replace(cfg.parallel_config, use_seq_parallel=args.seq_parallel)
    model = Qwen2ForCausalLM(dataclasses.replace(cfg, recompute=recompute, parallel_config=parallel), layout)
    init_random_weights(model, layout, seed=0)
    stage_net = GRPOLossNet(model, loss_cell()) if layout.stage == layout.pp - 1 else ResponseHidden(model)
    optimizer = AdamW(model.trainable_params(), learning_rate=LEARNING_RATE)
    width = arrays[0].shape[1] + arrays[2].shape[1] - 1
    step = PipelineTrainStep(stage_net, optimizer, layout, lambda inputs: (inputs[0].shape[0], width,
                                                                           cfg.hidden_size),
                             ms.float32, num_inputs=8, forward_inputs=4, num_outputs=len(GRPOLossNet.OUTPUTS),
                             grad_reduction="sum", max_grad_norm=clip, stage_shared=model.stage_shared_params)
    rows = len(arrays[0]) // args.micro_batches
    pipe_outputs, pipe_norms = [], []
    for _ in range(UPDATES):
        outputs, norm = step(prompt_micro_batches(dict(zip(GRPOLossNet.INPUTS, arrays)), rows, 1))
        pipe_outputs.append(outputs)
        pipe_norms.append(norm)
    result = {"pipe_outputs": np.array(pipe_outputs), "pipe_norms": np.array(pipe_norms),
              "adam/lr": np.array(LEARNING_RATE), "adam/updates": np.array(UPDATES)}
    result.update({f"weight/{p.name}": p.asnumpy() for p in model.trainable_params()})
    result.update({f"axis/{k}": np.array(-1 if v is None else v) for k, v in param_split_axes(model).items()})
    return result


def main(argv: list[str]):
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro_batches", type=int, default=1)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--lora_rank", type=int, default=0, help="LoRA adapters on every linear layer: only they train")
    parser.add_argument("--recompute", choices=("off", "full", "selective"), default="off")
    parser.add_argument("--seq_parallel", action="store_true", help="the stages' parallel_config.use_seq_parallel")
    parser.add_argument("--reference_only", action="store_true", help="the one-piece run only (one process)")
    parser.add_argument("--reference", help="the one-piece run's rank_0.npz (--reference_only) of this model")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    worker_setup.graph_mode_on_cpu()
    cfg = tiny_qwen2_config(num_layers=4, tie_word_embeddings=args.tied)
    cfg.lora = LoraConfig(lora_rank=args.lora_rank, lora_alpha=4.0)  # random B (init_random_weights): A learns too
    if args.reference_only:
        worker_setup.save_rank_results(args.out, 0, one_piece(cfg))
        return
    reference = dict(np.load(args.reference))
    assert bool(reference["tied"]) == args.tied, (args.reference, args.tied)
    assert int(reference["lora_rank"]) == args.lora_rank, (args.reference, args.lora_rank)
    worker_setup.save_rank_results(args.out, worker_setup.communication()[1], stages(args, cfg, reference))


if __name__ == "__main__":
    worker_setup.run_worker_script(lambda: worker_setup.run_cases(main))
