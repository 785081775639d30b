"""Online reshard vs the offline route (save -> transform_checkpoints -> load), train tp2 (or pp2) -> infer dp2.

    .venv/bin/python benchmarks/reshard.py [--src tp2|pp2 --models tiny,100m --dtypes float32,float16 --repeats 3
                                            --output benchmarks/results/reshard[_pp2].json]

Launches itself under msrun with 2 workers (CPU). On every rank a Qwen2 train net split tp=2 (float32), or in 2
pipeline stages with `--src pp2` (each rank one stage; the offline route reads the merged pipeline strategy), is
moved into an infer net of the other layout (dp=2: replicated) in the destination dtype:

- online: `Resharder.run()` (planned once; the first run compiles its graphs and is not timed);
- offline: each rank saves its checkpoint, rank 0 alone runs `mindspore.parallel.transform_checkpoints`
  with the two strategy files while the other ranks wait on a barrier (a tiny AllReduce), then each rank
  loads its destination checkpoint into the infer net (`load_param_into_net`, which casts).

Each route runs once to warm up, then `--repeats` times interleaved; a repetition is timed from a barrier
to a barrier, so it covers the slowest rank. Reported per case: median seconds (slowest rank), bytes moved
per rank (online: sent + received through collectives; offline: written + read on disk), peak RSS per
rank during the route (psutil sampling, plus getrusage when the route set the process's peak), the
speed-up, how long `Resharder(...)` construction (planning) and the first run (compilation) take, and
whether both routes give bit-identical weights. Next to them: bare AllGathers of the same bytes (tp2: one per split
parameter; pp2: each rank's stage, in bucket-sized messages), what the collectives alone cost on this machine. The
table is printed and everything goes to `--output`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from results_io import format_columns

from mindrlhf.utils.jobs import msrun_command, msrun_env, run_job_command, worker_log_tails

ROOT = Path(__file__).resolve().parents[1]
COMMON = dict(seq_length=64, max_position_embedding=64, theta=10000.0, qkv_has_bias=True, tie_word_embeddings=False)
MODELS = {
    # the tiny config of tests/workers/reshard_worker.py
    "tiny": dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, n_kv_heads=4, intermediate_size=64),
    # 101.7M parameters: Qwen2 shape (GQA 16/4 heads, SwiGLU) at hidden 2048, 2 layers, small vocabulary
    "100m": dict(vocab_size=8192, hidden_size=2048, num_layers=2, num_heads=16, n_kv_heads=4, intermediate_size=3840),
}
SOURCES = {"tp2": dict(dp=1, tp=2, pp=1), "pp2": dict(dp=1, tp=1, pp=2)}  # train layouts
DST_LAYOUT = (2, 1)  # (dp, tp): infer dp2
MIB = 2 ** 20


# ------------------------------------------------------------------------------------------ launcher
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,100m", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--dtypes", default="float32,float16", help="destination (infer) dtypes, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed repetitions per route after one warm-up")
    p.add_argument("--bucket-mib", type=int, default=None,
                   help="Resharder bucket bound in MiB (default: the library's)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where checkpoints and logs go (default: a temp dir, removed)")
    p.add_argument("--src", default="tp2", choices=sorted(SOURCES), help="the train (source) layout")
    p.add_argument("--output", default=None, help="default: benchmarks/results/reshard.json (tp2) or "
                                                 "reshard_<src>.json")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the msrun job may take before it is "
                   "stopped, workers included")
    p.add_argument("--msrun-child", action="store_true", help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    if args.output is None:
        name = "reshard.json" if args.src == "tp2" else f"reshard_{args.src}.json"
        args.output = str(ROOT / "benchmarks" / "results" / name)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}")
    return args


def launch(args) -> int:
    """Runs the workers under msrun, then merges their reports, prints the table and writes the JSON."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="mindrlhf_reshard_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    forwarded = ["--src", args.src, "--models", args.models, "--dtypes", args.dtypes, "--repeats", str(args.repeats),
                 "--workdir", str(workdir)] + (["--bucket-mib", str(args.bucket_mib)] if args.bucket_mib else [])
    cmd = msrun_command(Path(__file__).resolve(), ["--msrun-child", *forwarded], args.workers, workdir / "logs")
    load_before = os.getloadavg()
    started = time.perf_counter()
    try:
        proc = run_job_command(cmd, msrun_env(), timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{worker_log_tails(workdir / 'logs', 30)}\nmsrun did not finish in {args.timeout} s (stopped); logs "
              f"kept in {workdir}", file=sys.stderr)
        return 1
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], worker_log_tails(workdir / "logs", 30), file=sys.stderr)
        print(f"msrun failed ({proc.returncode}); logs kept in {workdir}", file=sys.stderr)
        return proc.returncode
    ranks = [json.loads((workdir / f"rank_{r}.json").read_text()) for r in range(args.workers)]
    result = merge(ranks, args)
    result["machine"].update(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                             wall_seconds=round(time.perf_counter() - started, 1))
    print_table(result)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.output}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def merge(ranks: list[dict], args) -> dict:
    """One entry per (model, dtype): per-rank numbers side by side, times as the slowest rank's median."""
    cases = []
    for per_rank in zip(*(r["cases"] for r in ranks)):
        first = per_rank[0]
        case = {k: first[k] for k in ("model", "config", "parameters", "dst_dtype")}
        for route in ("online", "offline"):
            case[route] = {
                "seconds_median": max(statistics.median(r[route]["seconds"]) for r in per_rank),
                "seconds_per_rank": [r[route]["seconds"] for r in per_rank],
                "bytes_moved_per_rank": [r[route]["bytes_moved"] for r in per_rank],
                "bytes_detail_per_rank": [r[route]["bytes_detail"] for r in per_rank],
                "peak_rss_mib_per_rank": [r[route]["peak_rss_mib"] for r in per_rank],
                "rss_before_mib_per_rank": [r[route]["rss_before_mib"] for r in per_rank],
                "extra_rss_mib_per_rank": [r[route]["extra_rss_mib"] for r in per_rank],
            }
        case["offline"]["phase_seconds_median_rank0"] = first["offline"]["phase_seconds_median"]
        case["speedup"] = case["offline"]["seconds_median"] / case["online"]["seconds_median"]
        case["plan_seconds"] = max(r["plan_seconds"] for r in per_rank)
        case["first_run_seconds"] = max(r["first_run_seconds"] for r in per_rank)
        case["online_rss_kept_after_first_run_mib_per_rank"] = [r["online_rss_kept_after_first_run_mib"]
                                                                 for r in per_rank]
        case["online_stats_rank0"] = first["online_stats"]
        case["bit_identical"] = all(r["bit_identical"] for r in per_rank)
        floors = [r["all_gather_floor_seconds"] for r in per_rank]
        case["all_gather_floor_seconds"] = None if None in floors else max(floors)
        cases.append(case)
    first = ranks[0]
    src = ", ".join(f"{k}={v}" for k, v in SOURCES[args.src].items())
    return {"benchmark": "reshard", "layout": {"src": f"{args.src} ({src})", "dst": "dp2 (dp=2, tp=1, replicated)"},
            "workers": args.workers, "repeats": args.repeats, "bucket_bytes": first["bucket_bytes"],
            "machine": dict(first["machine"]), "cases": cases}


