"""The memory plan (`grpo_one_stage.py --plan`) against the peak RSS of real runs on this CPU, and the recompute terms
of `mindrlhf.engine.memory_budget` measured.

- `runs`: `bash run_grpo.sh` (`benchmarks/grpo_step.py`'s launcher set-up) on the bundled job (2 ranks) and on
  SmolLM2-135M's shape (2 ranks, dp=2, 16 held-out problems) without and with full recompute of the train net, and
  Qwen2.5-0.5B's shape on one rank (1-row calls, as `benchmarks/grpo_step.py --model 0.5b`); for
  each, the plan's per-rank peak (the largest rank's, every term: on CPU nothing offloads) vs the largest rank's
  peak RSS the trainer logs (`perf/max_rss_gib`). Target: within 15%.
- `recompute`: one GRPO train graph call at SmolLM2-135M's shape (4 responses of 192 tokens after 64-token prompts)
  in its own process per variant (`tests/workers/recompute_peak.py`): the step's peak RSS over the process's RSS
  before it, without recompute, every layer fully recomputed, every attention recomputed, half the layers fully
  recomputed, and 2 rows (the per-row slope); against `memory_budget.train_bytes` with the same arguments.
- `graphs`: the resident memory a compiled graph keeps per decoder layer, at SmolLM2-135M's shape
  (`tests/workers/graph_memory.py` at 2 and 4 layers, the difference halved): the response log-prob graph and the
  train step at several calls (rows, widths), each after a wider call set the memory pool's high water; against
  the plan's figure for the call (`memory_plan.GRAPH_MEMORY`, fitted on these calls).
- `recipes`: the plan (pure arithmetic, no run) of Qwen2.5-7B on 8 devices and a Qwen2.5-32B recipe on 16/32 (the
  table of `docs/memory_plan.md`).

    .venv/bin/python benchmarks/memory_plan.py                 # runs, recompute, recipes: ~25 min on 2 cores
    .venv/bin/python benchmarks/memory_plan.py --parts graphs  # ~4 min
    .venv/bin/python benchmarks/memory_plan.py --parts recipes # seconds

Writes `benchmarks/results/memory_plan.json`. RSS on this 2-core box is not disturbed by other jobs, the times are.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile

from repo_paths import ARITH, ROOT, RUN_GRPO, SMOLLM2, results_path
from results_io import write_results

TARGET = 0.15
# (granularity, layers recomputed (0 = all), rows, vocabulary, prompt width, response width)
RECOMPUTE_VARIANTS = (("off", 0, 4, 49152, 64, 192), ("off", 0, 2, 49152, 64, 192), ("full", 0, 4, 49152, 64, 192),
                      ("selective", 0, 4, 49152, 64, 192), ("full", 15, 4, 49152, 64, 192),
                      ("off", 0, 4, 1024, 64, 192), ("off", 0, 2, 1024, 64, 192), ("full", 0, 4, 1024, 64, 192),
                      ("selective", 0, 4, 1024, 64, 192), ("off", 0, 4, 1024, 192, 64), ("off", 0, 2, 1024, 192, 64))
WORKER = os.path.join(ROOT, "tests", "workers", "recompute_peak.py")
GRAPH_WORKER = os.path.join(ROOT, "tests", "workers", "graph_memory.py")
# [prompts, rows, prompt width, response width] per graph call, the widest first (it sets the pool's high water)
GRAPH_CALLS = {"forward": [[4, 64, 72, 96], [1, 4, 72, 256], [4, 32, 72, 96], [1, 8, 72, 96], [4, 32, 72, 32],
                           [2, 16, 72, 96], [1, 1, 72, 512], [1, 8, 72, 64], [1, 1, 72, 256], [1, 1, 72, 128]],
               "train": [[1, 8, 72, 512], [1, 1, 72, 344], [1, 8, 72, 32], [1, 1, 72, 176], [1, 4, 72, 64],
                         [1, 2, 72, 96]]}
GRAPH_DEPTHS = (2, 4)
GRPO = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "grpo_one_stage.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default="runs,recompute,recipes",
                   help="comma-separated: runs, recompute, recipes, graphs")
    p.add_argument("--cases", default="arith,smollm2,smollm2_recompute,0.5b",
                   help="runs: which jobs (0.5b: Qwen2.5-0.5B's shape on one rank, `benchmarks/grpo_step.py`'s)")
    p.add_argument("--reuse_runs", action="store_true",
                   help="runs: a case whose folder in --workdir has a metrics.jsonl is not run again (the plan is)")
    p.add_argument("--recompute_jsonl", default=None,
                   help="recompute: read the workers' JSON lines from this file instead of running them (a previous "
                        "run's, e.g. when other parts are re-run)")
    p.add_argument("--workdir", default=None, help="keeps the runs' outputs (default: a temporary folder)")
    p.add_argument("--output", default=results_path("memory_plan.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------- recompute: one train call per process
def _worker_json(script: str, args: list[str]) -> dict:
    """The JSON line a worker script prints last (it runs in its own process: ru_maxrss only grows)."""
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"error: {script} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _worker_line(granularity: str, layers: int, count: int, vocab: int, prompt: int, response: int) -> dict:
    return _worker_json(WORKER, ["--shape", "smollm2", "--rows", str(count), "--prompt", str(prompt), "--response",
                                 str(response), "--granularity", granularity, "--layers", str(layers),
                                 "--vocab", str(vocab)])


def recompute_part(from_jsonl: str | None = None) -> dict:
    """Each variant's measured step peak over its baseline vs `train_bytes` (GiB)."""
    from mindrlhf.engine import memory_budget

    if from_jsonl:
        with open(from_jsonl) as f:
            lines = [json.loads(line) for line in f if line.startswith("{")]
        measured = [{"vocab": 49152, **line} for line in lines]
    else:
        measured = [_worker_line(*variant) for variant in RECOMPUTE_VARIANTS]
    rows = []
    for got in measured:
        n, full = got["layers"], got["granularity"] == "full"
        estimate = memory_budget.train_bytes(got["rows"], got["rows"], got["prompt"], got["response"], hidden=576,
                                             intermediate=1536, heads=9, vocab=got["vocab"], layers=30,
                                             recomputed_layers=n if full else 0,
                                             selective_layers=n if got["granularity"] == "selective" else 0)
        rows.append({**got, "step_gib": round(got["after_gib"] - got["before_gib"], 3),
                     "train_bytes_gib": round(estimate / 2**30, 3)})
    print("\nrecompute, SmolLM2-135M shape (30 layers), one GRPO train call, GiB")
    print(f"{'variant':<14}{'vocab':>7}{'rows':>6}{'P + R':>10}{'before':>9}{'step peak - before':>20}"
          f"{'train_bytes':>13}")
    for r in rows:
        name = f"{r['granularity']} {r['layers'] or ''}".strip()
        print(f"{name:<14}{r['vocab']:>7}{r['rows']:>6}{str(r['prompt']) + ' + ' + str(r['response']):>10}"
              f"{r['before_gib']:>9.2f}{r['step_gib']:>20.2f}{r['train_bytes_gib']:>13.2f}")
    return {"variants": rows}


