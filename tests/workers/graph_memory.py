"""Resident memory each compiled graph keeps, at SmolLM2-135M's shape cut to `--layers` decoder layers (vocabulary
`--vocab`, 1024 by default so that the logits stay small; log-probs at `--temperature`): the graph calls `--calls` (a
JSON list of [prompts, rows, prompt width, response width]) run in order, the widest first, so that the memory
pool's high water is set by the first and each later call's growth of VmRSS is what compiling and running its own
graph kept. `--kind forward` runs the response log-prob graph (the reference pass), `train` the GRPO train step
(forward, backward, AdamW). Prints a JSON line.

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
from support.batches import grpo_train_inputs
from support.cells import grpo_train_step
from support.configs import SMOLLM2_SHAPE

VOCAB = 1024


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def graph_call(kind: str, model, temperature: float = 1.0):
    """A function running one call of the `kind` graph on `support.batches.grpo_train_inputs` (the log-prob graph
    reads the first four: prompt ids and mask, response ids and mask)."""
    import mindspore as ms

    from mindrlhf.algorithms.policy_cells import ResponseLogProbs

    if kind == "forward":
        net = ResponseLogProbs(model, temperature)
        return lambda inputs: net(*[ms.Tensor(a) for a in inputs[:4]]).asnumpy()
    step = grpo_train_step(model, temperature)
    return lambda inputs: step([[ms.Tensor(a) for a in inputs]])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--kind", choices=("forward", "train"), required=True)
    p.add_argument("--vocab", type=int, default=VOCAB)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--calls", required=True, help="JSON list of [prompts, rows, prompt width, response width]")
    args = p.parse_args()

    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout

    worker_setup.graph_mode_on_cpu()
    configure_cpu_memory_pool(world_size=1)
    shape = dict(SMOLLM2_SHAPE, vocab_size=args.vocab, num_layers=args.layers)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, seq_length=1024))
    init_random_weights(model, Layout(), seed=0)
    run = graph_call(args.kind, model, args.temperature)
    rng = np.random.default_rng(0)
    calls = []
    for prompts, rows, prompt_width, response_width in json.loads(args.calls):
        inputs = grpo_train_inputs(rng, args.vocab, prompts, rows, prompt_width, response_width)
        before, started = resident_mib(), time.time()
        run(inputs)
        gc.collect()
        calls.append({"prompts": prompts, "rows": rows, "prompt": prompt_width, "response": response_width,
                      "kept_mib": round(resident_mib() - before, 1), "seconds": round(time.time() - started, 1)})
    print(json.dumps({"kind": args.kind, "layers": args.layers, "calls": calls}), flush=True)


if __name__ == "__main__":
    main()
