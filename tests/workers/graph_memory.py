"""Resident memory each compiled graph keeps, at SmolLM2-135M's shape cut to `--layers` decoder layers (vocabulary
1024, so that the logits stay small): the graph calls `--calls` (a JSON list of [prompts, rows, prompt width,
response width]) run in order, the widest first, so that the memory pool's high water is set by the first and each
later call's growth of VmRSS is what compiling and running its own graph kept. `--kind forward` runs the response
log-prob graph (the reference pass), `train` the GRPO train step (forward, backward, AdamW). Prints a JSON line.

    python tests/workers/graph_memory.py --layers 4 --kind train --calls '[[1, 1, 72, 512], [1, 1, 72, 344]]'

`benchmarks/memory_plan.py graphs` runs it at two depths per kind: the difference over the extra layers is each
graph's memory per decoder layer.
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import numpy as np
import worker_setup

SMOLLM2 = dict(vocab_size=1024, hidden_size=576, num_heads=9, n_kv_heads=3, intermediate_size=1536,
               qkv_has_bias=False, tie_word_embeddings=True, seq_length=1024)


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def graph_call(kind: str, model):
    """A function running one call of the `kind` graph on numpy inputs (prompt ids and mask, response ids and
    mask)."""
    import mindspore as ms

    from mindrlhf.algorithms import GRPOLossCell
    from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseLogProbs
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.spmd import MicroBatchedTrainStep

    if kind == "forward":
        net = ResponseLogProbs(model)
        return lambda inputs: net(*[ms.Tensor(a) for a in inputs]).asnumpy()
    loss_net = GRPOLossNet(model, GRPOLossCell(beta=0.01, epsilon_low=0.2, epsilon_high=0.28))
    step = MicroBatchedTrainStep(loss_net, AdamW(model.trainable_params(), learning_rate=1e-6), Layout(),
                                 grad_reduction="sum", max_grad_norm=1.0)
    rng = np.random.default_rng(1)

    def train(inputs):
        rows, width = inputs[2].shape
        extra = [np.full((rows, width), -1.0, np.float32), np.full((rows, width), -1.0, np.float32),
                 rng.standard_normal(rows).astype(np.float32), np.full((rows, width), 1.0 / (rows * width), np.float32)]
        step([[ms.Tensor(a) for a in [*inputs, *extra]]])
    return train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kind", choices=("forward", "train"), required=True)
    p.add_argument("--calls", required=True, help="JSON list of [prompts, rows, prompt width, response width]")
    args = p.parse_args()

    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout

    worker_setup.graph_mode_on_cpu()
    configure_cpu_memory_pool(world_size=1)
    model = Qwen2ForCausalLM(Qwen2Config(**SMOLLM2, num_layers=args.layers))
    init_random_weights(model, Layout(), seed=0)
    run = graph_call(args.kind, model)
    rng = np.random.default_rng(0)
    calls = []
    for prompts, rows, prompt_width, response_width in json.loads(args.calls):
        inputs = [rng.integers(1, 1000, (prompts, prompt_width)).astype(np.int32),
                  np.ones((prompts, prompt_width), np.int32),
                  rng.integers(1, 1000, (rows, response_width)).astype(np.int32),
                  np.ones((rows, response_width), np.int32)]
        before, started = resident_mib(), time.time()
        run(inputs)
        gc.collect()
        calls.append({"prompts": prompts, "rows": rows, "prompt": prompt_width, "response": response_width,
                      "kept_mib": round(resident_mib() - before, 1), "seconds": round(time.time() - started, 1)})
    print(json.dumps({"kind": args.kind, "layers": args.layers, "calls": calls}), flush=True)


if __name__ == "__main__":
    main()
