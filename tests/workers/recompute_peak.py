"""One GRPO train step (policy + GRPO loss, one graph call, AdamW) in GRAPH_MODE on CPU, with the decoder layers
recomputed or not; prints a JSON line with the peak RSS before and after the step.

    python tests/workers/recompute_peak.py --shape smollm2 --rows 2 --prompt 64 --response 128 \
        --granularity full --layers 30

`benchmarks/memory_plan.py recompute` runs it per variant (each in its own process: ru_maxrss only grows) and
fits `mindrlhf.engine.memory_budget`'s recompute terms from the differences.
"""
from __future__ import annotations

import argparse
import json
import resource

import numpy as np
import worker_setup
from support.batches import grpo_train_inputs
from support.cells import grpo_train_step
from support.configs import SMOLLM2_SHAPE

SHAPES = {
    "smollm2": dict(SMOLLM2_SHAPE),
    "tiny": dict(vocab_size=704, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=128,
                 qkv_has_bias=True, tie_word_embeddings=False),
}


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--granularity", choices=("off", "full", "selective"), default="off")
    p.add_argument("--layers", type=int, default=0, help="layers that recompute (0 = all)")
    p.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary (0 = keep)")
    args = p.parse_args()

    import mindspore as ms

    from mindrlhf.configs.recompute import RecomputeConfig
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout

    worker_setup.graph_mode_on_cpu()
    configure_cpu_memory_pool(world_size=1)
    shape = dict(SHAPES[args.shape], **({"vocab_size": args.vocab} if args.vocab else {}))
    cfg = Qwen2Config(**shape, seq_length=512)
    count = args.layers or cfg.num_layers
    if args.granularity != "off":  # the first `count` layers, as the YAML's recompute_config says it
        cfg.recompute = RecomputeConfig(**{"recompute" if args.granularity == "full" else "select_recompute": [count]})
    model = Qwen2ForCausalLM(cfg)
    init_random_weights(model, Layout(), seed=0)
    step = grpo_train_step(model)
    rows, P, R = args.rows, args.prompt, args.response
    batch = grpo_train_inputs(np.random.default_rng(0), cfg.vocab_size, rows, rows, P, R)
    before = peak_gib()
    outputs, norm = step([[ms.Tensor(a) for a in batch]])
    first = peak_gib()
    step([[ms.Tensor(a) for a in batch]])
    print(json.dumps({"shape": args.shape, "vocab": cfg.vocab_size, "rows": rows, "prompt": P, "response": R,
                      "granularity": args.granularity, "layers": count if args.granularity != "off" else 0,
                      "before_gib": round(before, 4), "after_gib": round(peak_gib(), 4),
                      "first_gib": round(first, 4), "loss": float(outputs[0]), "grad_norm": norm}), flush=True)


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
