"""The RL job (`mindrlhf.cli.train`, the tutorial's grpo_one_stage.py) on the tiny model: in this process (its
`main` with `base_args`, `yaml_with`) or under msrun (`job_args`, `run_job` through `workers/grpo_worker.py`,
`module_run`, `grpo_msrun_command` for msrun itself, `started_job` for one that runs while the test acts), the flags
of the jobs several tests share (`straight_args`, `ppo_args`), and `without_timing` to compare their metrics."""
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.msrun import run_worker
from support.paths import GRPO_SCRIPT, TINY, TINY_SFT_CKPT, TOKENIZER


# ---------------------------------------------------------------- in this process (`mindrlhf.cli.train.main`)
def base_args(mindrecord, out_dir, model_yaml=TINY / "model.yaml"):
    return ["--sft_path_train", str(model_yaml), "--sft_path_infer", str(model_yaml), "--tokenizer_dir",
            str(TOKENIZER), "--mind_dataset_dir", str(mindrecord), "--config", str(TINY / "grpo.yaml"),
            "--output_dir", str(out_dir)]


def yaml_with(tmp_path, name, replace):
    text = (TINY / "model.yaml").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- under msrun
def job_args(mindrecord, out_dir, steps, extra=()):
    return ["--sft_path_train", str(TINY / "train.yaml"), "--sft_path_infer", str(TINY / "infer.yaml"),
            "--vocab_path", str(TOKENIZER / "vocab.json"), "--merges_file_path", str(TOKENIZER / "merges.txt"),
            "--mind_dataset_dir", str(mindrecord), "--config", str(TINY / "grpo.yaml"),
            "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--output_dir", str(out_dir),
            "--steps", str(steps), "--max_new_tokens", "32", "--save_interval", "2", "--keep_last", "5",
            "--ref_model_sync_steps", "3", *extra]


def straight_args(mindrecord, out_dir, steps=4):
    """The GRPO straight run's flags (tests/conftest.py's `straight_run`, 4 steps: train tp=2, infer dp=2,
    checkpoints at steps 2 and 4; prompts in two buckets, 128 and 256 tokens: its second step switches to the
    larger; its completions logged). Its steps 1..k are the same with `steps=k` (constant lr, data order and sampling
    seeds independent of the number of steps), which the tests that compare a job to it rely on."""
    return job_args(mindrecord, out_dir, steps, ["--prompt_buckets", "128", "256", "--log_completions", "true"])


def memory_features_yaml(folder):
    """tiny/train.yaml (tp=2) with the memory features of big recipes: sequence parallel over the tp pair and full
    recompute of every layer; written into `folder`. They may not change a value."""
    path = Path(folder) / "train_sp_recompute.yaml"
    memory_features = "  pipeline_stage: 1\n  use_seq_parallel: true\nrecompute_config:\n  recompute: true"
    text = (TINY / "train.yaml").read_text()
    assert "  pipeline_stage: 1" in text
    path.write_text(text.replace("  pipeline_stage: 1", memory_features))
    return path


def ppo_args(mindrecord, out_dir, steps, actor_yaml, critic_yaml, extra=()):
    """The tiny PPO job (GAE, a critic from `critic_yaml`, the adaptive KL-in-reward controller): the tests'
    PPO jobs differ only in the critic's YAML and micro-batch sizes (`extra`), none of which changes a value, so
    they compare with each other step by step."""
    args = job_args(mindrecord, out_dir, steps, [
        "--sft_path_critic", str(critic_yaml), "--adv_estimator", "gae", "--critic.learning_rate", "1e-3",
        "--use_kl_in_reward", "true", "--kl_ctrl", "adaptive", "--kl_horizon", "100", *extra])
    args[args.index("--sft_path_train") + 1] = str(actor_yaml)
    args[args.index("--max_new_tokens") + 1] = "96"  # the tiny policy's answers fit: rewards vary, the critic learns
    return args


def run_job(tmp_path, monkeypatch, name, args, workers=2):
    results = tmp_path / f"{name}_results"
    monkeypatch.setenv("GRPO_WORKER_OUT", str(results))
    run_worker("grpo_worker.py", args, workers=workers, log_dir=tmp_path / f"{name}_logs", timeout=900)
    return [json.loads((results / f"rank_{r}.json").read_text()) for r in range(workers)]


def without_timing(metrics):
    """`metrics` without those a resumed run (or another layout) need not give again: the machine's and
    `swap/bytes_moved` (`NOT_REPRODUCED_ON_RESUME`, docs/metrics.md)."""
    from mindrlhf.trainer.metrics import NOT_REPRODUCED_ON_RESUME

    return {k: v for k, v in metrics.items() if not k.startswith(NOT_REPRODUCED_ON_RESUME)}


def module_run(tmp_path_factory, name, make_args):
    """A job run once for a test module (or the session): (its folder, each rank's results); `make_args(out_dir)`
    gives its flags (out_dir is <folder>/out)."""
    tmp_path = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as monkeypatch:
        return tmp_path, run_job(tmp_path, monkeypatch, name, make_args(tmp_path / "out"))


def grpo_msrun_command(log_dir, port, args, worker_num=2, local_worker_num=2, node_rank=0):
    """msrun running grpo_one_stage.py itself (no test worker around it), as a user launches it; one node of
    `worker_num // local_worker_num` when `local_worker_num` is smaller."""
    return [str(Path(sys.executable).parent / "msrun"), f"--worker_num={worker_num}",
            f"--local_worker_num={local_worker_num}", "--master_addr=127.0.0.1", f"--master_port={port}",
            f"--node_rank={node_rank}", "--join=True", f"--log_dir={log_dir}", str(GRPO_SCRIPT), *args]


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _default_stop_signals() -> None:
    """In a started job's process, before its program: the signals that stop a job acted on as from a terminal,
    whatever this test process inherited (a shell started with SIGINT ignored cannot trap it: a job started from a
    pytest-xdist worker once ran on through a Ctrl-C the test sent)."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


@contextlib.contextmanager
def started_job(cmd, output: Path, env=None):
    """A launched job (msrun) that runs while the test acts: the Popen, in a session of its own, its stdout and
    stderr into the file `output`; stopped whole when the block ends, whatever happened (`stop_job`: its process
    tree, workers included). Wait for it with a timeout (`wait(timeout=...)`)."""
    from mindrlhf.utils.jobs import stop_job

    with open(output, "w") as sink:
        proc = subprocess.Popen([str(part) for part in cmd], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, preexec_fn=_default_stop_signals)
    try:
        yield proc
    finally:
        stop_job(proc)
