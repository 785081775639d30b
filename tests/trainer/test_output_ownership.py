"""One run per output folder, as the job checks it (`grpo_one_stage.py --check_flags`, which run_grpo.sh runs before
its conversions; here `mindrlhf.cli.train.main` in this process): a rerun into a folder holding a run's
checkpoints or metrics is refused in one line saying what to do, --resume and --overwrite_output are accepted (the
real job deletes that run first: `claim_output` and `check_write_targets`, as `run_job` calls them), and a --resume
path that is no checkpoint is refused in seconds, not inside the job."""
import json
import time

import pytest
from support.jobs import base_args

from mindrlhf.cli import train
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.job import JobOptions
from mindrlhf.trainer.plan import check_write_targets, claim_output
from mindrlhf.utils import output_owner

RERUN = ("holds a run's checkpoints step_000001..step_000002 and metrics of 2 steps; --resume continues that run, "
         "--overwrite_output deletes its checkpoints, metrics.jsonl, completions.jsonl, TensorBoard events and "
         "progress.png first, or choose another --output_dir (run_grpo.sh: OUTPUT)")
INPUTS = ("policy.ckpt", "prompts.mindrecord", "msrun.out")  # what run_grpo.sh converted and logged


def earlier_run(out):
    """`out` as a 2-step run with a checkpoint every step leaves it, with run_grpo.sh's inputs beside."""
    for step in (1, 2):
        (out / "checkpoints" / f"step_{step:06d}" / "rank_0").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step:06d}" / "meta.json").write_text("{}")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in (0, 1, 2)))
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1.vm").write_text("")
    (out / "progress.png").write_bytes(b"\x89PNG")
    (out / "completions.jsonl").write_text(json.dumps({"step": 1, "completion": "x"}) + "\n")
    for name in INPUTS:
        (out / name).write_text("")
    return out


def contents(out) -> list[str]:
    return sorted(str(path.relative_to(out)) for path in out.rglob("*"))


def check_flags(mindrecord, out, capsys, *extra) -> tuple[int, str]:
    """--check_flags of the tiny job into `out`: (exit code, last stderr line)."""
    code = train.main(base_args(mindrecord, out) + ["--check_flags", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_a_rerun_is_refused_unless_it_resumes_or_overwrites(tmp_path, mindrecord, capsys):
    out = earlier_run(tmp_path / "out")
    before = contents(out)
    assert check_flags(mindrecord, out, capsys) == (2, f"error: {out}: {RERUN}")
    assert check_flags(mindrecord, out, capsys, "--resume") == (0, "")
    assert check_flags(mindrecord, out, capsys, "--overwrite_output") == (0, "")
    assert contents(out) == before  # the check touches nothing, and takes no lock
    code, line = check_flags(mindrecord, out, capsys, "--resume", "--overwrite_output")
    assert code == 2 and line == "error: --overwrite_output deletes the run --resume would continue; give one of them"
    # the checkpoints in a folder of their own
    ckpt = tmp_path / "ckpt"
    (out / "checkpoints").rename(ckpt)
    code, line = check_flags(mindrecord, out, capsys, "--save_ckpt_dir", str(ckpt))
    assert code == 2 and line.startswith(f"error: {out}: holds a run's checkpoints step_000001..step_000002 in "
                                         f"{ckpt} and metrics of 2 steps; "), line
    (out / "metrics.jsonl").unlink()
    code, line = check_flags(mindrecord, out, capsys, "--save_ckpt_dir", str(ckpt))
    assert code == 2 and line.startswith(f"error: {ckpt}: holds a run's checkpoints step_000001..step_000002; ")
    assert check_flags(mindrecord, tmp_path / "new", capsys) == (0, "")


def test_the_job_deletes_the_earlier_run_with_overwrite_output(tmp_path, mindrecord):
    """As `run_job` does before anything is written: the process that owns the output (here one process alone)
    takes the lock, then deletes the earlier run's checkpoints, metrics, event files and plot; msrun's other workers
    delete nothing (rank 0 does)."""
    out = earlier_run(tmp_path / "out")
    job = JobOptions(sft_path_train="t.yaml", sft_path_infer="i.yaml", mind_dataset_dir=str(mindrecord),
                     output_dir=str(out), tensorboard_dir=str(out / "tensorboard"), overwrite_output=True)
    before = contents(out)
    claim_output(job, {"MS_ROLE": "MS_WORKER", "MS_NODE_ID": "1"})
    check_write_targets(job)
    assert contents(out) == before
    claim_output(job, {})
    try:
        assert json.loads((out / "run.lock").read_text())["command"]  # this process's record
        check_write_targets(job)
        assert contents(out) == sorted(["checkpoints", "tensorboard", "run.lock", *INPUTS])
    finally:
        output_owner.release(str(out))
    with pytest.raises(ConfigError, match=rf"^{out}: holds a run's metrics of 1 step; --resume continues"):
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        check_write_targets(JobOptions(sft_path_train="t.yaml", sft_path_infer="i.yaml", mind_dataset_dir="d",
                                       output_dir=str(out)))


def test_a_resume_path_that_is_no_checkpoint_is_refused_by_the_flag_check(tmp_path, mindrecord, capsys):
    out = earlier_run(tmp_path / "out")
    cut_off = out / "checkpoints" / "step_000003"
    cut_off.mkdir()
    cases = {tmp_path / "nowhere": "no such folder (--resume takes a step_* folder written by the trainer, or auto)",
             cut_off: "not a complete checkpoint (no meta.json); expected a step_* folder written by the trainer"}
    for path, problem in cases.items():
        start = time.monotonic()
        assert check_flags(mindrecord, out, capsys, "--resume", str(path)) == (2, f"error: {path}: {problem}")
        assert time.monotonic() - start < 10
    step = out / "checkpoints" / "step_000002"
    assert check_flags(mindrecord, out, capsys, "--resume", str(step)) == (0, "")
    # auto in a folder without a checkpoint starts from step 0 (and the job says so)
    assert check_flags(mindrecord, tmp_path / "new", capsys, "--resume", "auto") == (0, "")
