"""run_grpo.sh before any work: a MASTER_PORT another process holds fails at once (msrun would wait minutes), bad
flags, YAML values and a rerun into a finished run's OUTPUT fail before the conversions, a run into the OUTPUT of a
live one fails at once, and on several nodes each node converts into a folder of its own (DRY_RUN=1 shows the
commands without running them)."""
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import yaml
from support.msrun import run_command
from support.paths import ARITH, MODEL_CONFIGS, RUN_GRPO

from mindrlhf.utils.ports import IN_USE, free_port_near, main, port_in_use

# a process that holds FOLDER's run.lock (as a run does) until its stdin closes
HOLDER = ("import sys\nfrom mindrlhf.utils import output_owner\noutput_owner.hold(sys.argv[1])\n"
          "print('held', flush=True)\nsys.stdin.read()\n")


def held_port() -> socket.socket:
    """A listening socket on a free port of 127.0.0.1 (as msrun's scheduler of another job would be)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def run_script(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_command(["bash", RUN_GRPO, *args], {**os.environ, **env}, timeout=120)


def test_a_held_port_is_in_use_and_a_free_one_is_suggested(capsys):
    with held_port() as sock:
        port = sock.getsockname()[1]
        assert port_in_use("127.0.0.1", port) and port_in_use("0.0.0.0", port)
        near = free_port_near("127.0.0.1", port)
        assert near is not None and near > port and not port_in_use("127.0.0.1", near)
        assert main(["127.0.0.1", str(port)]) == IN_USE
        assert capsys.readouterr().out.strip().isdigit()
    assert not port_in_use("127.0.0.1", port)
    assert main(["127.0.0.1", str(port)]) == 0
    assert not port_in_use("nosuchhost.invalid", port)  # nothing to tell: msrun reports the host


def test_run_grpo_fails_at_once_when_the_master_port_is_taken(tmp_path):
    out = tmp_path / "out"
    with held_port() as sock:
        port = sock.getsockname()[1]
        start = time.monotonic()
        proc = run_script({"MASTER_PORT": str(port), "OUTPUT": str(out)})
        seconds = time.monotonic() - start
    assert proc.returncode != 0
    assert seconds < 20, seconds  # not msrun's wait of minutes
    message = (f"run_grpo.sh: MASTER_PORT {port} is in use by another process; set MASTER_PORT to a free port "
               f"(e.g. MASTER_PORT=")
    assert proc.stderr.startswith(message) and proc.stderr.rstrip().endswith(" bash run_grpo.sh)"), proc.stderr
    assert not out.exists()  # failed before bootstrap and conversion
    assert "[bootstrap]" not in proc.stdout


def test_bad_flags_and_values_stop_the_script_before_the_conversions(tmp_path):
    """grpo_one_stage.py --check_flags runs before the policy and the prompts are converted: an unknown flag, a
    value the config refuses, a checkpoint folder that cannot be written, a bfloat16 model on this CPU, a
    WORKER_NUM the YAMLs do not lay out and a rerun into a finished run's OUTPUT each end the script with exit 2 and
    the job's one line (no msrun), and nothing converted."""
    port = str(free_port_near("127.0.0.1", 20200))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bf16 = tmp_path / "train_bf16.yaml"
    bf16.write_text((ARITH / "train.yaml").read_text().replace("compute_dtype: float32", "compute_dtype: bfloat16"))
    cases = {"unknown": (["--nosuch_flag", "1"], "grpo_one_stage.py: error: unrecognized arguments: --nosuch_flag 1"),
             "refused": (["--num_generations", "0"], "error: command line: generation: generation.num_generations "
                                                     "must be an integer >= 1, got 0"),
             "unwritable": (["--save_ckpt_dir", str(blocker / "ckpt")],
                            f"error: {blocker / 'ckpt'}: --save_ckpt_dir cannot be written (Not a directory)"),
             "bfloat16": ([], f"error: {bf16}: model_config.compute_dtype: bfloat16 has no CPU kernels"),
             "ranks": ([], f"error: {ARITH / 'train.yaml'}: parallel_config: data_parallel=2 x model_parallel=1 = 2 "
                           "ranks, but the job has 3")}
    # a rerun into the OUTPUT of a finished run (its checkpoints and metrics) that neither resumes nor overwrites it
    rerun = tmp_path / "rerun"
    for step in (1, 2):
        (rerun / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (rerun / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    cases["rerun"] = ([], f"error: {rerun}: holds a run's checkpoints step_000001..step_000002 and metrics of 2 "
                          "steps; --resume continues that run, --overwrite_output deletes")
    special = {"bfloat16": {"TRAIN_YAML": str(bf16)}, "ranks": {"WORKER_NUM": "3"}}  # msrun would start 3 ranks
    for name, (flags, message) in cases.items():
        out = tmp_path / name
        env = {"OUTPUT": str(out), "MASTER_PORT": port, **special.get(name, {})}
        proc = run_script(env, *flags)
        assert proc.returncode == 2 and proc.stderr.startswith(message), (name, proc.stderr[-2000:])
        assert not (out / "policy.ckpt").exists() and not (out / "prompts.mindrecord").exists(), name


def commands(stdout: str) -> dict[str, list[str]]:
    """The dry run's commands by what they run (convert_weight.py, rlhf_data.py twice, msrun)."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        words = shlex.split(line)
        for key in ("convert_weight.py", "rlhf_data.py", "msrun", "bootstrap.sh"):
            if any(word.endswith(key) for word in words):
                found.setdefault(key, []).extend(words)
    return found


def test_one_node_converts_into_output_and_several_nodes_each_into_their_own(tmp_path):
    out = tmp_path / "out"
    single = run_script({"DRY_RUN": "1", "OUTPUT": str(out), "MASTER_PORT": str(free_port_near("127.0.0.1", 20000)),
                         "PROMPT_KEY": "problem", "ANSWER_KEY": "solution"})
    assert single.returncode == 0, single.stderr
    found = commands(single.stdout)
    data_steps = [shlex.split(line) for line in single.stdout.splitlines() if "rlhf_data.py" in line]
    assert len(data_steps) == 2  # the prompts and the held-out split, each with the data's own field names
    for words in data_steps:
        assert words[words.index("--prompt_key") + 1] == "problem" and words[words.index("--answer_key") + 1] == \
            "solution"
    assert set(found) == {"bootstrap.sh", "convert_weight.py", "rlhf_data.py", "msrun"}, single.stdout
    assert str(out / "policy.ckpt") in found["convert_weight.py"]
    assert {str(out / "prompts.mindrecord"), str(out / "heldout.mindrecord")} <= set(found["rlhf_data.py"])
    assert str(out / "policy.ckpt") in found["msrun"] and str(out / "prompts.mindrecord") in found["msrun"]
    assert not (out / "policy.ckpt").exists()  # printed, not run

    with held_port() as sock:  # node 1 hosts no scheduler: MASTER_PORT is node 0's, not checked here
        node = {"DRY_RUN": "1", "OUTPUT": str(out), "WORKER_NUM": "4", "LOCAL_WORKER_NUM": "2", "NODE_RANK": "1",
                "MASTER_PORT": str(sock.getsockname()[1])}
        second = run_script(node)
    assert second.returncode == 0, second.stderr
    found = commands(second.stdout)
    mine = out / "node_1"
    assert str(mine / "policy.ckpt") in found["convert_weight.py"]
    assert {str(mine / "prompts.mindrecord"), str(mine / "heldout.mindrecord")} <= set(found["rlhf_data.py"])
    assert str(mine / "policy.ckpt") in found["msrun"] and str(mine / "prompts.mindrecord") in found["msrun"]
    assert found["msrun"][found["msrun"].index("--output_dir") + 1] == str(out)  # the job's output stays shared
    assert (mine / "msrun.out").exists()  # msrun's output teed per node too


def test_model_names_a_folder_of_model_configs(tmp_path):
    port = str(free_port_near("127.0.0.1", 20100))
    env = {"DRY_RUN": "1", "OUTPUT": str(tmp_path / "out"), "MASTER_PORT": port}
    qwen = run_script({**env, "MODEL": "qwen2_5_0_5b", "MODEL_DIR": "/models/Qwen2.5-0.5B-Instruct"})
    assert qwen.returncode == 0, qwen.stderr
    found = commands(qwen.stdout)
    configs = MODEL_CONFIGS / "qwen2_5_0_5b"
    assert found["convert_weight.py"][found["convert_weight.py"].index("--torch_ckpt_dir") + 1] == \
        "/models/Qwen2.5-0.5B-Instruct"
    yamls = (("--sft_path_train", "train.yaml"), ("--sft_path_infer", "infer.yaml"), ("--config", "grpo.yaml"))
    for flag, name in yamls:
        assert found["msrun"][found["msrun"].index(flag) + 1] == str(configs / name)
    assert found["rlhf_data.py"][found["rlhf_data.py"].index("--template") + 1] == "chat"  # the model's own template

    # each model's job starts as many ranks as its YAMLs lay out: SmolLM2 one rank using both cores
    devices = {}
    for model, extra in (("arith", {}), ("qwen2_5_0_5b", {"MODEL_DIR": "/q"}), ("smollm2", {})):
        msrun = commands(run_script({**env, "MODEL": model, **extra}).stdout)["msrun"]
        parallel = yaml.safe_load((MODEL_CONFIGS / model / "train.yaml").read_text())["parallel_config"]
        devices[model] = parallel["data_parallel"] * parallel["model_parallel"] * parallel.get("pipeline_stage", 1)
        assert f"--worker_num={devices[model]}" in msrun and f"--local_worker_num={devices[model]}" in msrun, model
    assert devices == {"arith": 2, "qwen2_5_0_5b": 2, "smollm2": 1}

    no_dir = run_script({**env, "MODEL": "qwen2_5_0_5b"})
    assert no_dir.returncode == 2 and "MODEL=qwen2_5_0_5b needs MODEL_DIR" in no_dir.stderr
    unknown = run_script({**env, "MODEL": "nosuch"})
    assert unknown.returncode == 2 and "model_configs/nosuch/grpo.yaml" in unknown.stderr


def test_the_job_starts_as_many_ranks_as_its_train_yaml_lays_out(tmp_path):
    """WORKER_NUM comes from TRAIN_YAML's layout, counted by the plan's code (no table of models in the script); a
    WORKER_NUM given wins, and a TRAIN_YAML that cannot be read ends the script with the plan's one line."""
    env = {"DRY_RUN": "1", "OUTPUT": str(tmp_path / "out"), "MASTER_PORT": str(free_port_near("127.0.0.1", 20400))}
    yamls = {}
    for dp, mp in ((1, 1), (2, 2)):
        yamls[dp * mp] = tmp_path / f"train_{dp}x{mp}.yaml"
        yamls[dp * mp].write_text((ARITH / "train.yaml").read_text().replace(
            "data_parallel: 2\n  model_parallel: 1", f"data_parallel: {dp}\n  model_parallel: {mp}"))
    for ranks, path in yamls.items():
        proc = run_script({**env, "TRAIN_YAML": str(path)})
        assert proc.returncode == 0, proc.stderr
        msrun = commands(proc.stdout)["msrun"]
        assert f"--worker_num={ranks}" in msrun and f"--local_worker_num={ranks}" in msrun, (ranks, msrun)
    given = commands(run_script({**env, "TRAIN_YAML": str(yamls[1]), "WORKER_NUM": "2"}).stdout)["msrun"]
    assert "--worker_num=2" in given and "--local_worker_num=2" in given
    missing = run_script({**env, "TRAIN_YAML": str(tmp_path / "nosuch.yaml")})
    assert missing.returncode == 2 and missing.stderr == f"error: {tmp_path / 'nosuch.yaml'}: config file not found\n"
    assert "msrun" not in missing.stdout


def test_a_second_run_into_the_output_of_a_live_one_is_refused_at_once(tmp_path):
    """Two runs into one OUTPUT at once: the first holds OUTPUT/run.lock (here a process holding it through the same
    module, as the first script does); the second script exits 2 within seconds with one line naming the first's
    pid and host, before its flag check and conversions, and leaves the first's live msrun.out and msrun_log/ as they
    are (it renames an earlier run's only when it owns OUTPUT)."""
    out = tmp_path / "out"
    (out / "msrun_log").mkdir(parents=True)
    (out / "msrun_log" / "worker_0.log").write_text("step 1/40 | the first run's\n")
    (out / "msrun.out").write_text("the first run's\n")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        first = json.loads((out / "run.lock").read_text())
        before = {path: path.read_text() for path in out.rglob("*") if path.is_file()}
        start = time.monotonic()
        proc = run_script({"OUTPUT": str(out), "MASTER_PORT": str(free_port_near("127.0.0.1", 20300))})
        seconds = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (f"error: {out}: in use by another run (pid {holder.pid} on host "
                                   f"{socket.gethostname()} since {first['start']}); wait for it to end or choose "
                                   "another OUTPUT"), proc.stderr[-2000:]
    assert seconds < 20, seconds
    assert {path: path.read_text() for path in out.rglob("*") if path.is_file()} == before


def test_the_stages_before_rl_make_their_data_and_run_their_command(tmp_path):
    """ALGORITHM=sft | reward | dpo: the problems become conversations or pairs (make_stage_data.py), rlhf_data.py
    tokenises that kind, msrun runs the stage's script with its YAML; SFT of the bundled model starts from random
    weights (no conversion), the others from the converted policy; the reward model first runs 2 epochs of its own on
    every worked wrong answer (OUTPUT/worked) and starts from its last step; each flag check passes as printed."""
    env = {"DRY_RUN": "1", "MASTER_PORT": str(free_port_near("127.0.0.1", 20600))}
    for stage, kind in (("sft", "sft"), ("reward", "pairwise"), ("dpo", "pairwise")):
        out = tmp_path / stage
        proc = run_script({**env, "ALGORITHM": stage, "OUTPUT": str(out)})
        assert proc.returncode == 0, proc.stderr
        lines = [shlex.split(line) for line in proc.stdout.splitlines()]
        made = [words for words in lines if any(w.endswith("make_stage_data.py") for w in words)]
        launches = [words for words in lines if words and words[0] == "msrun"]
        assert len(made) == len(launches) == (2 if stage == "reward" else 1)
        assert all(words[words.index("--kind") + 1] == kind for words in made)
        found = commands(proc.stdout)
        assert found["rlhf_data.py"][found["rlhf_data.py"].index("--kind") + 1] == kind
        msrun = launches[-1]
        assert any(w.endswith(f"examples/qwen_grpo_tutorial/{stage}.py") for w in msrun), msrun
        assert msrun[msrun.index("--config") + 1] == str(ARITH / f"{stage}.yaml")
        assert msrun[msrun.index("--mind_dataset_dir") + 1] == str(out / f"{kind}.mindrecord")
        assert ("convert_weight.py" in found) == (stage != "sft") == ("--load_sft_checkpoint_train" in msrun)
        assert "--pairs_per_problem" not in made[-1]
        if stage == "reward":
            first = launches[0]
            assert made[0][made[0].index("--output") + 1:] == [str(out / "worked" / "pairwise.jsonl"),
                                                               "--pairs_per_problem", "6", "--worked_wrong_share", "1"]
            assert first[first.index("--output_dir") + 1] == str(out / "worked")
            assert first[first.index("--epochs") + 1] == "2" and "--epochs" not in msrun
            assert first[first.index("--load_sft_checkpoint_train") + 1] == str(out / "worked" / "policy.ckpt")
            assert msrun[msrun.index("--load_sft_checkpoint_train") + 1] == \
                str(out / "worked" / "checkpoints" / "step_LAST")
            converted = [words for words in lines if any(w.endswith("convert_weight.py") for w in words)]
            assert len(converted) == 1  # by the first pass alone: the second reads its step folder
        check = next(words for words in lines if "--check_flags" in words)
        done = run_command([str(RUN_GRPO.parent / ".venv" / "bin" / "python"), *check[1:]],
                           {**os.environ, "MS_WORKER_NUM": "2"}, timeout=120, cwd=str(RUN_GRPO.parent))
        assert done.returncode == 0, done.stderr
    bad = run_script({**env, "ALGORITHM": "kto", "OUTPUT": str(tmp_path / "kto")})
    assert bad.returncode == 2 and "ALGORITHM must be grpo, ppo, sft, reward or dpo, got 'kto'" in bad.stderr