# ---------------------------------------------------------------- graphs: what a compiled graph keeps
def _graph_worker_line(kind: str, layers: int) -> dict:
    return _worker_json(GRAPH_WORKER, ["--kind", kind, "--layers", str(layers), "--calls",
                                       json.dumps(GRAPH_CALLS[kind])])


def graphs_part() -> dict:
    """Per kind and call after the first: MiB a compiled graph keeps per decoder layer, measured and planned
    (`memory_plan.forward_graph_bytes` / `train_graph_bytes` of one layer)."""
    from mindrlhf.engine.memory_plan import Call, NetShape, forward_graph_bytes, train_graph_bytes
    from mindrlhf.models.qwen2.config import Qwen2Config

    # one decoder layer of the shipped SmolLM2 YAML at the probe's vocabulary (graph_memory.py's default)
    smollm2 = NetShape.of(Qwen2Config.from_yaml(os.path.join(SMOLLM2, "train.yaml")))
    layer = dataclasses.replace(smollm2, layers=1, vocab=1024)
    planned = {"forward": forward_graph_bytes, "train": train_graph_bytes}
    shallow, deep = GRAPH_DEPTHS
    rows = []
    print(f"\ngraphs, SmolLM2-135M shape: MiB kept per decoder layer ({deep} vs {shallow} layers), after a wider call")
    print(f"{'graph':<9}{'prompts':>8}{'rows':>6}{'P + R':>11}{'tokens':>8}{'MiB per layer':>15}{'plan':>8}")
    for kind in GRAPH_CALLS:
        low, high = _graph_worker_line(kind, shallow), _graph_worker_line(kind, deep)
        for a, b in list(zip(low["calls"], high["calls"]))[1:]:
            call = Call(a["prompts"], a["rows"], a["prompt"], a["response"])
            per_layer = (b["kept_mib"] - a["kept_mib"]) / (deep - shallow)
            plan = planned[kind](layer, call) / 2**20
            rows.append({"kind": kind, **{k: a[k] for k in ("prompts", "rows", "prompt", "response")},
                         "tokens": call.tokens, "mib_per_layer": round(per_layer, 1), "plan_mib": round(plan, 1),
                         "kept_mib": {str(shallow): a["kept_mib"], str(deep): b["kept_mib"]}})
            print(f"{kind:<9}{a['prompts']:>8}{a['rows']:>6}{str(a['prompt']) + ' + ' + str(a['response']):>11}"
                  f"{call.tokens:>8}{per_layer:>15.1f}{plan:>8.1f}")
    return {"calls": rows}


