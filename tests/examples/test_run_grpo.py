"""`bash run_grpo.sh`, the README's first command, shortened: the bundled policy through the converter, the data
tool and msrun (train dp=2, infer dp=2); the reward rises, the run ends with the held-out accuracy line, and its
checkpoint converts back to a Hugging Face folder that `transformers` loads and that answers like the policy; the
script owns its job (a signal stops every process of it, in one line) and a resumed job continues exactly."""
import json
import os
import re
import shutil
import signal
import sys
import time
import uuid

import mindspore as ms
import numpy as np
import pytest
import torch
from support.jobs import started_job
from support.msrun import free_port, run_command
from support.paths import ARITH, README, RUN_GRPO, TOOLS, TUTORIAL_DATA
from support.policies import greedy_completions
from support.processes import described, tagged_processes
from transformers import AutoModelForCausalLM, AutoTokenizer

from mindrlhf.checkpoint.step import complete_checkpoints
from mindrlhf.checkpoint.weights import read_weights
from mindrlhf.data.mindrecord import read_problems
from mindrlhf.data.templates import build_prompt
from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from mindrlhf.models.tokenizer import load_tokenizer

HELDOUT = TUTORIAL_DATA / "arithmetic_heldout.jsonl"
pytestmark = pytest.mark.msrun

STEPS = 10
SAVED = STEPS // 2  # the straight run's first checkpoint
PPO_STEPS = 6  # its held-out gain is the 10 steps' (+18.0 and +17.5 points, 2026-12-04)
JOB_TAG = "MINDRLHF_TEST_JOB"  # every process of one launch inherits it


def readme_reward_example() -> tuple[str, list[str]]:
    """The README's "Your own reward function": the module's code and run_grpo.sh's flags, read from the README
    itself, so that the run below is exactly what it shows (every worker imports the module through PYTHONPATH)."""
    text = README.read_text()
    section = text[text.index("## Your own reward function"):]
    code = re.search(r"```python\n# my_rewards.py[^\n]*\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\nPYTHONPATH=\S+ bash run_grpo.sh (.*?)\n```", section, re.S).group(1)
    return code, command.replace("\\\n", " ").split()


MY_REWARDS, REWARD_FLAGS = readme_reward_example()
STRAIGHT_FLAGS = ["--steps", str(STEPS), "--eval_interval", "0", *REWARD_FLAGS]


