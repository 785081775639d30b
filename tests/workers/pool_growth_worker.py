"""Worker: resident memory after each of 2 fused train steps of a 2-layer model with Qwen2.5-0.5B's vocabulary
(its embedding, logits and gradients are each hundreds of MiB), with the trainer's CPU memory pool setting or
MindSpore's default (`--default_pool`); writes {"rss_gib": [...]} to --out."""
import argparse
import json
from pathlib import Path

import numpy as np
import worker_setup


def resident_gib() -> float:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--default_pool", action="store_true")
    args = p.parse_args()
    import mindspore as ms

    from mindrlhf.algorithms.policy_cells import SFTLossNet
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.host_setup import configure_cpu_memory_pool
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.spmd import SPMDTrainStep

    worker_setup.graph_mode_on_cpu()
    pool = None if args.default_pool else configure_cpu_memory_pool(world_size=1)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, num_layers=2, num_heads=14, n_kv_heads=2,
                         intermediate_size=4864, seq_length=256, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    for param in model.trainable_params():
        param.set_data(ms.Tensor(np.full(param.shape, 0.01, np.float32)))
    optimizer = AdamW(model.trainable_params(), learning_rate=1e-5)
    step = SPMDTrainStep(SFTLossNet(model), optimizer, Layout())
    rows = 4
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (rows, 128)).astype(np.int32)
    weights = np.full((rows, 127), 1 / (rows * 127), np.float32)  # the token mean of every response token
    inputs = [ms.Tensor(a) for a in (ids[:, :1], np.ones((rows, 1), np.int32), ids[:, 1:],
                                     np.ones((rows, 127), np.int32), weights)]
    rss = []
    for _ in range(2):  # the default pool grows ~1 GiB at the second call already
        _, norm = step(*inputs)
        assert np.isfinite(norm.asnumpy())
        rss.append(resident_gib())
    Path(args.out).write_text(json.dumps({"rss_gib": rss, "pool_gib": pool}))


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
