"""mindrlhf's SFT (packed) and DPO stages vs TRL's `SFTTrainer` / `DPOTrainer` on SmolLM2-135M-Instruct: tokens/s
and peak memory, side by side in one run.

OURS is `MODEL=smollm2 ALGORITHM=sft|dpo bash run_grpo.sh` as a user runs it (fetch, convert, the stage's data from
the bundled problems, msrun, one worker using both cores as `model_configs/smollm2/train.yaml` lays it out), read
back from its `metrics.jsonl`. THEIRS is TRL (`benchmarks/trl_stage_side.py`, in `benchmarks/.venv-trl`) on the same
JSONL ours tokenised, the same model folder, batch, row length, learning rate and steps: as its users run it (`trl`:
its defaults on this CPU, bf16 autocast and gradient checkpointing) and in fp32 without checkpointing (`trl_fp32`).
SFT packs whole conversations best fit on both sides (TRL's `packing_strategy="bfd"`); DPO's reference log-probs
are computed once before the first step by ours (the precompute's seconds are added to ours' time) and with every
batch by TRL (its default). The first step of every run (compiles / warms up) is left out.

    .venv/bin/python benchmarks/stages_versus_trl.py                       # both stages, 6 steps, ~25 min
    .venv/bin/python benchmarks/stages_versus_trl.py --stages sft --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from repo_paths import ROOT, RUN_GRPO, SMOLLM2, SMOLLM2_MODEL_DIR, results_path
from results_io import format_columns, write_results
from versus_trl import DATA, TRL_REQUIREMENTS, _tail, ensure_trl_venv, run_theirs

SIDES = ("ours", "trl", "trl_fp32")
KIND = {"sft": "sft", "dpo": "pairwise"}
NOT_EQUAL = (
    "SFT loss: ours trains the assistant's tokens only; TRL the whole conversation (SmolLM2's chat template has no "
    "generation marks for TRL's assistant_only_loss). Every position is computed on both sides",
    "packed rows: the same best-fit-decreasing rule and row length; each side packs its own shuffled order",
    "DPO: ours computes the reference log-probs once before training, TRL with each batch (its default); ours "
    "reads a pair's prompt once for both answers, TRL twice (the tokens counted are the same: the prompt twice)",
    "memory: ours is the rank's peak RSS (msrun and its scheduler, which hold no model, left out); TRL's the "
    "process's",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="sft,dpo", help="comma-separated: sft, dpo")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated: {', '.join(SIDES)}")
    p.add_argument("--steps", type=int, default=6, help="optimizer updates per run (the first is left out)")
    p.add_argument("--batch_size", type=int, default=4, help="packed rows (SFT) or pairs (DPO) per update")
    p.add_argument("--max_length", type=int, default=512, help="tokens of a packed row (SFT), of a pair's row (DPO)")
    p.add_argument("--torch_threads", type=int, default=2, help="TRL side's torch threads")
    p.add_argument("--workdir", default=None, help="keeps the runs' output")
    p.add_argument("--output", default=None, help="default: benchmarks/results/stages_versus_trl.json")
    args = p.parse_args(argv)
    args.stages = [s for s in args.stages.split(",") if s]
    args.sides = [s for s in args.sides.split(",") if s]
    if set(args.stages) - set(KIND) or set(args.sides) - set(SIDES) or args.steps < 2:
        p.error("--stages of sft, dpo; --sides of ours, trl, trl_fp32; --steps >= 2")
    return args


def problems_file(workdir: str, stage: str, count: int) -> str:
    """The first `count` bundled problems, the data of `stage`'s runs."""
    path = os.path.join(workdir, f"problems_{stage}.jsonl")
    with open(DATA) as f:
        lines = f.readlines()[:count]
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def run_ours(stage: str, args, problems: str, out: str) -> dict:
    env = dict(os.environ, MODEL="smollm2", ALGORITHM=stage, DATA=problems, OUTPUT=out,
               MASTER_PORT=str(8600 + os.getpid() % 300))
    flags = ["--steps", str(args.steps), "--batch_size", str(args.batch_size), "--eval_fraction", "0",
             "--overwrite_output"]
    if stage == "sft":
        flags += ["--max_length", str(args.max_length)]
    start = time.perf_counter()
    log_path = os.path.join(out + ".log")
    with open(log_path, "w") as log:
        proc = subprocess.run(["bash", RUN_GRPO, *flags], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"error: run_grpo.sh failed ({proc.returncode}); log: {log_path}\n{_tail(log_path)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"timing/step"' in line]
    prepare_s = 0.0
    with open(os.path.join(out, "msrun_log", "worker_0.log"), errors="replace") as f:
        for line in f:
            if "reference log-probs of" in line:
                prepare_s = float(line.rsplit(" in ", 1)[1].split()[0])
    for line in steps:  # e2e_tps is per rank: the step's tokens over the ranks
        line["perf/tokens"] = line["e2e_tps"] * line["timing/step"]
    return {"wall_s": time.perf_counter() - start, "steps": steps, "prepare_s": prepare_s,
            "peak_rss_gib": max(line["perf/sum_rss_gib"] for line in steps), "flags": flags}


def summary(run: dict, steps: int) -> dict:
    """Tokens/s over steps 2.. (with ours' DPO precompute, its share of those steps), peak RSS, first step."""
    later = run["steps"][1:]
    seconds = sum(line["timing/step"] for line in later) + run.get("prepare_s", 0.0) * len(later) / steps
    tokens = sum(line["perf/tokens"] for line in later)
    return {"tokens_per_s": tokens / seconds, "tokens_per_step": tokens / len(later),
            "step_s": seconds / len(later), "first_step_s": run["steps"][0]["timing/step"],
            "prepare_s": run.get("prepare_s", 0.0), "peak_rss_gib": run["peak_rss_gib"], "wall_s": run["wall_s"]}


def ratio(ours: dict | None, side: dict, key: str) -> str:
    return f"{ours[key] / side[key]:.2f}" if ours is not None and ours is not side else "-"


def table(results: dict) -> str:
    rows = []
    for stage, sides in results.items():
        ours = sides.get("ours")
        for name, s in sides.items():
            rows.append([stage, name, f"{s['tokens_per_s']:.0f}", ratio(ours, s, "tokens_per_s"),
                         f"{s['peak_rss_gib']:.2f}", ratio(ours, s, "peak_rss_gib"), f"{s['step_s']:.2f}",
                         f"{s['first_step_s']:.1f}", f"{s['tokens_per_step']:.0f}"])
    return format_columns(["stage", "side", "tokens/s", "ours/side", "peak GiB", "ours/side", "step s",
                           "first step s", "tokens/step"], rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="stages_versus_trl_"))
    os.makedirs(workdir, exist_ok=True)
    load_before = os.getloadavg()
    python = ensure_trl_venv() if set(args.sides) - {"ours"} else None
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fetch_smollm2.py"), "--output_dir",
                    SMOLLM2_MODEL_DIR], check=True)
    runs: dict = {}
    results: dict = {}
    for stage in args.stages:
        runs[stage], results[stage] = {}, {}
        ours_out = os.path.join(workdir, f"ours_{stage}")
        # SFT: enough conversations for every packed row of the run; DPO: one epoch of exactly the pairs trained on
        problems = problems_file(workdir, stage, args.steps * args.batch_size * (4 if stage == "sft" else 1))
        for side in ["ours"] + [s for s in args.sides if s != "ours"]:
            if side == "ours":
                run = run_ours(stage, args, problems, ours_out)
            else:
                job = {"stage": stage, "side": side, "model_dir": SMOLLM2_MODEL_DIR, "steps": args.steps,
                       "data": os.path.join(ours_out, f"{KIND[stage]}.jsonl"), "batch_size": args.batch_size,
                       "max_length": args.max_length, "torch_threads": args.torch_threads, "seed": 0,
                       "learning_rate": 2e-5 if stage == "sft" else 1e-6, "beta": 0.1}
                job_path = os.path.join(workdir, f"{side}_{stage}_job.json")
                with open(job_path, "w") as f:
                    json.dump(job, f, indent=1)
                run = run_theirs(python, job_path, os.path.join(workdir, f"{side}_{stage}"), args.torch_threads,
                                 script="trl_stage_side.py")
            if side in args.sides:
                runs[stage][side] = run
                results[stage][side] = summary(run, args.steps)
                s = results[stage][side]
                print(f"  {stage} {side}: {s['tokens_per_s']:.0f} tokens/s, {s['peak_rss_gib']:.2f} GiB peak, "
                      f"first step {s['first_step_s']:.1f} s", flush=True)
    print(f"\nSmolLM2-135M-Instruct: mindrlhf (run_grpo.sh, 1 worker) vs TRL (1 process, {args.torch_threads} "
          f"threads; trl: bf16 autocast + gradient checkpointing, its defaults; trl_fp32); {args.batch_size} packed "
          f"rows of {args.max_length} tokens (SFT) / pairs (DPO) an update, steps 2..{args.steps}; load average "
          f"{load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(table(results))
    print("ours/side > 1 on tokens/s and < 1 on peak GiB: mindrlhf is ahead. Not equal between the sides:")
    for note in NOT_EQUAL:
        print(f"  - {note}")
    result = {"benchmark": "stages_versus_trl", "args": vars(args), "results": results, "runs": runs,
              "trl_requirements": list(TRL_REQUIREMENTS), "not_equal": list(NOT_EQUAL),
              "smollm2_configs": SMOLLM2, "environment": {"python": platform.python_version(),
                                                          "cpus": os.cpu_count(), "load_average_before": load_before}}
    write_results(result, args.output or results_path("stages_versus_trl.json"))
    return result


if __name__ == "__main__":
    main()
