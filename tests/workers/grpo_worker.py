"""Worker: the RL job (`mindrlhf.cli.train`, the tutorial's grpo_one_stage.py) with a callback that checks, after
every step on every rank, that the inference net holds exactly the train net's weights (its pipeline stage's, when
the train net has stages) and that each phase ran with its swap plan; writes rank_<r>.json."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import worker_setup

from mindrlhf.cli import train

RESULTS = {"steps": []}


def check_step(trainer, step, metrics):
    rank = trainer.rank
    actor = trainer.actor
    infer = {p.name: p for p in actor.infer_net.trainable_params()}
    mismatched = []
    stage_rank = rank % actor.train_layout.stage_size  # the train strategy is that of this rank's pipeline stage
    for param in actor.train_net.trainable_params():
        train_region = actor.train_strategy[param.name].slice_of(stage_rank)
        infer_region = actor.infer_strategy[actor.infer_prefix + param.name].slice_of(rank)
        assert all(i.start <= t.start and t.stop <= i.stop for t, i in zip(train_region, infer_region)), param.name
        relative = tuple(slice(t.start - i.start, t.stop - i.start) for t, i in zip(train_region, infer_region))
        if not np.array_equal(infer[actor.infer_prefix + param.name].asnumpy()[relative], param.asnumpy()):
            mismatched.append(param.name)
    plan_errors = []
    start = RESULTS.setdefault("plan_index", 0)
    for phase, resident in trainer.swap.phase_plan[start:]:
        expected = set(trainer.phases.resident[phase])
        if set(resident) != expected:
            plan_errors.append(f"{phase}: {sorted(resident)} != {sorted(expected)}")
    phases = [phase for phase, _ in trainer.swap.phase_plan[start:]]
    RESULTS["plan_index"] = len(trainer.swap.phase_plan)
    # every KV cache the rollout made is in the swap plan's group of them, nothing else is
    caches = actor.generator.graphs.caches.values()
    kv_params = {p.name for cache in caches for p in cache.parameters()}
    if {p.name for p in trainer.swap.params("kv_caches")} != kv_params or not kv_params:
        plan_errors.append(f"kv_caches: {len(trainer.swap.params('kv_caches'))} parameters != {len(kv_params)}")
    RESULTS["steps"].append({"step": step, "mismatched": mismatched, "plan_errors": plan_errors, "phases": phases,
                             "metrics": metrics})


def main():
    out = Path(os.environ["GRPO_WORKER_OUT"])
    code = train.main(sys.argv[1:], callbacks=[check_step])
    from mindspore.communication import get_rank
    rank = get_rank() if os.environ.get("MS_WORKER_NUM") else 0
    out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    (out / f"rank_{rank}.json").write_text(json.dumps({**RESULTS, "exit_code": code, "cores": cores}))
    return code


if __name__ == "__main__":
    worker_setup.run_worker_script(main)
