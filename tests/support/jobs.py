"""The tutorial's GRPO job (`examples/qwen_grpo_tutorial/grpo_one_stage.py`) on the tiny model: in this process
(`load_script`, `base_args`, `yaml_with`) or under msrun (`job_args`, `run_job` through `workers/grpo_worker.py`,
`module_run`, `grpo_msrun_command` for msrun itself), and `without_timing` to compare their metrics."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from support.msrun import run_worker
from support.paths import GRPO_SCRIPT, TINY, TINY_SFT_CKPT, TOKENIZER


# ---------------------------------------------------------------- in this process
def load_script():
    spec = importlib.util.spec_from_file_location("grpo_one_stage", GRPO_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def run_job(tmp_path, monkeypatch, name, args, workers=2):
    results = tmp_path / f"{name}_results"
    monkeypatch.setenv("GRPO_WORKER_OUT", str(results))
    run_worker("grpo_worker.py", args, workers=workers, log_dir=tmp_path / f"{name}_logs", timeout=900)
    return [json.loads((results / f"rank_{r}.json").read_text()) for r in range(workers)]


def without_timing(metrics):
    from mindrlhf.trainer.metrics import MACHINE_METRICS

    return {k: v for k, v in metrics.items() if not k.startswith((*MACHINE_METRICS, "swap/"))}


def module_run(tmp_path_factory, name, make_args):
    """A job run once for a test module: (its folder, each rank's results); `make_args(out_dir)` gives its flags."""
    tmp_path = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as monkeypatch:
        return tmp_path, run_job(tmp_path, monkeypatch, name, make_args(tmp_path / "out"))


def grpo_msrun_command(log_dir, port, args, worker_num=2, local_worker_num=2, node_rank=0):
    """msrun running grpo_one_stage.py itself (no test worker around it), as a user launches it; one node of
    `worker_num // local_worker_num` when `local_worker_num` is smaller."""
    return [str(Path(sys.executable).parent / "msrun"), f"--worker_num={worker_num}",
            f"--local_worker_num={local_worker_num}", "--master_addr=127.0.0.1", f"--master_port={port}",
            f"--node_rank={node_rank}", "--join=True", f"--log_dir={log_dir}", str(GRPO_SCRIPT), *args]