def job_env(out, **extra) -> dict:
    """The environment of a run_grpo.sh launch into `out` (a free port, MindSpore's errors only), with `extra`."""
    return dict(os.environ, OUTPUT=str(out), MASTER_PORT=str(free_port()), GLOG_v="3", **extra)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The straight run: (its OUTPUT, its stdout, its master port, the folder of the README's reward module)."""
    out = tmp_path_factory.mktemp("grpo") / "out"
    rewards = tmp_path_factory.mktemp("my_rewards")
    (rewards / "my_rewards.py").write_text(MY_REWARDS)
    env = job_env(out, PYTHONPATH=str(rewards))
    proc = run_command(["bash", str(RUN_GRPO), *STRAIGHT_FLAGS, "--save_interval", str(SAVED)], env,
                       timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, int(env["MASTER_PORT"]), rewards


def stop_when(cmd, env, log, ready, stop) -> tuple[int, str, float]:
    """Launches `cmd` with its output into the file `log`; once `ready()`, `stop(pid)` signals the script; returns
    (its exit code, its output, the seconds it took to end), after checking no process of the launch is left."""
    tag = uuid.uuid4().hex
    with started_job(cmd, log, dict(env, **{JOB_TAG: tag})) as job:
        deadline = time.time() + 600
        while not ready():
            assert job.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        dispositions = signal_dispositions(job.pid)
        stopped_at = time.time()
        stop(job.pid)
        code = job.wait(timeout=120)
        took = time.time() - stopped_at
        time.sleep(1.0)
        left = [described(p) for p in tagged_processes(JOB_TAG, tag)]
        assert left == [], f"processes of the stopped job still running: {left}"
    return code, f"{log.read_text(errors='replace')}\n[the script's signals when stopped: {dispositions}]", took


def signal_dispositions(pid: int) -> str:
    """The SigBlk / SigIgn / SigCgt masks of process `pid` (what it blocks, ignores and catches), for a failure
    message."""
    with open(f"/proc/{pid}/status") as status:
        return " ".join(line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


def metrics_of_step(path, step: int) -> dict | None:
    """The complete JSONL line of `step` in `path`, if written yet."""
    if not path.is_file():
        return None
    lines = [line for line in path.read_text().split("\n")[:-1] if line.strip()]  # the last one may be unfinished
    return next((record for record in map(json.loads, lines) if record["step"] == step), None)


def test_a_resumed_job_continues_exactly_and_a_signal_stops_the_whole_job(run, tmp_path):
    """A run with --resume from the straight run's first checkpoint (step 5), the job's own settings (lr warmup over
    the first 5 updates, num_iterations 1, 4 updates a step, the inference net the train net),
    gives the straight run's next step, every metric bit for bit (each graph once kept the learning rate of its
    first call, so a resumed run, compiling anew, updated with other rates). `kill <pid>` (SIGTERM to the script
    alone: msrun and each worker are in other process groups) then stops it, workers included, with one line and
    exit 143; the checkpoint it wrote resumes, and Ctrl-C (SIGINT to the script's process group) stops that run
    with exit 130; the first run's logs are kept."""
    from support.jobs import without_timing

    straight_out, _, _, rewards = run
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(parents=True)
    saved, resumed = f"step_{SAVED:06d}", SAVED + 1
    shutil.copytree(straight_out / "checkpoints" / saved, checkpoints / saved)
    env = job_env(out, PYTHONPATH=str(rewards), EVAL_DATA="")
    cmd = ["bash", RUN_GRPO, *STRAIGHT_FLAGS, "--save_interval", "1", "--keep_last", "3", "--resume"]
    code, output, took = stop_when(cmd, env, tmp_path / "first.out",
                                   lambda: len(complete_checkpoints(str(checkpoints))) > 1
                                   and metrics_of_step(out / "metrics.jsonl", resumed) is not None,
                                   lambda pid: os.kill(pid, signal.SIGTERM))
    assert code == 143 and took < 60, (code, took, output[-3000:])
    assert "run_grpo.sh: stopped by SIGTERM; stopping msrun and its workers" in output, output[-3000:]
    log = (out / "msrun_log" / "worker_0.log").read_text(errors="replace")
    assert f"resumed from {checkpoints / saved} (step {SAVED})" in log
    expected = without_timing(metrics_of_step(straight_out / "metrics.jsonl", resumed))
    assert expected["actor/ppo_kl"] != 0.0 and expected["actor/lr"] > 0
    assert without_timing(metrics_of_step(out / "metrics.jsonl", resumed)) == expected
    last = complete_checkpoints(str(checkpoints))[-1]
    step = json.loads((checkpoints / os.path.basename(last) / "meta.json").read_text())["step"]
    assert step >= resumed

    log_path = out / "msrun_log" / "worker_0.log"
    code, output, took = stop_when(
        cmd, dict(env, MASTER_PORT=str(free_port())), tmp_path / "second.out",
        lambda: log_path.is_file() and f"resumed from {last} (step {step})" in log_path.read_text(errors="replace"),
        lambda pid: os.killpg(pid, signal.SIGINT))
    assert code == 130 and took < 60, (code, took, output[-3000:])
    assert "run_grpo.sh: stopped by SIGINT" in output, output[-3000:]
    # the first run's logs were kept, renamed after their time
    assert len(list(out.glob("msrun_log.*"))) == 1 and len(list(out.glob("msrun.out.*"))) == 1
    assert f"step {resumed}/{STEPS}" in next(out.glob("msrun.out.*")).read_text(errors="replace")


def test_a_checkpoint_damaged_on_one_rank_ends_the_job_at_once_in_its_own_words(run, tmp_path):
    """The straight run's first checkpoint with rank 1's file cut short, resumed through run_grpo.sh: rank 1 cannot
    read it, rank 0 can; the ranks agree on the outcome after reading, so both leave at once, each with one line
    (without the agreement rank 0 went on into the first step's collectives and the job ended in MindSpore's
    scheduler's heartbeat timeout, with a C++ stack). The console shows the workers' lines and the closing summary,
    not msrun's own traceback or MindSpore's INFO lines at exit (msrun.out keeps them)."""
    straight_out, _, _, rewards = run
    out = tmp_path / "out"
    step = out / "checkpoints" / f"step_{SAVED:06d}"
    shutil.copytree(straight_out / "checkpoints" / step.name, step)
    damaged = step / "rank_1" / "train.ckpt"
    with open(damaged, "r+b") as f:
        f.truncate(1000)
    proc = run_command(["bash", RUN_GRPO, *STRAIGHT_FLAGS, "--resume"],
                       job_env(out, PYTHONPATH=str(rewards), EVAL_DATA=""), timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stderr[proc.stderr.index("run_grpo.sh: the job failed (exit 1)"):]
    assert f"error: rank 1: {damaged}: not a readable MindSpore checkpoint" in summary, summary
    assert f"error: rank 0: stopped at reading {step}: rank 1 failed there (its error line says why)" in summary, \
        summary
    console = proc.stdout + proc.stderr
    for noise in ("Traceback", "C++ Call Stack", "[INFO] DISTRIBUTED"):
        assert noise not in console, console[-3000:]
    msrun_out = (out / "msrun.out").read_text(errors="replace")
    assert "RuntimeError: Distributed job exited with exception" in msrun_out, msrun_out[-3000:]
    scheduler = (out / "msrun_log" / "scheduler.log").read_text(errors="replace")
    assert "timed out" not in scheduler and "abnormal" not in scheduler, scheduler[-3000:]


def test_default_run_learns_and_ends_with_the_accuracy_line(run):
    out, stdout, run_port, _ = run
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"held-out accuracy: before=\d+\.\d% after=\d+\.\d%", last), last
    for step in (1, STEPS):  # each step line shown once (live from msrun, not repeated from the worker log)
        assert len(re.findall(rf"step {step}/{STEPS} \|", stdout)) == 1, stdout[-3000:]

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    # the sampled reward is noisy with 8 prompts a step; the greedy held-out accuracy (200 problems) is not
    for r in steps:  # the user's function ran on every worker, weighted as given (its 48-token answers are short)
        assert r["reward/my_rewards:brevity"] == 1.0
        assert r["critic/score/mean"] == pytest.approx(r["reward/accuracy"] + 0.5 * r["reward/format"] + 0.2, abs=1e-5)
    rewards = np.array([r["critic/score/mean"] for r in steps])
    assert rewards[STEPS // 2:].mean() > rewards[:STEPS // 2].mean(), rewards
    before, after = records[0]["eval/accuracy"], steps[-1]["eval/accuracy"]
    # the held-out answers are scored by each rule reward of the job too (grpo.yaml: accuracy, format)
    assert {k for k in records[0] if k.startswith("eval/")} == {"eval/accuracy", "eval/format"}
    assert 0 <= records[0]["eval/format"] <= 1 and 0 <= steps[-1]["eval/format"] <= 1
    assert after >= before + 0.08, (before, after)
    assert records[0]["step"] == 0 and last == f"held-out accuracy: before={100 * before:.1f}% after={100 * after:.1f}%"
    assert (out / "progress.png").read_bytes()[:4] == b"\x89PNG"
    # the held-out evaluation runs the rollout's KV cache and compiled graphs (eval_batch_size 0): one cache a rank
    for rank in (0, 1):
        log = (out / "msrun_log" / f"worker_{rank}.log").read_text()
        assert re.findall(r"allocated KV cache batch=(\d+)", log) == ["32"], rank
        # both nets dp=2 with the same model: one set of weights, nothing to reshard
        assert "the inference net uses the train net's weights" in log, rank
        # both ranks on this host: the gradient sums go through shared memory (none of its files left behind)
        assert "data-parallel gradient sums through shared memory" in log, rank
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"mindrlhf-127.0.0.1-{run_port}-")]
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_trained_checkpoint_reverses_to_a_transformers_model_that_answers_alike(run, graph_mode, tmp_path):
    out, _, _, _ = run
    step_dir = out / "checkpoints" / f"step_{STEPS:06d}"
    hf_dir = tmp_path / "hf"
    done = run_command([sys.executable, TOOLS / "convert_weight.py", "--reverse", "--mindspore_ckpt_path", step_dir,
                        "--config_path", ARITH / "train.yaml", "--torch_ckpt_dir", hf_dir, "--tokenizer_dir",
                        ARITH / "policy"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    problems = list(read_problems(HELDOUT))[:16]
    model = Qwen2ForCausalLM(Qwen2Config.from_yaml(ARITH / "train.yaml"))
    ms.load_param_into_net(model, {k: ms.Parameter(v, name=k) for k, v in read_weights(str(step_dir)).items()},
                           strict_load=True)
    tokenizer = load_tokenizer(ARITH / "policy")
    ours = greedy_completions(model, tokenizer, problems, 48)

    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    theirs = []
    for problem in problems:
        ids = hf_tokenizer(build_prompt(problem.question, "r1_think"), return_tensors="pt").input_ids
        assert ids[0].tolist() == tokenizer.encode(build_prompt(problem.question, "r1_think"))
        with torch.no_grad():
            generated = hf_model.generate(ids, max_new_tokens=48, do_sample=False,
                                          eos_token_id=tokenizer.stop_token_ids, pad_token_id=tokenizer.pad_token_id)
        theirs.append(hf_tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True))
    assert theirs == ours
    # the checkpoint holds the trained weights, not the bundled ones: every matrix moved
    from mindrlhf.models.qwen2.convert import hf_to_ms_state_dict, read_hf_state_dict

    bundled = hf_to_ms_state_dict(read_hf_state_dict(ARITH / "policy"), Qwen2Config.from_yaml(ARITH / "train.yaml"))
    trained = read_weights(str(step_dir))
    assert bundled.keys() == trained.keys()
    moved = [name for name, value in bundled.items() if value.ndim == 2 and not np.array_equal(value, trained[name])]
    assert moved == [name for name, value in bundled.items() if value.ndim == 2], moved


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """`ALGORITHM=ppo bash run_grpo.sh`, PPO_STEPS steps: its OUTPUT. (PPO's exact resume, critic included, is
    tests/trainer/test_grpo_trainer.py's `test_ppo_on_two_workers_with_a_tensor_parallel_critic_resumes_exactly`.)"""
    out = tmp_path_factory.mktemp("ppo") / "ppo"
    proc = run_command(["bash", str(RUN_GRPO), "--steps", str(PPO_STEPS), "--eval_interval", "0"],
                       job_env(out, ALGORITHM="ppo"), timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_ppo_run_learns_with_a_critic(ppo_run):
    """`ALGORITHM=ppo bash run_grpo.sh`: the same job with GAE advantages from a critic (data parallel over the
    2 ranks, started from the policy with a zero head); the held-out accuracy rises and the critic's values
    follow the returns."""
    out = ppo_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == PPO_STEPS
    before, after = records[0]["eval/accuracy"], steps[-1]["eval/accuracy"]
    # the held-out answers are scored by each rule reward of the job too (grpo.yaml: accuracy, format)
    assert {k for k in records[0] if k.startswith("eval/")} == {"eval/accuracy", "eval/format"}
    assert 0 <= records[0]["eval/format"] <= 1 and 0 <= steps[-1]["eval/format"] <= 1
    assert after >= before + 0.08, (before, after)
    assert steps[0]["critic/values/mean"] == 0.0  # the zero head
    late = steps[PPO_STEPS // 2:]
    # a baseline: the critic's mean value tracks the mean return (within the spread of the rewards)
    assert np.mean([abs(r["critic/values/mean"] - r["critic/returns/mean"]) for r in late]) < 0.3
    assert all(r["critic/updates"] == 4 for r in steps)