# ---------------------------------------------------------------- runs: plan vs the peak RSS of real jobs
def _with_recompute(*paths: str) -> None:
    """The model YAMLs at `paths` with every decoder layer fully recomputed (in the train net; the job refuses train
    and infer YAMLs that differ in it, and a forward-only net is unaffected)."""
    import yaml

    for path in paths:
        with open(path) as f:
            doc = yaml.safe_load(f)
        doc["recompute_config"] = {"recompute": True}
        with open(path, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)


def _job(case: str, workdir: str) -> tuple[dict, list[str], str]:
    """(environment, run_grpo.sh flags, output folder) of a case, as `benchmarks/grpo_step.py` sets them up."""
    from grpo_step import launcher_env, parse_args

    model = next((m for m in ("smollm2", "0.5b") if case.startswith(m)), "arith")
    out = os.path.join(workdir, case)
    os.makedirs(out, exist_ok=True)
    args = parse_args(["--model", model, "--steps", "2", "--workdir", workdir])
    env, flags = launcher_env(args, out)
    # one response width: the graphs a run compiles do not depend on the lengths sampled (the plan counts every
    # width's graphs, as a long run compiles them)
    flags += ["--response_buckets", "1"]
    if case.endswith("_recompute"):
        _with_recompute(env["TRAIN_YAML"], env["INFER_YAML"])
    return env, flags, out


def _plan_flags(env: dict, flags: list[str], out: str) -> list[str]:
    """grpo_one_stage.py's flags of the run run_grpo.sh launched (its inputs are in `out`)."""
    heldout = os.path.join(out, "heldout.mindrecord")
    return ["--sft_path_train", env.get("TRAIN_YAML", os.path.join(ARITH, "train.yaml")),
            "--sft_path_infer", env.get("INFER_YAML", os.path.join(ARITH, "infer.yaml")),
            "--tokenizer_dir", env.get("TOKENIZER_DIR", os.path.join(ARITH, "policy")),
            "--mind_dataset_dir", os.path.join(out, "prompts.mindrecord"),
            "--config", os.path.join(ARITH, "grpo.yaml"),
            "--load_sft_checkpoint_train", os.path.join(out, "policy.ckpt"),
            *(["--eval_dataset_file", heldout] if env.get("EVAL_DATA") else []), *flags]


