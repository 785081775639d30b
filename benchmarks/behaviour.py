"""Records the metrics of three short jobs and compares two recordings, metric by metric, so that a change that
should not alter behaviour (a refactor) can be shown not to:

    grpo      `bash run_grpo.sh --steps 6` (the bundled job: train dp=2, infer dp=2, held-out evaluation)
    grpo_one_update  `bash run_grpo.sh --steps 4 --mini_batch_size 8`: the bundled job with one update a step
    ppo       `ALGORITHM=ppo bash run_grpo.sh --steps 4` (critic, GAE)
    reshard   `bash run_grpo.sh --steps 4` with the train net in tensor parallel (tp=2) and the inference net in data
              parallel (dp=2): the online reshard after every update
    smollm2   `MODEL=smollm2 bash run_grpo.sh --steps 2` (a real model; recorded only when named in --jobs)

Usage (from the repository root, with the project's virtualenv):

    .venv/bin/python benchmarks/behaviour.py record --out /tmp/before      # on the old code
    .venv/bin/python benchmarks/behaviour.py record --out /tmp/after       # on the new code
    .venv/bin/python benchmarks/behaviour.py compare /tmp/before /tmp/after

`record` writes `<out>/<job>/metrics.jsonl` for each job; `compare` prints a table per job and exits 1 when any
non-timing metric of any step differs (timings, throughput and memory are left out: they vary from run to run).
`--root` records another checkout (e.g. `git worktree add /tmp/before HEAD~1`): its own run_grpo.sh makes its own
virtualenv on first use, and its code is what the workers import.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import write_results

from mindrlhf.trainer.metrics import MACHINE_METRICS

HERE = Path(__file__).resolve().parents[1]

JOBS = {
    "grpo": ({}, ["--steps", "6"]),
    "grpo_one_update": ({}, ["--steps", "4", "--mini_batch_size", "8"]),
    "ppo": ({"ALGORITHM": "ppo"}, ["--steps", "4"]),
    "reshard": ({"TRAIN_YAML": "{tp2_yaml}"}, ["--steps", "4"]),
    "smollm2": ({"MODEL": "smollm2"}, ["--steps", "2"]),
}
DEFAULT_JOBS = ("grpo", "grpo_one_update", "ppo", "reshard")  # smollm2 fetches a model first (run_grpo.sh)
VOLATILE_PREFIXES = MACHINE_METRICS  # they measure the machine, not the job


def tp2_train_yaml(root: Path, folder: Path) -> Path:
    """The bundled train YAML with its layout changed to tensor parallel 2 (one data-parallel rank)."""
    text = (root / "model_configs" / "arith" / "train.yaml").read_text(encoding="utf-8")
    text = text.replace("data_parallel: 2", "data_parallel: 1").replace("model_parallel: 1", "model_parallel: 2")
    path = folder / "train_tp2.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def record(root: Path, out: Path, jobs: list[str], port: int) -> None:
    """Runs each of `jobs` with `root`'s run_grpo.sh and copies its metrics.jsonl to `out/<job>/`."""
    with tempfile.TemporaryDirectory(prefix="behaviour-") as tmp:
        work = Path(tmp)
        values = {"tp2_yaml": str(tp2_train_yaml(root, work))}
        for name in jobs:
            env_extra, args = JOBS[name]
            env = dict(os.environ, OUTPUT=str(work / name), MASTER_PORT=str(port), GLOG_v="3",
                       PYTHONPATH=str(root))
            env.update({k: v.format(**values) for k, v in env_extra.items()})
            print(f"[behaviour] {name}: run_grpo.sh {' '.join(args)} ({root})", flush=True)
            proc = subprocess.run(["bash", str(root / "run_grpo.sh"), *args], env=env, cwd=root, check=False,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode:
                sys.exit(f"{name}: run_grpo.sh failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
            (out / name).mkdir(parents=True, exist_ok=True)
            shutil.copy(work / name / "metrics.jsonl", out / name / "metrics.jsonl")


def read_metrics(path: Path) -> dict[int, dict]:
    """step -> the non-volatile metrics of that step's line(s) of a metrics.jsonl."""
    steps: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        step = int(entry.pop("step"))
        kept = {k: v for k, v in entry.items() if not k.startswith(VOLATILE_PREFIXES)}
        steps.setdefault(step, {}).update(kept)
    return steps


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(before: dict[int, dict], after: dict[int, dict]) -> list[str]:
    """One line per metric (and step) present in only one recording or with another value."""
    lines = []
    for step in sorted(set(before) | set(after)):
        old, new = before.get(step, {}), after.get(step, {})
        for name in sorted(set(old) | set(new)):
            if name not in old or name not in new:
                lines.append(f"step {step} {name}: only in {'after' if name in new else 'before'}")
            elif not same(old[name], new[name]):
                lines.append(f"step {step} {name}: {old[name]!r} -> {new[name]!r}")
    return lines


def compare(before: Path, after: Path, results: Path) -> int:
    """Prints each job's comparison, writes them to `results` (JSON); 1 when anything differs."""
    failed, summary = 0, {"before": str(before), "after": str(after), "jobs": {}}
    for name in JOBS:
        paths = before / name / "metrics.jsonl", after / name / "metrics.jsonl"
        if not all(p.exists() for p in paths):
            print(f"{name}: not recorded in both")
            continue
        old, new = read_metrics(paths[0]), read_metrics(paths[1])
        diff = differences(old, new)
        count = sum(len(v) for v in old.values())
        print(f"{name}: {len(old)} steps, {count} non-timing values, {len(diff)} differ")
        for line in diff:
            print(f"  {line}")
        summary["jobs"][name] = {"steps": len(old), "values": count, "differences": diff}
        failed |= bool(diff)
    write_results(summary, str(results))
    return int(failed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run the jobs and keep their metrics.jsonl")
    rec.add_argument("--out", type=Path, required=True, help="folder for <job>/metrics.jsonl")
    rec.add_argument("--root", type=Path, default=HERE, help="the checkout whose code runs")
    rec.add_argument("--jobs", default=",".join(DEFAULT_JOBS), help="comma-separated, of: " + ", ".join(JOBS))
    rec.add_argument("--port", type=int, default=8171, help="msrun's master port")
    cmp_ = sub.add_parser("compare", help="compare two recordings")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    cmp_.add_argument("--results", type=Path, default=HERE / "benchmarks" / "results" / "behaviour.json")
    args = parser.parse_args()
    if args.command == "record":
        record(args.root.resolve(), args.out, args.jobs.split(","), args.port)
        return 0
    return compare(args.before, args.after, args.results)


if __name__ == "__main__":
    sys.exit(main())
