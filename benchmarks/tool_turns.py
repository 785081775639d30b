"""What one tool turn costs the rollout: appending the tool's answer to the rows' KV cache with the extend graph,
against prefilling every row's whole [prompt | trajectory so far] again (what a rollout without an extend graph
would do to resume after a tool call), side by side, on the bundled tool job's shapes (random weights: the cost
does not depend on them). Each graph is compiled and run once first; then each is timed `--repeats` times and the
median kept. Prints a table and writes JSON.

    .venv/bin/python benchmarks/tool_turns.py                   # model_configs/arith_tools, 64 rows
    .venv/bin/python benchmarks/tool_turns.py --shape smollm2 --rows 16 --prompt 96 --trajectory 64 --turn 40
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mindspore as ms
import numpy as np
from repo_paths import ROOT, SMOLLM2, results_path
from results_io import format_columns, write_results

from mindrlhf.models.qwen2 import KVCache, Qwen2Config, Qwen2ForCausalLM
from mindrlhf.parallel.layers import init_random_weights

SHAPES = {"arith_tools": os.path.join(ROOT, "model_configs", "arith_tools", "train.yaml"),
          "smollm2": os.path.join(SMOLLM2, "train.yaml")}


def timed(call, repeats: int) -> float:
    """The median seconds of `call()` (its outputs fetched), after one untimed call (the compile)."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def measure(args) -> dict:
    config = Qwen2Config.from_yaml(SHAPES[args.shape])
    config.parallel_config.data_parallel = 1
    model = Qwen2ForCausalLM(config)
    init_random_weights(model, seed=0)
    rows, prompt, done, turn = args.rows, args.prompt, args.trajectory, args.turn
    length = min(config.seq_length, prompt + done + turn + 8)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab_size, (rows, prompt + done + turn)).astype(np.int32)
    # the extend: the turn's tokens (and the model's last one) into slots prompt + done - 1 .., every row at once
    cache = KVCache(model, rows, length)
    width = turn + 1
    cache.prefill(ms.Tensor(ids[:, :prompt + done - 1]), ms.Tensor(np.ones((rows, prompt + done - 1), np.int32)),
                  *cache.rows_of(0, rows))
    first = prompt + done - 1
    valid = np.zeros((rows, length), np.float32)
    valid[:, :first + width] = 1.0
    inputs = [ms.Tensor(ids[:, first:first + width]), ms.Tensor(np.tile(np.arange(first, first + width,
                                                                                  dtype=np.int32), (rows, 1))),
              ms.Tensor(np.full(rows, first, np.int32)), ms.Tensor(np.ones((rows, width), np.float32)),
              ms.Tensor(valid), ms.Tensor(np.full(rows, width - 1, np.int32))]
    extend = timed(lambda: cache.extend(*inputs).asnumpy(), args.repeats)
    # the re-prefill: every row's whole sequence read again into a fresh cache
    again = KVCache(model, rows, length)
    whole = prompt + done + turn
    prefill_inputs = [ms.Tensor(ids), ms.Tensor(np.ones((rows, whole), np.int32)), *again.rows_of(0, rows)]
    prefill = timed(lambda: again.prefill(*prefill_inputs).asnumpy(), args.repeats)
    return {"shape": args.shape, "rows": rows, "prompt_tokens": prompt, "trajectory_tokens": done,
            "tool_turn_tokens": turn, "cache_length": length, "extend_width": width, "extend_s": extend,
            "re_prefill_s": prefill, "re_prefill_over_extend": prefill / extend, "repeats": args.repeats,
            "machine": platform.processor() or platform.machine(), "threads": os.cpu_count()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="arith_tools")
    parser.add_argument("--rows", type=int, default=64, help="the rollout's rows on one rank (the bundled job: 32)")
    parser.add_argument("--prompt", type=int, default=176, help="prompt tokens (the bucket)")
    parser.add_argument("--trajectory", type=int, default=72, help="the model's tokens before the call")
    parser.add_argument("--turn", type=int, default=40, help="the tool turn's tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=None, help="the JSON to write (default: benchmarks/results/)")
    args = parser.parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    result = measure(args)
    print(format_columns(["shape", "rows", "prompt + trajectory + turn", "extend s", "re-prefill s", "ratio"],
                         [[result["shape"], result["rows"], f"{args.prompt} + {args.trajectory} + {args.turn}",
                           f"{result['extend_s']:.4f}", f"{result['re_prefill_s']:.4f}",
                           f"{result['re_prefill_over_extend']:.1f}x"]]))
    write_results(result, args.output or results_path(f"tool_turns_{args.shape}.json"))


if __name__ == "__main__":
    main()