def _plan_peak(plan_flags: list[str]) -> tuple[float, str]:
    """(the largest rank's planned peak, GiB; the printed plan) of `grpo_one_stage.py --plan`."""
    proc = subprocess.run([sys.executable, GRPO, "--plan", *plan_flags], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"error: --plan failed:\n{proc.stderr[-2000:]}")
    peaks = [float(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("  peak: ")]
    return max(peaks), proc.stdout


def run_case(case: str, workdir: str, reuse: bool = False) -> dict:
    """One job: run_grpo.sh for 2 steps (unless `reuse` and it ran), then its plan; the largest rank's peak RSS vs
    the plan's."""
    env, flags, out = _job(case, workdir)
    ran = reuse and os.path.exists(os.path.join(out, "metrics.jsonl"))
    proc = None if ran else subprocess.run(["bash", RUN_GRPO, *flags], env=env, cwd=ROOT,
                                           capture_output=True, text=True)
    if proc is not None and proc.returncode:
        raise SystemExit(f"error: run_grpo.sh ({case}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    measured = max(r["perf/max_rss_gib"] for r in records if "perf/max_rss_gib" in r)
    phases = {k: v for k, v in records[-1].items() if k.startswith("memory/peak_gib_after_")}
    planned, table = _plan_peak(_plan_flags(env, flags, out))
    return {"case": case, "measured_gib": measured, "plan_gib": planned, "error": planned / measured - 1,
            "rank0_peaks_after_phase": phases, "plan": table}


def runs_part(cases: list[str], workdir: str, reuse: bool = False) -> dict:
    print(f"\nplan vs measured peak RSS per rank (largest rank, 2 steps, CPU), target within {TARGET:.0%}")
    print(f"{'case':<20}{'measured GiB':>14}{'plan GiB':>10}{'plan/measured-1':>17}", flush=True)
    rows = []
    for case in cases:
        r = run_case(case, workdir, reuse)
        rows.append(r)
        print(f"{r['case']:<20}{r['measured_gib']:>14.2f}{r['plan_gib']:>10.2f}{r['error']:>17.1%}", flush=True)
        with open(os.path.join(workdir, f"{case}.json"), "w") as f:  # kept if a later case fails
            json.dump(r, f, indent=1)
    return {"cases": rows}


# ---------------------------------------------------------------- recipes: the plan of 7B / 32B jobs, no run
QWEN7B_YAML = os.path.join(ROOT, "model_configs", "qwen2_5", "qwen2_5_7b.yaml")
QWEN32B = dict(hidden_size=5120, num_layers=64, num_heads=40, n_kv_heads=8, intermediate_size=27648,
               vocab_size=152064)
DEVICE_GIB = 64e9 / 2**30  # a "64 GB" device
# (name, model fields, train (dp, tp, pp, micro_batch_num), infer (dp, tp), weights dtype, recompute, ZeRO-1[,
# further flags: LoRA's])
LORA16 = ("--lora_rank", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear")
RECIPES = (
    ("7B as shipped (fp32 weights, 2 micro-batches)", {}, (1, 4, 2, 2), (2, 4), "float32", False, False),
    ("7B, 1 response per micro-batch", {}, (1, 4, 2, 64), (2, 4), "float32", False, False),
    ("7B, + bf16 weights", {}, (1, 4, 2, 64), (2, 4), "bfloat16", False, False),
    ("7B, + full recompute", {}, (1, 4, 2, 64), (2, 4), "bfloat16", True, False),
    ("7B, fp32 weights + full recompute", {}, (1, 4, 2, 64), (2, 4), "float32", True, False),
    ("7B, train dp2 x tp4 + ZeRO-1, fp32", {}, (2, 4, 1, 0), (2, 4), "float32", False, True),
    ("7B, train dp2 x tp4 + ZeRO-1 + recompute, fp32", {}, (2, 4, 1, 0), (2, 4), "float32", True, True),
    ("32B on 16, tp8 x pp2, bf16 + recompute", QWEN32B, (1, 8, 2, 64), (2, 8), "bfloat16", True, False),
    ("32B on 16, tp8 x pp2, fp32 + recompute", QWEN32B, (1, 8, 2, 64), (2, 8), "float32", True, False),
    ("32B on 32, dp2 x tp8 x pp2 + ZeRO-1, fp32 + recompute", QWEN32B, (2, 8, 2, 32), (4, 8), "float32", True, True),
    ("32B on 32, tp8 x pp4, fp32 + recompute", QWEN32B, (1, 8, 4, 64), (4, 8), "float32", True, False),
    ("7B on 4, tp4, LoRA r16, bf16 + recompute", {}, (1, 4, 1, 0), (1, 4), "bfloat16", True, False, LORA16),
    ("7B on 4, tp4, full, bf16 + recompute", {}, (1, 4, 1, 0), (1, 4), "bfloat16", True, False),
    ("32B on 8, tp8, LoRA r16, bf16 + recompute", QWEN32B, (1, 8, 1, 0), (1, 8), "bfloat16", True, False, LORA16),
    ("32B on 8, tp8, full, bf16 + recompute", QWEN32B, (1, 8, 1, 0), (1, 8), "bfloat16", True, False),
)
# the sequence lengths: the 7B YAMLs' seq_length 4096 as 2048 prompt + 2048 generated tokens; 8 prompts x 8 samples
# a step, one update per step
RECIPE_FLAGS = ["--prompt_buckets", "2048", "--max_new_tokens", "2048", "--num_generations", "8", "--batch_size", "8",
                "--mini_batch_size", "8", "--num_iterations", "1", "--log_prob_micro_batch_size_per_device", "1"]


def _recipe_yaml(path: str, model: dict, dtype: str, layout: tuple, recompute: bool, shard: bool) -> None:
    import yaml

    with open(QWEN7B_YAML) as f:
        doc = yaml.safe_load(f)
    doc["model"]["model_config"].update(model, param_init_type=dtype, compute_dtype="bfloat16")
    dp, tp, pp, micro = (*layout, 1, 1)[:4]
    doc["parallel_config"] = {"data_parallel": dp, "model_parallel": tp, "pipeline_stage": pp,
                              "micro_batch_num": micro or 1, "optimizer_shard": shard}
    if recompute:
        doc["recompute_config"] = {"recompute": True}
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)


def recipe_plan(recipe: tuple, workdir: str) -> dict:
    """The plan of one recipe on "ascend" devices (idle nets swapped to host), from `memory_report`."""
    from mindrlhf.cli.train import build_parser
    from mindrlhf.engine.memory_plan import GIB, verdict
    from mindrlhf.trainer.launch import load_config, load_job_tokenizer
    from mindrlhf.trainer.memory_report import job_memory
    from mindrlhf.trainer.plan import JobPlan

    name, model, train, infer, dtype, recompute, shard, *extra = recipe
    train_yaml, infer_yaml = os.path.join(workdir, "train.yaml"), os.path.join(workdir, "infer.yaml")
    _recipe_yaml(train_yaml, model, dtype, train, recompute, shard)
    # the same recompute_config in both (the plan compares the YAMLs; forward-only nets do not recompute)
    _recipe_yaml(infer_yaml, model, "bfloat16", infer, recompute, False)
    data = os.path.join(workdir, "prompts.mindrecord")
    open(data, "w").close()
    args = build_parser().parse_args(
        ["--sft_path_train", train_yaml, "--sft_path_infer", infer_yaml, "--mind_dataset_dir", data,
         "--tokenizer_dir", os.path.join(ARITH, "policy"), *RECIPE_FLAGS,
         "--micro_batch_size_per_device", "0" if train[2] > 1 else "1", *(extra[0] if extra else ())])
    from mindrlhf.configs.job import JobOptions

    job = JobOptions.from_args(args)
    config = load_config(job, args)
    world = train[0] * train[1] * train[2]
    plan = JobPlan.build(config, job, load_job_tokenizer(job), world, 0)
    ranks = job_memory(plan, device="ascend")
    worst = max(ranks, key=lambda r: r.peak_phase().peak)
    top = worst.peak_phase()
    return {"recipe": name, "devices": world, "peak_gib": round(top.peak / GIB, 1), "phase": top.phase,
            "rank": worst.ranks[0], "terms_gib": {t: round(b / GIB, 2) for t, b in top.terms.items()},
            "host_gib": round(top.host / GIB, 1), "verdict": verdict(ranks, DEVICE_GIB)}


def recipes_part(workdir: str) -> dict:
    rows = [recipe_plan(recipe, workdir) for recipe in RECIPES]
    print(f"\nrecipes on {DEVICE_GIB:.1f} GiB devices (Ascend: idle nets on host), prompt 2048 + 2048 new tokens, "
          "8 prompts x 8 samples")
    print("| recipe | devices | peak GiB/rank (phase) | weights | grads | moments | activations | KV cache | logits "
          "| fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["terms_gib"]
        print(f"| {r['recipe']} | {r['devices']} | {r['peak_gib']} ({r['phase']}) | {t['weights']} | "
              f"{t['gradients']} | {t['moments']} | {t['activations']} | {t['kv_cache']} | {t['logits']} | "
              f"{'yes' if r['verdict'].startswith('fits') else 'no'} |")
    return {"device_gib": DEVICE_GIB, "recipes": rows, "flags": RECIPE_FLAGS}


def main(argv=None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="memory_plan_")
    parts = args.parts.split(",")
    result = {"benchmark": "memory_plan", "machine": platform.machine(), "cpu_count": os.cpu_count()}
    if "recipes" in parts:
        result["recipes"] = recipes_part(workdir)
    if "recompute" in parts:
        result["recompute"] = recompute_part(args.recompute_jsonl)
    if "graphs" in parts:
        result["graphs"] = graphs_part()
    if "runs" in parts:
        result["runs"] = runs_part(args.cases.split(","), workdir, args.reuse_runs)
    result["load_average"] = os.getloadavg()
    write_results(result, args.output)
    return result


if __name__ == "__main__":
    main()
