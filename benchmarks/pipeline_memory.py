"""Memory and time per rank of a GRPO train step with the train net whole (pp=1, 1 worker) vs in 2 pipeline stages
(pp=2, 2 workers), at Qwen2.5-0.5B's shape; with stages, on the 1F1B schedule and, as the baseline, one micro-batch
at a time (no overlap).

    .venv/bin/python benchmarks/pipeline_memory.py [--model 0.5b|tiny --rows 4 --prompt 64 --response 64
                                                    --micro_batches 2 --steps 3 --schedules 1f1b,sequential
                                                    --output benchmarks/results/pipeline_memory.json]

Each layout runs under msrun in its own processes, one after the other (so their memory never overlaps): a float32
Qwen2 with seeded random weights (0.5b: vocab 151936, hidden 896, 24 layers, 14/2 heads, intermediate 4864, tied
embeddings), AdamW, and `--steps` clipped updates of the GRPO loss on `--rows` responses (pp=1: one
`SPMDTrainStep`; pp=2: `PipelineTrainStep` over `--micro_batches`, once per schedule). Each process sets its CPU
kernel threads and keeps to its share of the cores as the trainer does. Per rank it reports the parameters and AdamW
moments it holds (bytes), the process's peak RSS after building the nets and after the steps (getrusage), the
gradient norm of every step (equal whatever the schedule) and the median step time after the first (which compiles).
With stages each rank should hold about half the layers' weights and moments; with tied embeddings both stages also
hold the embedding.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_io import format_columns, write_results

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, n_kv_heads=2,
                 intermediate_size=4864, theta=1000000.0, qkv_has_bias=True, tie_word_embeddings=True),
    "tiny": dict(vocab_size=96, hidden_size=32, num_layers=4, num_heads=4, n_kv_heads=2, intermediate_size=64,
                 theta=10000.0, qkv_has_bias=True, tie_word_embeddings=True),
}
GIB = 2 ** 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.5b", choices=sorted(MODELS))
    p.add_argument("--rows", type=int, default=4, help="responses per update")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--response", type=int, default=64, help="response tokens per row")
    p.add_argument("--micro_batches", type=int, default=2, help="micro-batches per update with stages")
    p.add_argument("--steps", type=int, default=3, help="updates (the first compiles and is not timed)")
    p.add_argument("--schedules", default="1f1b,sequential",
                   help="pipeline schedules to run pp=2 with, comma-separated (mindrlhf.parallel.schedule.SCHEDULES)")
    p.add_argument("--workdir", default=None, help="where the logs and per-rank reports go (default: a temp dir)")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "pipeline_memory.json"))
    p.add_argument("--timeout", type=float, default=1800, help="seconds a layout's msrun job may take before it "
                   "is stopped, workers included")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ------------------------------------------------------------------------------------------ worker
def child_main(args: argparse.Namespace) -> None:
    import mindspore as ms
    import numpy as np

    from mindrlhf.algorithms import GRPOLossCell, aggregation_weights
    from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseHidden
    from mindrlhf.engine.batches import prompt_micro_batches
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.optim import AdamW
    from mindrlhf.parallel.host_setup import configure_cpu_threads, pin_cpu_cores
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.pipeline import PipelineTrainStep
    from mindrlhf.parallel.spmd import SPMDTrainStep
    from mindrlhf.trainer.launch import start_communication

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    world, rank = start_communication()
    threads = configure_cpu_threads(0, world)
    cores = pin_cpu_cores("auto", world)
    layout = Layout.for_world(1, 1, world, rank, pp=args.pp).init_groups()
    seq = args.prompt + args.response
    cfg = Qwen2Config(**MODELS[args.model], seq_length=seq, max_position_embedding=seq)
    net = Qwen2ForCausalLM(cfg, layout)
    init_random_weights(net, layout, seed=0)
    optimizer = AdamW(net.trainable_params(), learning_rate=1e-6)
    loss_cell = GRPOLossCell(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, kl_estimator="k3")

    rng = np.random.default_rng(0)
    rows, response = args.rows, args.response
    response_mask = np.ones((rows, response), np.int32)
    arrays = [rng.integers(0, cfg.vocab_size, (rows, args.prompt)).astype(np.int32),
              np.ones((rows, args.prompt), np.int32),
              rng.integers(0, cfg.vocab_size, (rows, response)).astype(np.int32), response_mask,
              rng.normal(-12, 0.1, (rows, response)).astype(np.float32),
              rng.normal(-12, 0.1, (rows, response)).astype(np.float32),
              np.linspace(-1, 1, rows).astype(np.float32),
              aggregation_weights(response_mask, "token-mean").astype(np.float32)]
    if layout.pp > 1:
        stage_net = GRPOLossNet(net, loss_cell) if layout.stage == layout.pp - 1 else ResponseHidden(net)
        step = PipelineTrainStep(stage_net, optimizer, layout, lambda inputs: (inputs[0].shape[0], seq - 1,
                                                                               cfg.hidden_size),
                                 ms.float32, num_inputs=8, forward_inputs=4, num_outputs=len(GRPOLossNet.OUTPUTS),
                                 grad_reduction="sum", max_grad_norm=1.0, stage_shared=net.stage_shared_params,
                                 schedule=args.schedule)
        columns = dict(zip(GRPOLossNet.INPUTS, arrays))
        run = lambda: step(prompt_micro_batches(columns, rows // args.micro_batches or rows, 1))[1]
    else:
        step = SPMDTrainStep(GRPOLossNet(net, loss_cell), optimizer, layout, grad_reduction="sum", max_grad_norm=1.0)
        tensors = [ms.Tensor(a) for a in arrays]
        run = lambda: float(step(*tensors)[1].asnumpy())

    held = {"weights": sum(p.size * p.itemsize for p in net.trainable_params())}
    held["adam_moments"] = sum(p.size * p.itemsize for p in optimizer.get_parameters()) - held["weights"]
    built_peak = peak_rss_bytes()
    seconds, grad_norms = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        grad_norms.append(run())
        seconds.append(time.perf_counter() - start)
    report = {"rank": layout.rank, "pp": layout.pp, "stage": layout.stage, "kernel_threads": threads, "cores": cores,
              "grad_norms": grad_norms,
              "layers": list(net.model.owned_layers), "holds_embedding": net.model.tok_embeddings is not None,
              "parameters": sum(p.size for p in net.trainable_params()), "held_bytes": held,
              "peak_rss_after_build_bytes": built_peak, "peak_rss_bytes": peak_rss_bytes(),
              "first_step_seconds": seconds[0],
              "step_seconds_median": statistics.median(seconds[1:]) if len(seconds) > 1 else None}
    path = Path(args.workdir) / f"pp{layout.pp}_{args.schedule}_rank_{layout.rank}.json"
    path.write_text(json.dumps(report, indent=1))


# ------------------------------------------------------------------------------------------ launcher
def run_layout(args: argparse.Namespace, pp: int, workdir: Path, schedule: str = "1f1b") -> list[dict]:
    """One layout under msrun (`pp` workers, one per stage, the pipeline on `schedule`); each rank's report."""
    from mindrlhf.utils.jobs import msrun_command, msrun_env, run_job_command, worker_log_tails

    forwarded = ["--model", args.model, "--rows", str(args.rows), "--prompt", str(args.prompt), "--response",
                 str(args.response), "--micro_batches", str(args.micro_batches), "--steps", str(args.steps),
                 "--workdir", str(workdir), "--child", "--pp", str(pp), "--schedule", schedule]
    logs = workdir / f"logs_pp{pp}_{schedule}"
    cmd = msrun_command(Path(__file__).resolve(), forwarded, pp, logs)
    try:
        proc = run_job_command(cmd, msrun_env(), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"pp={pp}: msrun did not finish in {args.timeout} s (stopped); logs in {workdir}"
                         f"{worker_log_tails(logs, 30)}") from None
    if proc.returncode != 0:
        print(worker_log_tails(logs, 30), file=sys.stderr)
        raise SystemExit(f"pp={pp}: msrun failed ({proc.returncode}); logs in {workdir}")
    return [json.loads((workdir / f"pp{pp}_{schedule}_rank_{r}.json").read_text()) for r in range(pp)]


