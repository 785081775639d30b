"""Generation speed of a tiny random Qwen2 in GRAPH_MODE: static KV cache vs full recompute per step.

A warm-up call (compile + one run) is timed separately from the measured calls; the seconds spent inside the
graph calls (and fetching their outputs) are counted apart from the host's share of each step (token bookkeeping,
and whatever token selection runs on the host). Prints a table and writes JSON.

    .venv/bin/python benchmarks/generation.py [--batch 16 --new-tokens 64 --output benchmarks/results/generation.json]
    .venv/bin/python benchmarks/generation.py --vocab-size 49152 --batch 32 --new-tokens 96 --top-p 0.9 --kv-cache-only
    .venv/bin/python benchmarks/generation.py --shape smollm2 --batch 32 --new-tokens 96 --max-prompt-len 72 \
        --buckets 72 --temperature 0.7 --kv-cache-only --repeats 2     # the SmolLM2 job's rollout, random weights
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import mindspore as ms
import numpy as np
from repo_paths import SMOLLM2
from results_io import write_results

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation import Generator, sample_tokens
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.parallel.layers import init_random_weights

TINY = dict(vocab_size=1024, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=128,
            seq_length=512)
SMOLLM2_YAML = os.path.join(SMOLLM2, "train.yaml")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16, help="rows per call = prompts * num_samples")
    p.add_argument("--num-samples", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens (EOS disabled: all are generated)")
    p.add_argument("--max-prompt-len", type=int, default=48, help="prompt lengths drawn from [max/2, max]")
    p.add_argument("--buckets", type=int, nargs="+", default=[32, 64], help="prompt buckets")
    p.add_argument("--repeats", type=int, default=3, help="measured calls after the warm-up (median reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny",
                   help="the model: a tiny Qwen2 (hidden 64, 2 layers) or the shipped SmolLM2-135M YAML's network "
                        "(30 layers, vocabulary 49152), random weights either way")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary (default: the shape's; tiny 1024, SmolLM2 49152)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sampling's top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampling's top-p (1 = off)")
    p.add_argument("--kv-cache-only", action="store_true", help="skip the run without the KV cache")
    p.add_argument("--output", default=os.path.join("benchmarks", "results", "generation.json"))
    args = p.parse_args(argv)
    if args.batch % args.num_samples:
        p.error(f"--batch {args.batch} must be a multiple of --num-samples {args.num_samples}")
    return args


def model_config(shape: str, layers: int | None, vocab_size: int | None) -> Qwen2Config:
    """The benchmark's network: the tiny one or the shipped SmolLM2 YAML's, with the layers and vocabulary asked."""
    config = Qwen2Config(**TINY) if shape == "tiny" else Qwen2Config.from_yaml(SMOLLM2_YAML)
    changes = {k: v for k, v in (("num_layers", layers), ("vocab_size", vocab_size)) if v is not None}
    return dataclasses.replace(config, **changes)


def build_model(seed: int, config: Qwen2Config) -> Qwen2ForCausalLM:
    net = Qwen2ForCausalLM(config)
    init_random_weights(net, seed=seed)
    return net


class TimedGenerator(Generator):
    """A Generator that adds up the seconds of its graph calls (`_run`: the graph and fetching its outputs)."""

    graph_seconds = 0.0

    def _run(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super()._run(*args, **kwargs)
        finally:
            self.graph_seconds += time.perf_counter() - start


def measure(model, config: GenerationConfig, prompts, repeats: int) -> tuple[dict, np.ndarray]:
    gen = TimedGenerator(model, config)
    start = time.perf_counter()
    out = gen.generate(prompts)
    warmup = time.perf_counter() - start
    times, graph_times = [], []
    for _ in range(repeats):
        gen.reseed()
        gen.graph_seconds = 0.0
        start = time.perf_counter()
        out = gen.generate(prompts)
        times.append(time.perf_counter() - start)
        graph_times.append(gen.graph_seconds)
    seconds = statistics.median(times)
    host_share = statistics.median(1 - g / t for g, t in zip(graph_times, times))
    tokens = out.stats["batch_size"] * out.stats["steps"]
    first_calls = {}
    for signature, sec in gen.first_call_seconds.items():
        first_calls[signature[0]] = first_calls.get(signature[0], 0.0) + sec
    row = {
        "use_kv_cache": config.use_kv_cache,
        "warmup_seconds": warmup,
        "seconds": seconds,
        "all_seconds": times,
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "ms_per_step": 1000 * seconds / out.stats["steps"],
        "host_share": host_share,
        "all_graph_seconds": graph_times,
        "compilations": gen.compile_counts(),
        "mindspore_compiled_graphs": gen.graph_compile_counts(),
        "first_call_seconds": first_calls,
        "prompt_bucket": out.stats["prompt_bucket"],
    }
    return row, out.response_ids


def host_sampling_ms(batch: int, vocab: int, top_k: int, top_p: float, steps: int = 64) -> float:
    """Time of numpy's sampling step (`sample_tokens`, temperature 1) on [batch, vocab] logits."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(batch, vocab)).astype(np.float32)
    start = time.perf_counter()
    for _ in range(steps):
        sample_tokens(logits, rng, top_k=top_k, top_p=top_p)
    return 1000 * (time.perf_counter() - start) / steps


