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

SHAPES = {
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, n_kv_heads=3,
                    intermediate_size=1536, qkv_has_bias=False, tie_word_embeddings=True),
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

    from mindrlhf.algorithms import GRPOLossCell
    from mindrlhf.algorithms.policy_cells import GRPOLossNet
    from mindrlhf.configs.recompute import RecomputeConfig
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.spmd import MicroBatchedTrainStep

    worker_setup.graph_mode_on_cpu()
    configure_cpu_memory_pool(world_size=1)
    shape = dict(SHAPES[args.shape], **({"vocab_size": args.vocab} if args.vocab else {}))
    cfg = Qwen2Config(**shape, seq_length=512)
    count = args.layers or cfg.num_layers
    if args.granularity != "off":  # the first `count` layers, as the YAML's recompute_config says it
        cfg.recompute = RecomputeConfig(**{"recompute" if args.granularity == "full" else "select_recompute": [count]})
    model = Qwen2ForCausalLM(cfg)
    init_random_weights(model, Layout(), seed=0)
    loss_net = GRPOLossNet(model, GRPOLossCell(beta=0.01, epsilon_low=0.2, epsilon_high=0.28))
    step = MicroBatchedTrainStep(loss_net, AdamW(model.trainable_params(), learning_rate=1e-6), Layout(),
                                 grad_reduction="sum", max_grad_norm=1.0)
    rng = np.random.default_rng(0)
    rows, P, R = args.rows, args.prompt, args.response
    batch = [rng.integers(1, cfg.vocab_size, (rows, P)).astype(np.int32), np.ones((rows, P), np.int32),
             rng.integers(1, cfg.vocab_size, (rows, R)).astype(np.int32), np.ones((rows, R), np.int32),
             np.full((rows, R), -1.0, np.float32), np.full((rows, R), -1.0, np.float32),
             rng.standard_normal(rows).astype(np.float32), np.full((rows, R), 1.0 / (rows * R), np.float32)]
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