def print_table(result: dict) -> None:
    head = ("model", "params", "dst", "route", "median s", "MiB moved/rank", "peak RSS MiB/rank (+during route)",
            "speed-up")
    rows = []
    for case in result["cases"]:
        for route in ("online", "offline"):
            r = case[route]
            n = case["parameters"]
            rows.append((case["model"], f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K", case["dst_dtype"], route,
                         f"{r['seconds_median']:.3f}",
                         " / ".join(f"{b / MIB:.1f}" for b in r["bytes_moved_per_rank"]),
                         " / ".join(f"{m:.0f} (+{x:.0f})" for m, x in zip(r["peak_rss_mib_per_rank"],
                                                                          r["extra_rss_mib_per_rank"])),
                         f"{case['speedup']:.1f}x" if route == "online" else ""))
    print(f"online reshard vs offline transform, {result['layout']['src']} -> {result['layout']['dst']}, "
          f"{result['workers']} workers, median of {result['repeats']} after a warm-up")
    print(format_columns(head, rows))
    print("\nonline: MiB sent + received through collectives; offline: MiB written + read on disk "
          "(rank 0 also runs the transform)")
    for case in result["cases"]:
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in case["offline"]["phase_seconds_median_rank0"].items())
        floor = case["all_gather_floor_seconds"]
        floor = f"; bare AllGathers of the same bytes {floor:.3f}s" if floor is not None else ""
        kept = "/".join(f"{m:.0f}" for m in case["online_rss_kept_after_first_run_mib_per_rank"])
        print(f"{case['model']} {case['dst_dtype']}: Resharder(...) planning {case['plan_seconds']:.3f}s, first run "
              f"(compiles) {case['first_run_seconds']:.2f}s and keeps +{kept} MiB resident{floor}\n"
              f"    offline phases (rank 0): {phases}; online == offline bit for bit: {case['bit_identical']}")