def print_table(result: dict) -> None:
    head = ("layout", "rank", "layers", "embedding", "weights GiB", "moments GiB", "peak RSS GiB (built / steps)",
            "step s")
    rows = []
    for name, ranks in result["layouts"].items():
        for r in ranks:
            layers = r["layers"]
            rows.append((name, r["rank"], f"{layers[0]}-{layers[-1]}", "yes" if r["holds_embedding"] else "no",
                         f"{r['held_bytes']['weights'] / GIB:.2f}", f"{r['held_bytes']['adam_moments'] / GIB:.2f}",
                         f"{r['peak_rss_after_build_bytes'] / GIB:.2f} / {r['peak_rss_bytes'] / GIB:.2f}",
                         "-" if r["step_seconds_median"] is None else f"{r['step_seconds_median']:.2f}"))
    s = result["settings"]
    print(f"GRPO train step, {s['model']} shape (float32, tied embeddings), {s['rows']} rows x "
          f"({s['prompt']} + {s['response']}) tokens, pp=2 over {s['micro_batches']} micro-batches")
    print(format_columns(head, rows))
    for key, value in result["ratios"].items():
        print(f"{key}: {value:.2f}")


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return None
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mindrlhf_pipeline_memory_"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    schedules = args.schedules.split(",")
    from mindrlhf.parallel.schedule import SCHEDULES
    unknown = sorted(set(schedules) - set(SCHEDULES))
    if unknown:
        raise SystemExit(f"--schedules: unknown {unknown}; expected some of {sorted(SCHEDULES)}")
    layouts = {"pp=1 (1 worker)": run_layout(args, 1, workdir)}
    for schedule in schedules:
        layouts[f"pp=2 {schedule} (2 workers)"] = run_layout(args, 2, workdir, schedule)
    whole, stages = layouts["pp=1 (1 worker)"][0], layouts[f"pp=2 {schedules[0]} (2 workers)"]
    ratios = {
        "largest stage's weights + moments / the whole net's": max(
            sum(r["held_bytes"].values()) for r in stages) / sum(whole["held_bytes"].values()),
        "largest stage's peak RSS / the whole net's": max(r["peak_rss_bytes"] for r in stages)
        / whole["peak_rss_bytes"],
    }
    for schedule in schedules[1:]:
        ratios[f"speed-up of {schedules[0]} over {schedule} (step time ratio)"] = (
            layouts[f"pp=2 {schedule} (2 workers)"][0]["step_seconds_median"] / stages[0]["step_seconds_median"]
            if args.steps > 1 else float("nan"))
    result = {"benchmark": "pipeline_memory", "settings": {k: v for k, v in vars(args).items()
                                                            if k not in ("child", "pp", "workdir", "output")},
              "config": MODELS[args.model], "layouts": layouts, "ratios": ratios,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "loadavg_after": os.getloadavg(),
                          "wall_seconds": round(time.perf_counter() - started, 1)}}
    print_table(result)
    write_results(result, args.output)
    return result


if __name__ == "__main__":
    main()
