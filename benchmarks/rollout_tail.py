"""A rollout's tail: the same rollouts with step-down ladders (`generation.min_decode_rows`, `step_down_ratio`) side
by side (interleaved in one process), on a real checkpoint and real prompts, with the EOS on: seconds, the decode rows
computed, the share of them computed for responses that had ended, the KV-cache rows and bytes the ladder holds, and
whether the responses are the same. Prints a table, writes JSON.

    .venv/bin/python benchmarks/rollout_tail.py --checkpoint output/smollm2_grpo/policy.ckpt \
        --prompts output/smollm2_grpo/prompts.mindrecord --new_tokens 256 --ladders 0 4 1:0.67 --rounds 3

(`MODEL=smollm2 bash run_grpo.sh` writes the checkpoint and the prompts.) Round r generates prompts 4r .. 4r + 3,
8 samples each, at seed r; the first round also compiles (its times are kept apart).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import mindspore as ms
import numpy as np
from repo_paths import SMOLLM2, results_path
from results_io import write_results

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.data.reader import read_prompt_records
from mindrlhf.engine.memory_plan import NetShape
from mindrlhf.generation import Generator
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--infer_yaml", default=os.path.join(SMOLLM2, "infer.yaml"))
    p.add_argument("--checkpoint", required=True, help="the policy's MindSpore checkpoint")
    p.add_argument("--prompts", required=True, help="a prompt MindRecord (rlhf_data.py: prompt_ids)")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--prompts_per_round", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--bucket", type=int, default=72, help="the prompt bucket")
    p.add_argument("--eos", type=int, nargs="+", default=[2], help="stop token ids (SmolLM2's <|im_end|>: 2)")
    p.add_argument("--ladders", type=ladder, nargs="+", default=[(0, 0.5), (4, 0.5)],
                   help="the ladders compared, each MIN_DECODE_ROWS or MIN_DECODE_ROWS:STEP_DOWN_RATIO (ratio 0.5 "
                        "when left out); 0 = no step-down")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--output", default=results_path("rollout_tail.json"))
    return p.parse_args(argv)


def ladder(spec: str) -> tuple[int, float]:
    """A `--ladders` value: "4" -> (4, 0.5), "1:0.67" -> (1, 0.67)."""
    rows, _, ratio = spec.partition(":")
    try:
        return int(rows), float(ratio or 0.5)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN_DECODE_ROWS[:STEP_DOWN_RATIO], e.g. 4 or 1:0.67, "
                                         f"got {spec!r}") from None


def read_prompts(path: str, count: int) -> list[list[int]]:
    """The first `count` prompts' token ids of a prompt MindRecord."""
    prompt_ids, _ = read_prompt_records(path)
    if len(prompt_ids) < count:
        raise SystemExit(f"error: {path}: {len(prompt_ids)} prompts, the rounds need {count}")
    return [np.asarray(ids).astype(int).tolist() for ids in prompt_ids[:count]]


def main(argv=None) -> dict:
    args = parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(args.infer_yaml))
    missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(args.checkpoint))
    if missing:
        raise SystemExit(f"error: {args.checkpoint}: no value for {len(missing)} of the network's parameters, e.g. "
                         f"{missing[0]} (a training checkpoint's rank_0/train.ckpt or run_grpo.sh's policy.ckpt)")
    prompts = read_prompts(args.prompts, args.rounds * args.prompts_per_round)

    def config(steps: tuple[int, float], seed: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=args.new_tokens, num_generations=args.num_generations,
                                temperature=args.temperature, prompt_buckets=[args.bucket], eos_token_ids=args.eos,
                                pad_token_id=args.eos[0], seed=seed, min_decode_rows=steps[0],
                                step_down_ratio=steps[1])  # validated as it is made

    generator = Generator(net, config(args.ladders[0], 0))
    runs = {steps: [] for steps in args.ladders}
    for r in range(args.rounds):
        batch = prompts[r * args.prompts_per_round:(r + 1) * args.prompts_per_round]
        order = args.ladders if r % 2 == 0 else args.ladders[::-1]
        for steps in order:
            generator.config = config(steps, r)
            start = time.perf_counter()
            out = generator.generate(batch)
            stats = out.stats
            runs[steps].append({"seconds": time.perf_counter() - start, "idle_row_share": stats["idle_row_share"],
                               "computed_rows": stats["computed_rows"], "steps": stats["steps"],
                               "mean_length": float(out.response_lengths.mean()),
                               "responses": out.response_ids.tolist()})
    rows = args.prompts_per_round * args.num_generations
    result = {"checkpoint": args.checkpoint, "new_tokens": args.new_tokens, "batch": rows,
              "temperature": args.temperature,
              "rows": [summary(config(steps, 0), NetShape.of(net.config), rows, rounds, runs[args.ladders[0]])
                       for steps, rounds in runs.items()],
              "environment": {"mindspore": ms.__version__, "python": platform.python_version(),
                              "cpus": os.cpu_count()}}
    print_table(result)
    write_results(result, args.output)
    return result


def summary(cfg: GenerationConfig, shape: NetShape, batch: int, rounds: list[dict], first: list[dict]) -> dict:
    """One ladder's figures for a batch of `batch` rows: seconds of the rounds after the first (which compiles), the
    KV-cache rows (and bytes) its row counts hold, and whether every round's responses equal those of the first
    ladder compared."""
    warm = rounds[1:] or rounds
    counts = cfg.decode_row_counts(batch)
    return {"min_decode_rows": cfg.min_decode_rows, "step_down_ratio": cfg.step_down_ratio, "row_counts": counts,
            "kv_cache_rows": sum(counts), "kv_cache_gib": shape.kv_cache_bytes(sum(counts), cfg.cache_length) / 2**30,
            "seconds": statistics.median(r["seconds"] for r in warm),
            "first_round_seconds": rounds[0]["seconds"],
            "idle_row_share": statistics.fmean(r["idle_row_share"] for r in rounds),
            "computed_rows": sum(r["computed_rows"] for r in rounds),
            "mean_length": statistics.fmean(r["mean_length"] for r in rounds),
            "same_responses": all(a["responses"] == b["responses"] for a, b in zip(rounds, first)),
            "rounds": [{k: v for k, v in r.items() if k != "responses"} for r in rounds]}


def print_table(result: dict) -> None:
    print(f"{result['batch']} rows, {result['new_tokens']} new tokens, temperature {result['temperature']}")
    header = f"{'ladder':>24} {'KV GiB':>7} {'s (warm)':>9} {'first s':>8} {'idle rows':>9} {'rows computed':>13} " \
             f"{'mean length':>11} {'same responses':>14}"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        print(f"{' '.join(map(str, row['row_counts'])):>24} {row['kv_cache_gib']:>7.3f} {row['seconds']:>9.2f} "
              f"{row['first_round_seconds']:>8.2f} {row['idle_row_share']:>9.3f} {row['computed_rows']:>13} "
              f"{row['mean_length']:>11.1f} {str(row['same_responses']):>14}")


if __name__ == "__main__":
    main()