# ------------------------------------------------------------------------------------------ worker
class PeakRSS:
    """Peak resident set size of this process while the block runs, in MiB.

    psutil samples RSS every few milliseconds; if the block raised the process's lifetime peak
    (getrusage), that exact figure is used too.
    """

    def __init__(self, interval: float = 0.005):
        import psutil
        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.before = self.peak = 0

    def _sample(self):
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self):
        self.before = self.peak = self._process.memory_info().rss
        self._maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if maxrss > self._maxrss_before:
            self.peak = max(self.peak, maxrss * 1024)  # Linux reports KiB


def rss_now() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class Worker:
    """Everything one rank does; `run()` returns its report."""

    def __init__(self, args):
        import mindspore as ms
        from mindspore import Tensor, nn, ops

        from mindrlhf.trainer.launch import start_communication

        ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
        self.world, self.rank = start_communication()
        self.ms = ms
        self.args = args
        self.workdir = Path(args.workdir)
        from mindrlhf.parallel.reshard import DEFAULT_BUCKET_BYTES
        self.bucket_bytes = args.bucket_mib * MIB if args.bucket_mib else DEFAULT_BUCKET_BYTES

        class Barrier(nn.Cell):
            def __init__(self):
                super().__init__()
                self.all_reduce = ops.AllReduce()

            def construct(self, x):
                return self.all_reduce(x)

        barrier_cell, token = Barrier(), Tensor([1.0], ms.float32)
        self.barrier = lambda: barrier_cell(token).asnumpy()
        self.barrier()  # compiles

    def run(self) -> dict:
        import mindspore as ms

        from mindrlhf.parallel.layout import Layout

        src = SOURCES[self.args.src]
        src_layout = Layout.for_world(src["dp"], src["tp"], self.world, self.rank, pp=src["pp"]).init_groups()
        dst_layout = Layout.for_world(*DST_LAYOUT, self.world, self.rank).init_groups()
        cases = []
        for model in self.args.models.split(","):
            for dtype in self.args.dtypes.split(","):
                cases.append(self.case(model, dtype, src_layout, dst_layout))
                gc.collect()
        return {"rank": self.rank, "cases": cases, "bucket_bytes": self.bucket_bytes,
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version(), "mindspore": ms.__version__, "device_target": "CPU"}}

    def case(self, model: str, dtype: str, src_layout, dst_layout) -> dict:
        import numpy as np

        from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
        from mindrlhf.parallel.reshard import Resharder
        from mindrlhf.parallel.strategy import ParamLayout, net_layouts, write_strategy_file

        config = dict(COMMON, **MODELS[model])
        case_dir = self.workdir / f"{model}_{dtype}"
        src_net = Qwen2ForCausalLM(Qwen2Config(**config), src_layout)  # random init: a different shard per rank
        dst_net = Qwen2ForCausalLM(Qwen2Config(**config, compute_dtype=dtype, param_init_type=dtype), dst_layout)
        dst_net.update_parameters_name("infer.")
        src_layouts = net_layouts(src_net, src_layout)
        stage_layouts = None
        if src_layout.pp > 1:  # every stage's layouts; the offline route reads the merged pipeline strategy
            from mindrlhf.parallel.pipeline import gather_stage_layouts
            stage_layouts = gather_stage_layouts(src_layouts, {p.name: p.dtype for p in src_net.get_parameters()},
                                                 src_layout)
            src_strategy = write_strategy_file(case_dir / f"src_strategy_{self.rank}.ckpt", stage_layouts[0],
                                               stages=stage_layouts[1])
        else:
            src_strategy = write_strategy_file(case_dir / f"src_strategy_{self.rank}.ckpt", src_layouts)
        dst_layouts = net_layouts(dst_net, dst_layout)
        dst_strategy = write_strategy_file(case_dir / f"dst_strategy_{self.rank}.ckpt", dst_layouts)
        # transform_checkpoints needs the destination strategy under the checkpoint's (source) names
        plain = {n[len("infer."):]: ParamLayout(n[len("infer."):], lay.dev_matrix, lay.tensor_map)
                 for n, lay in dst_layouts.items()}
        dst_strategy_src_names = write_strategy_file(case_dir / f"dst_strategy_src_names_{self.rank}.ckpt", plain)
        name_map = {n[len("infer."):]: n for n in dst_layouts}
        self.barrier()

        rss_before_online = rss_now()
        start = time.perf_counter()
        resharder = Resharder(src_net, dst_net, src_layouts if stage_layouts else src_strategy, dst_strategy, name_map,
                              bucket_bytes=self.bucket_bytes, src_pipeline=src_layout, src_stage_layouts=stage_layouts)
        plan_seconds = time.perf_counter() - start
        start = time.perf_counter()
        stats = resharder.run()
        first_run_seconds = time.perf_counter() - start
        kept_after_first_run = rss_now() - rss_before_online  # compiled graphs + the memory pool they keep

        online = {"seconds": [], "peak": [], "before": []}
        offline = {"seconds": [], "peak": [], "before": [], "bytes": None, "phases": []}

        def online_once():
            nonlocal stats
            self.barrier()
            with PeakRSS() as rss:
                start = time.perf_counter()
                stats = resharder.run()
                self.barrier()
                seconds = time.perf_counter() - start
            return seconds, rss

        def offline_once(tag: str):
            rep_dir = case_dir / f"offline_{tag}"
            self.barrier()
            with PeakRSS() as rss:
                start = time.perf_counter()
                moved, phases = self.offline_route(src_net, dst_net, rep_dir, src_strategy, dst_strategy_src_names)
                self.barrier()
                seconds = time.perf_counter() - start
            self.barrier()
            if self.rank == 0:
                shutil.rmtree(rep_dir, ignore_errors=True)
            return seconds, rss, moved, phases

        online_once()
        offline_once("warmup")
        for rep in range(self.args.repeats):
            seconds, rss = online_once()
            online["seconds"].append(seconds)
            online["peak"].append(rss.peak)
            online["before"].append(rss.before)
            if rep == self.args.repeats - 1:  # keep the online result, then blank the net for the offline load
                after_online = {p.name: p.asnumpy().copy() for p in dst_net.get_parameters()}
                for p in dst_net.get_parameters():
                    p.set_data(self.ms.Tensor(np.zeros(p.shape, np.float32), p.dtype))
            seconds, rss, moved, phases = offline_once(str(rep))
            offline["seconds"].append(seconds)
            offline["peak"].append(rss.peak)
            offline["before"].append(rss.before)
            offline["bytes"] = moved
            offline["phases"].append(phases)
        identical = all(np.array_equal(p.asnumpy(), after_online[p.name]) for p in dst_net.get_parameters())
        floor = self.all_gather_floor(*self.floor_messages(src_net, stage_layouts, dtype, stats.bytes_sent)) \
            if stats.bytes_sent else None

        report = {
            "model": model, "config": config, "dst_dtype": dtype,
            "parameters": Qwen2Config(**config).num_parameters(),
            "plan_seconds": plan_seconds, "first_run_seconds": first_run_seconds,
            "online_rss_kept_after_first_run_mib": kept_after_first_run / MIB,
            "online_stats": {"parameters": stats.parameters, "local_copies": stats.local_copies,
                             "buckets": stats.buckets, "bytes_sent": stats.bytes_sent,
                             "bytes_received": stats.bytes_received},
            "online": {"seconds": online["seconds"], "bytes_moved": stats.bytes_sent + stats.bytes_received,
                       "bytes_detail": {"sent": stats.bytes_sent, "received": stats.bytes_received},
                       **self._rss(online)},
            "offline": {"seconds": offline["seconds"], "bytes_moved": sum(offline["bytes"].values()),
                        "bytes_detail": offline["bytes"], **self._rss(offline),
                        "phase_seconds_median": {k: statistics.median(p[k] for p in offline["phases"])
                                                 for k in offline["phases"][0]}},
            "bit_identical": bool(identical),
            "all_gather_floor_seconds": floor,
        }
        resharder = src_net = dst_net = after_online = None  # free before the next model (closures use them)
        return report

    def floor_messages(self, src_net, stage_layouts, dtype: str, nbytes: int) -> tuple[list[int], type]:
        """The messages (element counts) and wire dtype of bare AllGathers moving what the online route moves:
        one per split source parameter, `nbytes` per rank (tp); or each rank's pipeline stage, the largest
        stage's elements in bucket-sized messages, in the destination's dtype (float16) or float32 (pp)."""
        import numpy as np

        from mindrlhf.parallel.layers import param_split_axes

        if stage_layouts is None:
            axes = param_split_axes(src_net)
            sizes = [p.size for p in src_net.get_parameters() if axes[p.name] is not None]
            return sizes, {4: np.float32, 2: np.float16}[nbytes // sum(sizes)]
        layouts, stage_of, _ = stage_layouts
        largest = max(sum(int(np.prod(layouts[n].full_shape)) for n in layouts if stage_of[n] == stage)
                      for stage in set(stage_of.values()))
        wire = np.float16 if dtype == "float16" else np.float32
        chunk = self.bucket_bytes // np.dtype(wire).itemsize
        return [chunk] * (largest // chunk) + ([largest % chunk] if largest % chunk else []), wire

    def all_gather_floor(self, sizes: list[int], wire) -> float:
        """Median seconds of bare AllGathers of messages of `sizes` elements of `wire` per rank: what the
        collectives alone cost on this machine."""
        import numpy as np
        from mindspore import nn, ops

        class Gather(nn.Cell):
            def __init__(self):
                super().__init__()
                self.all_gather = ops.AllGather()

            def construct(self, x):
                return self.all_gather(x)

        messages = [self.ms.Tensor(np.ones(size, wire)) for size in sizes]
        gather = Gather()
        for message in messages:
            gather(message)  # compiles each shape
        times = []
        for _ in range(self.args.repeats):
            self.barrier()
            start = time.perf_counter()
            for message in messages:
                out = gather(message)
            out.asnumpy()
            self.barrier()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    @staticmethod
    def _rss(route: dict) -> dict:
        """Peak RSS over the repetitions, and the most any repetition added to what was resident before it."""
        return {"peak_rss_mib": max(route["peak"]) / MIB, "rss_before_mib": min(route["before"]) / MIB,
                "extra_rss_mib": max(p - b for p, b in zip(route["peak"], route["before"])) / MIB}

    def offline_route(self, src_net, dst_net, rep_dir: Path, src_strategy: str, dst_strategy: str):
        """save (every rank) -> transform (rank 0; the others wait) -> load (every rank).

        Returns the bytes this rank wrote and read on disk, and the seconds of each phase.
        """
        ms = self.ms
        moved = {"written": 0, "read": 0}
        phases = {}
        clock = time.perf_counter()

        def phase(name):
            nonlocal clock
            now = time.perf_counter()
            phases[name] = now - clock
            clock = now

        own = rep_dir / "src" / f"rank_{self.rank}" / "net.ckpt"
        own.parent.mkdir(parents=True, exist_ok=True)
        ms.save_checkpoint(src_net, str(own))
        moved["written"] += own.stat().st_size
        self.barrier()
        phase("save")
        if self.rank == 0:
            from mindspore.parallel import transform_checkpoints
            transform_checkpoints(str(rep_dir / "src"), str(rep_dir / "dst"), "net", src_strategy, dst_strategy)
            moved["read"] += dir_bytes(rep_dir / "src")
            moved["written"] += dir_bytes(rep_dir / "dst")
        self.barrier()
        phase("transform")
        rank_dir = rep_dir / "dst" / f"rank_{self.rank}"
        ckpt = rank_dir / sorted(os.listdir(rank_dir))[-1]
        moved["read"] += ckpt.stat().st_size
        state = {"infer." + name: value for name, value in ms.load_checkpoint(str(ckpt)).items()}
        # strict_load=False lets it cast float32 -> the net's dtype; every name must still match
        net_missing, ckpt_unused = ms.load_param_into_net(dst_net, state, strict_load=False)
        if net_missing or ckpt_unused:
            raise RuntimeError(f"offline route: names do not match: {net_missing[:5]} / {ckpt_unused[:5]}")
        phase("load")
        return moved, phases


def worker_main(args) -> None:
    worker = Worker(args)
    report = worker.run()
    path = Path(args.workdir) / f"rank_{worker.rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.msrun_child:
        worker_main(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
