"""Where a GRPO step's time goes: `bash run_grpo.sh` for a few steps, the per-phase split of each step.

Runs the user's launcher (`run_grpo.sh`: convert, prompts, msrun, `grpo_one_stage.py`) on one of two models and
reads `timing/*`, `e2e_tps` and `perf/max_rss_gib` from its `metrics.jsonl` (docs/metrics.md):

- `arith`: the bundled default (3.2M-parameter arithmetic policy, 8 prompts x 8 samples, train tp=2 / infer dp=2);
- `0.5b`: Qwen2.5-0.5B's shape with seeded random weights (`versus_hf.py`'s, converted by the launcher like a
  downloaded model), prompts from the arithmetic task, small batch (`--batch_size` prompts x 4 samples, 64 new
  tokens, every token generated since random weights rarely end), one worker by default (memory);
- `smollm2`: SmolLM2-135M's shape (Llama, vocab 49152, 30 layers, 9 heads: tp is impossible on 2 ranks, so
  train dp=2 / infer dp=2), seeded random weights, 2 prompts x 4 samples, 64 new tokens, 2 workers, the
  trainer's default micro-batch sizes and 16 held-out problems evaluated before and after (what a user runs): the
  memory per worker is the number to watch.

The first step also compiles the graphs, so the table shows it apart from the median of the later ones (with one
step, the median column is that step).

    .venv/bin/python benchmarks/grpo_step.py                       # arith, 4 steps, ~2 min
    .venv/bin/python benchmarks/grpo_step.py --model 0.5b --workdir /tmp/vhf    # 2 steps, ~10 min, ~22 GiB peak
    .venv/bin/python benchmarks/grpo_step.py --model smollm2 --workdir /tmp/vhf # 2 steps, 2 workers
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile

from repo_paths import ARITH, ROOT, RUN_GRPO, results_path
from results_io import write_results
from versus_hf import model_dir, prepare_model

from mindrlhf.trainer.phases import PHASES

STEP_PHASES = tuple(p for p in PHASES if p != "eval")  # evaluation is timed apart from the step
HELDOUT = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "data", "arithmetic_heldout.jsonl")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("arith", "0.5b", "smollm2"), default="arith")
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps; the first one also compiles (default: 4 for arith, 2 for 0.5b)")
    p.add_argument("--workers", type=int, default=None,
                   help="msrun workers (default: 1 for 0.5b, 2 otherwise)")
    p.add_argument("--batch_size", type=int, default=2, help="0.5b: prompts per step (4 samples each)")
    p.add_argument("--micro_batch_size", type=int, default=None,
                   help="micro_batch_size_per_device and log_prob_micro_batch_size_per_device (default: 1 for "
                        "0.5b, the trainer's default otherwise)")
    p.add_argument("--infer_dtype", choices=("float32", "float16"), default="float32",
                   help="0.5b: dtype of the inference and reference nets (float16 halves their memory)")
    p.add_argument("--train_layout", default=None, metavar="DPxTP",
                   help="arith: override the train YAML's layout, e.g. 1x2 (tp=2) or 2x1 (dp=2)")
    p.add_argument("--infer_layout", default=None, metavar="DPxTP", help="arith: same for the inference YAML")
    p.add_argument("--eval_problems", type=int, default=None,
                   help="held-out problems evaluated before the first and after the last step (default: 16 for "
                        "smollm2, as the run it stands for; 0 otherwise)")
    p.add_argument("--eval_batch_size", type=int, default=None,
                   help="eval.eval_batch_size (default: the YAML's, 0 = the rollout's rows, sharing its graphs)")
    p.add_argument("--workdir", default=None, help="keeps the converted 0.5B model and the run's output")
    p.add_argument("--output", default=None, help="default: benchmarks/results/grpo_step_<model>.json")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.model == "arith" else 2)
    args.workers = args.workers or (1 if args.model == "0.5b" else 2)
    if args.eval_problems is None:
        args.eval_problems = 16 if args.model == "smollm2" else 0
    if args.micro_batch_size is None and args.model == "0.5b":
        args.micro_batch_size = 1
    if args.steps < 1:
        p.error("--steps: at least 1")
    return args


def yaml_with_layout(model_yaml: str, path: str, data_parallel: int, model_parallel: int, seq_length: int,
                     dtype: str = "float32", recompute: bool = False) -> None:
    """A model YAML with its parallel_config replaced, seq_length/max_position_embedding and dtypes set (and every
    layer recomputed with `recompute`)."""
    import yaml

    with open(model_yaml) as f:
        doc = yaml.safe_load(f)
    doc["model"]["model_config"].update(seq_length=seq_length, max_position_embedding=seq_length,
                                        compute_dtype=dtype, param_init_type=dtype)
    doc["parallel_config"] = {"data_parallel": data_parallel, "model_parallel": model_parallel, "pipeline_stage": 1}
    if recompute:
        doc["recompute_config"] = {"recompute": True}
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)


def heldout_file(out: str, problems: int) -> str:
    """The first `problems` held-out arithmetic problems as a JSONL file in `out` ("" = no evaluation)."""
    if not problems:
        return ""
    with open(HELDOUT) as f:
        lines = f.readlines()[:problems]
    path = os.path.join(out, "heldout.jsonl")
    with open(path, "w") as f:
        f.writelines(lines)
    return path


def launcher_env(args: argparse.Namespace, out: str) -> tuple[dict, list[str]]:
    """Environment and extra flags for run_grpo.sh."""
    workers = args.workers
    env = dict(os.environ, OUTPUT=out, EVAL_DATA=heldout_file(out, args.eval_problems), WORKER_NUM=str(workers),
               LOCAL_WORKER_NUM=str(workers), MASTER_PORT=str(8200 + os.getpid() % 500))
    flags = ["--steps", str(args.steps), "--overwrite_output"]  # a rerun with the same --workdir replaces its run
    if args.eval_batch_size is not None:
        flags += ["--eval_batch_size", str(args.eval_batch_size)]
    if args.micro_batch_size is not None:
        flags += ["--micro_batch_size_per_device", str(args.micro_batch_size),
                  "--log_prob_micro_batch_size_per_device", str(args.micro_batch_size)]
    if args.model == "arith":
        for net, layout in (("train", args.train_layout), ("infer", args.infer_layout)):
            if layout:
                dp, tp = (int(x) for x in layout.split("x"))
                path = os.path.join(out, f"{net}.yaml")
                yaml_with_layout(os.path.join(ARITH, f"{net}.yaml"), path, dp, tp, 256)
                env[f"{net.upper()}_YAML"] = path
        return env, flags
    folder = model_dir(args.workdir, args.model)
    prepare_model(args.workdir, args.model)
    train, infer = os.path.join(out, "train.yaml"), os.path.join(out, "infer.yaml")
    if args.model == "0.5b":
        # 0.5B's 14 heads / 2 kv heads allow tp 1 or 2; every net tp=workers (an infer dp replica per rank
        # would hold whole copies of the infer and reference nets on each rank: 24 GiB is not enough)
        yaml_with_layout(os.path.join(folder, "model.yaml"), train, 1, workers, 512)
        yaml_with_layout(os.path.join(folder, "model.yaml"), infer, 1, workers, 512, args.infer_dtype)
        flags += ["--batch_size", str(args.batch_size), "--learning_rate", "1e-6"]
    else:
        # 9 heads / 3 kv heads: no tp on 2 ranks; both nets data parallel
        yaml_with_layout(os.path.join(folder, "model.yaml"), train, workers, 1, 512)
        yaml_with_layout(os.path.join(folder, "model.yaml"), infer, workers, 1, 512, args.infer_dtype)
        flags += ["--batch_size", "2", "--learning_rate", "1e-6"]
    env.update(MODEL_DIR=os.path.join(folder, "hf"), TOKENIZER_DIR=os.path.join(ARITH, "policy"),
               TRAIN_YAML=train, INFER_YAML=infer)
    flags += ["--num_generations", "4", "--max_new_tokens", "64", "--mini_batch_size", "0"]
    return env, flags


def later_steps(lines: list[dict]) -> list[dict]:
    """The steps after the first (which also compiles), or the first if it is the only one."""
    return lines[1:] or lines


def phase_table(lines: list[dict]) -> list[dict]:
    """Per phase: seconds of the first step, median of the later steps, share of the later steps' time."""
    later = later_steps(lines)
    step_median = statistics.median(line["timing/step"] for line in later)
    rows = []
    for phase in (*STEP_PHASES, "step"):
        key = f"timing/{phase}"
        if key not in lines[0]:
            continue
        median = statistics.median(line[key] for line in later)
        rows.append({"phase": phase, "first_s": lines[0][key], "median_s": median,
                     "share": median / step_median})
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_step_")
    out = os.path.join(args.workdir, f"grpo_step_{args.model}")
    os.makedirs(out, exist_ok=True)
    env, flags = launcher_env(args, out)
    proc = subprocess.run(["bash", RUN_GRPO, *flags], env=env, cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: run_grpo.sh failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    lines = [r for r in records if r["step"] > 0]  # step 0: the evaluation before the first step
    evals = [r["timing/eval"] for r in records if "timing/eval" in r]
    rows = phase_table(lines)
    later = later_steps(lines)
    summary = {"e2e_tps": statistics.median(line["e2e_tps"] for line in later),
               "max_rss_gib_per_rank": max(line["perf/max_rss_gib"] for line in lines),
               "response_tokens_mean": statistics.median(line["response_length/mean"] for line in later),
               "eval_problems": args.eval_problems, "eval_seconds": evals}
    over = f"the other {len(later)}" if len(lines) > 1 else "the first, compiles included"
    print(f"GRPO step, model {args.model}, {args.workers} worker(s), {len(lines)} step(s) (the first also "
          f"compiles; median of {over})")
    print(f"{'phase':<10}{'first s':>10}{'median s':>10}{'share':>8}")
    for row in rows:
        print(f"{row['phase']:<10}{row['first_s']:>10.3f}{row['median_s']:>10.3f}{row['share']:>8.1%}")
    print(f"e2e_tps {summary['e2e_tps']:.1f} tokens/s/device; peak RSS of the largest rank "
          f"{summary['max_rss_gib_per_rank']:.2f} GiB; mean response {summary['response_tokens_mean']:.1f} tokens")
    if evals:
        print(f"held-out evaluation of {args.eval_problems} problems: " + ", ".join(f"{s:.1f} s" for s in evals))
    result = {"benchmark": "grpo_step", "model": args.model, "workers": args.workers, "flags": flags,
              "phases": rows, **summary, "steps": lines, "machine": platform.machine(),
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    write_results(result, args.output or results_path(f"grpo_step_{args.model}.json"))
    return result


if __name__ == "__main__":
    main()