def main(argv=None) -> dict:
    args = parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net_config = model_config(args.shape, args.layers, args.vocab_size)
    model = build_model(args.seed, net_config)
    rng = np.random.default_rng(args.seed)
    num_prompts = args.batch // args.num_samples
    prompts = [rng.integers(1, min(net_config.vocab_size, TINY["vocab_size"]),
                            size=int(rng.integers(args.max_prompt_len // 2, args.max_prompt_len + 1))).tolist()
               for _ in range(num_prompts)]
    base = GenerationConfig(max_new_tokens=args.new_tokens, num_generations=args.num_samples,
                            temperature=args.temperature,
                            eos_token_ids=[], pad_token_id=0, prompt_buckets=args.buckets, seed=args.seed,
                            top_k=args.top_k, top_p=args.top_p)
    rows, outputs = [], []
    for use_kv_cache in (True,) if args.kv_cache_only else (True, False):
        config = dataclasses.replace(base, use_kv_cache=use_kv_cache)
        row, response = measure(model, config, prompts, args.repeats)
        rows.append(row)
        outputs.append(response)
    result = {
        "model": {"shape": args.shape, "num_layers": net_config.num_layers, "hidden_size": net_config.hidden_size,
                  "vocab_size": net_config.vocab_size},
        "batch": args.batch,
        "num_samples": args.num_samples,
        "new_tokens": args.new_tokens,
        "prompt_lengths": [len(p) for p in prompts],
        "prompt_buckets": args.buckets,
        "cache_length": base.cache_length,
        "sampling": f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, EOS disabled",
        "outputs_identical": bool(np.array_equal(outputs[0], outputs[-1])) if len(outputs) > 1 else None,
        "numpy_sampling_ms_per_step": host_sampling_ms(args.batch, net_config.vocab_size, args.top_k, args.top_p),
        "speedup_kv_cache": rows[0]["tokens_per_second"] / rows[1]["tokens_per_second"] if len(rows) > 1 else None,
        "runs": rows,
        "environment": {"mindspore": ms.__version__, "numpy": np.__version__, "python": platform.python_version(),
                        "cpus": os.cpu_count(), "device": "CPU"},
    }
    print_table(result)
    write_results(result, args.output)
    return result


def print_table(result: dict) -> None:
    model = result["model"]
    print(f"{model['shape']} Qwen2 (hidden {model['hidden_size']}, {model['num_layers']} layers, vocab "
          f"{model['vocab_size']}), {result['sampling']}, "
          f"batch {result['batch']} "
          f"({result['batch'] // result['num_samples']} prompts x {result['num_samples']}), "
          f"{result['new_tokens']} new tokens, prompt bucket {result['runs'][0]['prompt_bucket']}, "
          f"cache length {result['cache_length']}")
    header = (f"{'mode':<10} {'tokens/s':>10} {'ms/step':>8} {'host %':>6} {'call s':>7} {'warm-up s':>9}  "
              f"{'compiles (prefill/decode/forward)':<34} {'first-call s':<20}")
    print(header)
    print("-" * len(header))
    for row in result["runs"]:
        c, g = row["compilations"], row["mindspore_compiled_graphs"]
        counts = f"{c['prefill']}/{c['decode']}/{c['forward']} (ms: {g['prefill']}/{g['decode']}/{g['forward']})"
        first = ", ".join(f"{k} {v:.2f}" for k, v in row["first_call_seconds"].items())
        mode = "kv cache" if row["use_kv_cache"] else "no cache"
        print(f"{mode:<10} {row['tokens_per_second']:>10.0f} {row['ms_per_step']:>8.2f} "
              f"{100 * row['host_share']:>6.1f} {row['seconds']:>7.3f} {row['warmup_seconds']:>9.2f}  "
              f"{counts:<34} {first:<20}")
    if len(result["runs"]) > 1:
        print(f"kv-cache speed-up x{result['speedup_kv_cache']:.2f}; same samples with and without cache: "
              f"{result['outputs_identical']}")
    print(f"numpy sampling (sample_tokens) {result['numpy_sampling_ms_per_step']:.2f} ms/step")


if __name__ == "__main__":
    main()
