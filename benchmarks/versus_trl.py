"""mindrlhf vs TRL's `GRPOTrainer` on the same GRPO job: seconds per phase, tokens/s and mean reward.

OURS is `bash run_grpo.sh` exactly as a user runs it (convert, prompts, msrun, `grpo_one_stage.py`; no held-out
evaluation), read back from its `metrics.jsonl`. THEIRS is TRL's `GRPOTrainer` (`benchmarks/trl_side.py`) on the
same job: the same Hugging Face policy folder, the same prompts (the text and token ids `rlhf_data.py` writes, in
the order mindrlhf's reader takes them), the same reward functions (`mindrlhf.reward`), and the GRPO settings of
the job's `grpo.yaml` mapped onto `trl.GRPOConfig` (`trl_config`). TRL runs twice per round: as its users run it
(`trl`: its defaults on this CPU, bf16 autocast and gradient checkpointing) and in fp32 without checkpointing
(`trl_fp32`, the precision ours computes in on a CPU). Each run is its own process, the sides alternate (ours,
trl, trl_fp32, ours, ... for 2 rounds), and the first step of every run (it compiles / warms up) is left out of
the medians. The table says what cannot be made equal.

TRL, `datasets` and `accelerate` never enter the project's `.venv`: they go into their own virtualenv,
`benchmarks/.venv-trl` (made on first use with the pins of `TRL_REQUIREMENTS`, torch 2.13.0 CPU; re-used while a
stamp file matches the pins).

Cases:
- `arith`: the bundled default job (`model_configs/arith`: 3.2M-parameter policy, 8 prompts x 8 samples, 48 new
  tokens, 4 updates of 2 prompt groups per step), ours on 2 workers as `run_grpo.sh` launches it;
- `0.5b`: Qwen2.5-0.5B's shape with seeded random weights (`versus_hf.prepare_model`; the project venv then needs
  the test dependencies: `bash tools/bootstrap.sh test`), the arithmetic prompts, 2 prompts x 4 samples, 64 new
  tokens, one update per step, lr 1e-6, ours on 1 worker with 1-response micro-batches (as `grpo_step.py`).
- `smollm2`: SmolLM2-135M-Instruct (`tools/fetch_smollm2.py`), the job of `MODEL=smollm2 bash run_grpo.sh`
  (`model_configs/smollm2`: the model's chat template, 4 prompts x 8 samples, 96 new tokens, one update per step),
  ours on 1 worker using both cores, as `run_grpo.sh` launches it (`--workers 2`: 2 data-parallel ranks).

`--lora_rank R` trains LoRA adapters on every side (ours: run_grpo.sh's `--lora_rank`, `--lora_alpha`,
`--lora_target_modules`; TRL: `GRPOTrainer(peft_config=peft.LoraConfig(...))` of the same rank, alpha and targets,
its reference the base model with the adapters off, as ours) and adds the side `ours_full`, ours training the whole
policy, so that one run gives LoRA against full fine-tuning and against TRL with PEFT.

    .venv/bin/python benchmarks/versus_trl.py                          # arith, 6 steps x 2 rounds, ~30 min
    .venv/bin/python benchmarks/versus_trl.py --steps 3 --rounds 1     # a quick look
    .venv/bin/python benchmarks/versus_trl.py --case 0.5b --workdir /tmp/vtrl   # 2 steps, ~20 GiB peak
    .venv/bin/python benchmarks/versus_trl.py --workers 1              # ours on 1 worker (train/infer dp=1 tp=1)
    .venv/bin/python benchmarks/versus_trl.py --case smollm2           # 4 steps x 2 rounds, ~30 min
    .venv/bin/python benchmarks/versus_trl.py --case smollm2 --lora_rank 16 --rounds 1   # LoRA, ~25 min
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from repo_paths import ARITH, ROOT, RUN_GRPO, SMOLLM2, SMOLLM2_MODEL_DIR, results_path
from results_io import write_results

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/
TRL_VENV = os.path.join(HERE, ".venv-trl")
# torch 2.13.0 CPU: the wheel on the machine (a looser pin pulls a multi-GB CUDA build; requirements-test.txt);
# transformers and peft as in the project's test venv, so both HF sides run the same Qwen2 code (peft: --lora_rank)
TRL_REQUIREMENTS = ("trl==1.16.0", "datasets==5.2.0", "accelerate==1.15.0", "torch==2.13.0", "transformers==5.23.0",
                    "peft==0.21.2")
DATA = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "data", "arithmetic_train.jsonl")
MAX_PROMPT_LENGTH = 256  # run_grpo.sh's default
# configs: the model_configs folder whose grpo.yaml is the job; template: rlhf_data.py's --template (run_grpo.sh's)
CASES = {
    "arith": dict(steps=6, workers=2, overrides={}, micro=None, log_prob_micro=None, configs=ARITH,
                  template="r1_think"),
    "0.5b": dict(steps=2, workers=1, micro=1, log_prob_micro=1, configs=ARITH, template="r1_think",
                 overrides=dict(batch_size=2, num_generations=4, max_new_tokens=64, mini_batch_size=0,
                                learning_rate=1e-6)),
    "smollm2": dict(steps=4, workers=1, overrides={}, micro=None, log_prob_micro=None, configs=SMOLLM2,
                    template="chat"),
}
# TRL's sides: its defaults (GRPOConfig's bf16 and gradient_checkpointing, what a user gets on a CPU with bf16), and
# fp32 without recompute
TRL_SIDES = {"trl": dict(bf16=True, gradient_checkpointing=True),
             "trl_fp32": dict(bf16=False, gradient_checkpointing=False)}
# our sides: the job as the case and options give it, and with --lora_rank the same job training the whole policy
OURS_SIDES = ("ours", "ours_full")
SIDES = (*OURS_SIDES, *TRL_SIDES)
RATIO_SIDES = ("ours_full", *TRL_SIDES)  # the sides "ours" is divided by in the table
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_target_modules")
MEMORY_0_5B_GIB = 20  # peak of the larger side (ours with 1-response micro-batches; TRL ~12 GiB)
# mindrlhf's loss aggregation -> TRL's loss_type with the same normalisation (per optimizer update)
LOSS_TYPES = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}
# mindrlhf's advantage estimator -> TRL's scale_rewards
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
TABLE_PHASES = (("generate", "generate"), ("ref", "ref log-probs"), ("updates", "updates"), ("reward", "reward"),
                ("other", "other"), ("step", "whole step"))
NOT_EQUAL = (
    "sampling: both sample at the same temperature without top-k/top-p, but from different RNG streams (numpy on "
    "the host vs torch), so the responses, their lengths and rewards differ step by step, and with them the work",
    "padding: ours pads prompts to the bucket (grpo.yaml prompt_buckets) and responses to max_new_tokens in "
    "generation, and its train and log-prob passes read responses cut to one of schedule.response_buckets widths "
    "(static shapes, a graph per width); TRL pads to the longest prompt / completion of the batch",
    "prompts: ours reads each prompt once for all of its responses in a graph call (schedule.share_prompts); TRL "
    "runs every [prompt | completion] row on its own",
    "old-policy log-probs: with num_iterations 1 ours reuses the sampler's log-probs; TRL recomputes them with a "
    "forward pass when one generation feeds several updates (in its 'ref log-probs' row, timing/old in the JSON)",
    "processes: ours runs `run_grpo.sh`'s msrun workers (in the layouts of its train/infer YAMLs) sharing the "
    "cores; TRL runs one process with --torch_threads torch threads",
    "weights sync: ours generates with the train net itself when the train and infer YAMLs give the same model and "
    "layout (the bundled job, the 0.5b case), else reshards the trained weights into the inference net every step "
    "(in 'other'); TRL generates with the trained model itself ('other' is its batch preparation: tokenising, "
    "padding, decoding)",
    "update batches: TRL shuffles a generation batch before cutting it into updates; here it keeps the order "
    "(patched to identity), so each update takes whole prompt groups, as ours",
    "warmup: transformers' constant_with_warmup starts at lr 0; TRL gets mindrlhf's schedule (update k: lr*(k+1)/w)",
    "micro-batches: TRL's forward/backward and ref/old passes take per_device_train_batch_size rows a call (a "
    "whole update unless --micro_batch_size_per_device is given); ours its micro-batch sizes (auto unless given: "
    "the most rows that fit schedule.activation_memory_gib)",
    "weight decay (0 here): ours decays matrices only, transformers every weight but biases and norms",
)


# ---------------------------------------------------------------- options and settings

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--case", choices=tuple(CASES), default="arith")
    p.add_argument("--steps", type=int, default=None,
                   help="GRPO steps per run; the first is left out of the medians (default: 6 arith, 2 0.5b)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the sides, interleaved")
    p.add_argument("--sides", default=None,
                   help="which sides to run, comma-separated: ours, ours_full (with --lora_rank: ours training the "
                        "whole policy), trl (TRL's defaults: bf16 autocast and gradient checkpointing), trl_fp32 "
                        "(default: all that apply)")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="ours trains LoRA adapters of this rank (run_grpo.sh's flag) and TRL a PEFT LoraConfig of "
                        "the same rank, alpha and targets; 0: the whole policy")
    p.add_argument("--lora_alpha", type=float, default=None, help="with --lora_rank (default: twice the rank)")
    p.add_argument("--lora_target_modules", nargs="+", default=["all-linear"], help="with --lora_rank")
    p.add_argument("--workers", type=int, default=None,
                   help="msrun workers of our side (default: the case's YAMLs' layout: 2 arith, 1 0.5b and "
                        "smollm2); another count rewrites the train and infer YAMLs to a layout over it (tensor "
                        "parallel for 0.5b, data parallel otherwise)")
    p.add_argument("--micro_batch_size_per_device", type=int, default=None,
                   help="passed to run_grpo.sh (default: not passed for arith, 1 for 0.5b); TRL's "
                        "per_device_train_batch_size follows it (with gradient accumulation); unset or 0: TRL takes "
                        "a whole update at once")
    p.add_argument("--log_prob_micro_batch_size_per_device", type=int, default=None,
                   help="passed to run_grpo.sh (default: not passed for arith, 1 for 0.5b)")
    p.add_argument("--recompute", action="store_true",
                   help="our train net recomputes every layer (recompute_config.recompute, in YAMLs the "
                        "benchmark writes)")
    p.add_argument("--max_new_tokens", type=int, default=None,
                   help="both sides' response length (run_grpo.sh's flag, TRL's max_completion_length); default: "
                        "the case's")
    p.add_argument("--response_buckets", type=int, default=None,
                   help="passed to run_grpo.sh (the widths our train and log-prob passes compile; 1 at long "
                        "responses); TRL pads to the batch's longest response")
    p.add_argument("--min_decode_rows", type=int, default=None,
                   help="passed to run_grpo.sh (our rollout's tail steps down to fewer decode rows); default: "
                        "grpo.yaml's")
    p.add_argument("--step_down_ratio", type=float, default=None,
                   help="passed to run_grpo.sh (the step-down ladder's ratio: 0.5 halves); default: grpo.yaml's")
    p.add_argument("--seed", type=int, default=None,
                   help="passed to run_grpo.sh (data order and sampling) and to TRL; default: grpo.yaml's")
    p.add_argument("--torch_threads", type=int, default=2, help="TRL side's torch threads")
    p.add_argument("--workdir", default=None, help="keeps the runs' output (and the converted 0.5B model)")
    p.add_argument("--output", default=None, help="default: benchmarks/results/versus_trl_<case>.json")
    args = p.parse_args(argv)
    case = CASES[args.case]
    args.steps = args.steps or case["steps"]
    args.workers = args.workers or case["workers"]
    if args.micro_batch_size_per_device is None:
        args.micro_batch_size_per_device = case["micro"]
    if args.log_prob_micro_batch_size_per_device is None:
        args.log_prob_micro_batch_size_per_device = case["log_prob_micro"]
    default_sides = SIDES if args.lora_rank else tuple(side for side in SIDES if side != "ours_full")
    args.sides = [s.strip() for s in (args.sides or ",".join(default_sides)).split(",") if s.strip()]
    if args.lora_alpha is None:
        args.lora_alpha = 2.0 * args.lora_rank
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds: at least 1")
    if not args.sides or set(args.sides) - set(SIDES):
        p.error(f"--sides: a comma-separated list of {', '.join(SIDES)}")
    if "ours_full" in args.sides and not args.lora_rank:
        p.error("--sides ours_full: only with --lora_rank (it is ours without the adapters)")
    return args


def job_overrides(args: argparse.Namespace) -> dict:
    """The GRPO fields the case and the options change from grpo.yaml (flat, as grpo_one_stage.py's flags)."""
    overrides = dict(CASES[args.case]["overrides"])
    for name in ("micro_batch_size_per_device", "log_prob_micro_batch_size_per_device", "max_new_tokens",
                 "response_buckets", "min_decode_rows", "step_down_ratio"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.lora_rank:
        overrides.update(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                         lora_target_modules=list(args.lora_target_modules))
    return overrides


def peft_lora(settings: dict) -> dict | None:
    """`peft.LoraConfig` keyword arguments for the job's adapters (None without them); PEFT's all-linear is ours (every
    linear layer of the blocks, not the output head)."""
    lora = settings["lora"]
    if not lora["lora_rank"]:
        return None
    targets = lora["lora_target_modules"]
    return {"r": lora["lora_rank"], "lora_alpha": lora["lora_alpha"], "lora_dropout": lora["lora_dropout"],
            "target_modules": "all-linear" if "all-linear" in targets else list(targets)}


def job_settings(grpo_yaml: str, overrides: dict) -> dict:
    """The job's GRPOConfig (grpo.yaml + overrides, by field name in every section that has it), as nested dicts."""
    from mindrlhf.configs.grpo_configs import GRPOConfig, field_paths

    paths = field_paths()
    nested: dict[str, dict] = {}
    for name, value in overrides.items():
        for section, _ in paths[name]:
            nested.setdefault(section, {})[name] = value
    return GRPOConfig.from_yaml(grpo_yaml).replace(nested, "versus_trl").to_dict()


def trl_config(settings: dict, steps: int, side: str = "trl") -> dict:
    """`trl.GRPOConfig` keyword arguments for the job `settings` (GRPOConfig.to_dict()) run for `steps` steps, in
    the precision and recompute of TRL's `side` (TRL_SIDES).

    One GRPO step of ours = one generation batch of TRL = `updates_per_step` optimizer steps; the micro-batch of a
    forward/backward is `micro_batch_size_per_device` rows, accumulated up to an update (0, our trainer's auto
    size: a whole update, which is what ours picks for the bundled model).
    Settings TRL cannot express raise ValueError.
    """
    gen, loss, opt, sched = settings["generation"], settings["loss"], settings["optimizer"], settings["schedule"]
    algo = settings["algorithm"]
    unsupported = [
        (loss["aggregation"] not in LOSS_TYPES, f"loss.aggregation {loss['aggregation']!r}"),
        (loss["kl_estimator"] != "k3", f"loss.kl_estimator {loss['kl_estimator']!r} (TRL: k3)"),
        (algo["adv_estimator"] not in SCALE_REWARDS, f"algorithm.adv_estimator {algo['adv_estimator']!r}"),
        (algo["advantage_eps"] != 1e-4, "algorithm.advantage_eps != 1e-4 (TRL's constant)"),
        (opt["lr_schedule"] != "constant", f"optimizer.lr_schedule {opt['lr_schedule']!r}"),
        (algo["dynamic_sampling"], "algorithm.dynamic_sampling"),
        (sched["ref_model_sync_steps"] != 0, "schedule.ref_model_sync_steps"),
        (not gen["do_sample"], "generation.do_sample false"),
        (bool(gen["stop_strings"]), "generation.stop_strings (TRL's GRPOConfig has none)"),
    ]
    bad = [what for failed, what in unsupported if failed]
    if bad:
        raise ValueError(f"not comparable with TRL's GRPOTrainer here: {', '.join(bad)}")
    group = gen["num_generations"]
    prompts_per_update = sched["mini_batch_size"] or sched["batch_size"]
    updates = sched["batch_size"] // prompts_per_update
    rows_per_update = prompts_per_update * group
    micro = sched["micro_batch_size_per_device"] or rows_per_update
    if rows_per_update % micro:
        raise ValueError(f"micro_batch_size_per_device {micro} does not divide an update's {rows_per_update} rows")
    accumulation = rows_per_update // micro
    return dict(
        num_generations=group, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
        steps_per_generation=updates * accumulation, num_iterations=sched["num_iterations"],
        max_steps=steps * updates * sched["num_iterations"], shuffle_dataset=False, seed=sched["seed"],
        max_completion_length=gen["max_new_tokens"], temperature=gen["temperature"], top_k=gen["top_k"],
        top_p=gen["top_p"], **({"min_p": gen["min_p"]} if gen["min_p"] else {}), beta=loss["beta"],
        epsilon=loss["epsilon_low"], epsilon_high=loss["epsilon_high"],
        loss_type=LOSS_TYPES[loss["aggregation"]], scale_rewards=SCALE_REWARDS[algo["adv_estimator"]],
        reward_weights=_weights(settings["reward"]["reward_weights"]), learning_rate=opt["learning_rate"],
        adam_beta1=opt["beta1"], adam_beta2=opt["beta2"], adam_epsilon=opt["eps"], weight_decay=opt["weight_decay"],
        max_grad_norm=opt["max_grad_norm"], warmup_steps=opt["warmup_steps"], lr_scheduler_type="constant_with_warmup",
        use_vllm=False, use_cpu=True, fp16=False, **TRL_SIDES[side], logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )


def _weights(weights) -> list[float] | None:
    """The job's reward weights for TRL (unset: None, 1.0 each on both sides)."""
    return None if weights is None else list(weights)


def updates_per_step(config: dict) -> int:
    """Optimizer steps of one GRPO step under a `trl_config`."""
    return config["steps_per_generation"] // config["gradient_accumulation_steps"] * config["num_iterations"]


# ---------------------------------------------------------------- the prompts, as ours reads them

def job_rows(data: str, tokenizer_dir: str, workdir: str, steps: int, batch_size: int, seed: int,
             template: str = "r1_think", max_prompt_length: int = MAX_PROMPT_LENGTH) -> tuple[list[dict], dict]:
    """The prompts of `steps` steps in the order mindrlhf's trainer takes them, and the tokenizer's special ids.

    The prompts are written by the function `rlhf_data.py` runs (`convert_to_mindrecord` with `template`) and
    read back in order from the MindRecord (text, token ids, solution); the step order is `PromptDataset`'s for
    the job's global batch and seed (it does not depend on the data-parallel split).
    """
    from mindspore.mindrecord import FileReader

    from mindrlhf.data.mindrecord import convert_to_mindrecord
    from mindrlhf.data.reader import PromptDataset
    from mindrlhf.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "job_prompts.mindrecord")
    for stale in (path, path + ".db"):
        if os.path.exists(stale):
            os.remove(stale)
    convert_to_mindrecord(data, path, tokenizer, template=template, max_prompt_length=max_prompt_length)
    reader = FileReader(path, num_consumer=1)
    try:
        records = [{"prompt": _text(r["prompt"]), "prompt_ids": [int(t) for t in r["prompt_ids"]],
                    "solution": _text(r["solution"])} for r in reader.get_next()]
    finally:
        reader.close()
    dataset = PromptDataset(path, batch_size, int(tokenizer.pad_token_id), seed=seed)
    rows = []
    for _ in range(steps):
        batch = dataset.next_batch()
        for index, ids, mask in zip(batch["sample_index"], batch["prompt_ids"], batch["attention_mask"]):
            record = records[int(index)]
            if ids[mask.astype(bool)].tolist() != record["prompt_ids"]:
                raise RuntimeError(f"{path}: record {index} read back differently by PromptDataset")
            rows.append(dict(record, sample_index=int(index)))
    special = {"stop_token_ids": [int(t) for t in tokenizer.stop_token_ids],
               "pad_token_id": int(tokenizer.pad_token_id)}
    return rows, special


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def step_prompt_tokens(rows: list[dict], batch_size: int, group: int) -> list[int]:
    """Prompt tokens of each step's responses (every prompt counts once per generation)."""
    return [group * sum(len(r["prompt_ids"]) for r in rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]


# ---------------------------------------------------------------- the two sides

def ensure_trl_venv(venv: str = TRL_VENV) -> str:
    """The TRL virtualenv's python; creates the venv / installs the pins when its stamp does not match them."""
    python = os.path.join(venv, "bin", "python")
    stamp = os.path.join(venv, ".versus-trl-installed")
    digest = hashlib.sha256("\n".join(TRL_REQUIREMENTS).encode()).hexdigest()[:16]
    if os.path.isfile(stamp) and os.access(python, os.X_OK):
        with open(stamp) as f:
            if f.read().strip() == digest:
                return python
    if not os.access(python, os.X_OK):
        print(f"[versus_trl] creating the TRL virtualenv {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    print(f"[versus_trl] installing {' '.join(TRL_REQUIREMENTS)} into {venv}", flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *TRL_REQUIREMENTS],
                   check=True)
    with open(stamp, "w") as f:
        f.write(digest + "\n")
    return python


def ours_launch(args: argparse.Namespace, overrides: dict, out: str, model: dict) -> tuple[dict, list[str]]:
    """Environment and flags of `bash run_grpo.sh` for our side (evaluation off, the case's model and layout)."""
    from grpo_step import yaml_with_layout

    workers = args.workers
    env = dict(os.environ, OUTPUT=out, EVAL_DATA="", WORKER_NUM=str(workers), LOCAL_WORKER_NUM=str(workers),
               MASTER_PORT=str(8600 + (os.getpid() + len(out)) % 300))
    flags = ["--steps", str(args.steps), "--overwrite_output"]  # a rerun with the same --workdir replaces its run
    for name, value in overrides.items():
        flags += [f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    if args.case == "0.5b" or workers != CASES[args.case]["workers"] or args.recompute:
        # the case's model YAML laid out over the workers: tensor parallel for 0.5B (its 2 kv heads allow tp 1 or
        # 2), data parallel for the others (SmolLM2's 9 heads allow tp 1 or 3)
        data_parallel, model_parallel = (1, workers) if args.case == "0.5b" else (workers, 1)
        train, infer = os.path.join(out, "train.yaml"), os.path.join(out, "infer.yaml")
        yaml_with_layout(model["yaml"], train, data_parallel, model_parallel, model["seq_length"],
                         recompute=args.recompute)
        yaml_with_layout(model["yaml"], infer, data_parallel, model_parallel, model["seq_length"])
        env.update(TRAIN_YAML=train, INFER_YAML=infer)
    if args.case == "0.5b":
        env.update(MODEL_DIR=model["policy_dir"], TOKENIZER_DIR=model["tokenizer_dir"])
    if args.case == "smollm2":
        env.update(MODEL="smollm2", MODEL_DIR=model["policy_dir"])
    return env, flags


def run_ours(args, overrides: dict, model: dict, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    env, flags = ours_launch(args, overrides, out, model)
    start = time.perf_counter()
    with open(os.path.join(out, "run_grpo.log"), "w") as log:
        proc = subprocess.run(["bash", RUN_GRPO, *flags], env=env, cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: run_grpo.sh failed ({proc.returncode}); log: {out}/run_grpo.log\n"
                         f"{_tail(os.path.join(out, 'run_grpo.log'))}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [line for line in lines if "timing/step" in line]
    return {"wall_s": wall, "flags": flags, "steps": steps, "layouts": _layouts(out),
            "peak_rss_gib": max(line.get("perf/sum_rss_gib", 0.0) for line in steps)}


def _layouts(out: str) -> str:
    """The layouts as the trainer logs them (rank 0), e.g. 'dp=2 x tp=1, infer layout dp=2 x tp=1, 2 ranks'."""
    try:
        with open(os.path.join(out, "msrun_log", "worker_0.log"), errors="replace") as f:
            for line in f:
                if "train layout" in line:
                    return line.split("train layout", 1)[1].split("; policy")[0].strip()
    except OSError:
        pass
    return "?"


def run_theirs(python: str, job_path: str, out: str, threads: int, script: str = "trl_side.py") -> dict:
    """A run of `script` (a TRL side, in the TRL venv) on the job file `job_path`: its steps and `RESULT` line."""
    os.makedirs(out, exist_ok=True)
    # the TRL venv has no mindrlhf installed: trl_side.py imports mindrlhf.reward from this checkout (and nothing
    # else from our PYTHONPATH)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    start = time.perf_counter()
    log_path = os.path.join(out, "trl.log")
    with open(log_path, "w") as log:
        proc = subprocess.run([python, os.path.join(HERE, script), "--job", job_path,
                               "--output_dir", out], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    with open(log_path) as f:
        results = [line for line in f if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"error: the TRL side failed ({proc.returncode}); log: {log_path}\n{_tail(log_path)}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return {"wall_s": wall, "steps": steps, **json.loads(results[-1][len("RESULT "):])}


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]


# ---------------------------------------------------------------- summary

def phase_seconds(line: dict) -> dict:
    """A step's seconds per table phase (same names for both sides; 'ref' includes old-policy log-probs)."""
    phases = {"generate": line.get("timing/generate", 0.0),
              "ref": line.get("timing/ref", 0.0) + line.get("timing/old", 0.0),
              "updates": line.get("timing/train", 0.0), "reward": line.get("timing/reward", 0.0)}
    phases["step"] = line["timing/step"]
    phases["other"] = phases["step"] - sum(phases[p] for p in ("generate", "ref", "updates", "reward"))
    return phases


def step_tokens(line: dict, prompt_tokens: int, responses: int) -> float:
    """Prompt + response tokens of a step: TRL counts them; ours from its mean response length."""
    if "perf/tokens" in line:
        return float(line["perf/tokens"])
    return prompt_tokens + line["response_length/mean"] * responses


def later(steps: list) -> list:
    """Steps 2..N (the first compiles / warms up), or the first if it is the only one."""
    return steps[1:] or steps


def run_summary(run: dict, prompt_tokens: list[int], responses: int) -> dict:
    """One run's medians over its later steps, tokens/s, mean reward over all steps."""
    steps = run["steps"]
    seconds = [phase_seconds(line) for line in steps]
    tokens_per_s = [step_tokens(line, prompt_tokens[i], responses) / line["timing/step"]
                    for i, line in enumerate(steps)]
    summary = {phase: statistics.median(s[phase] for s in later(seconds)) for phase, _ in TABLE_PHASES}
    summary["tokens_per_s"] = statistics.median(later(tokens_per_s))
    summary["mean_reward"] = statistics.fmean(line["critic/score/mean"] for line in steps)
    summary["wall_s"] = run["wall_s"]
    summary["peak_rss_gib"] = run["peak_rss_gib"]
    summary["first_step_s"] = steps[0]["timing/step"]
    # ours only: the share of the rows its decode calls computed for responses that had ended (the issue's
    # "empty-slot decode work"; TRL's generate computes finished rows too, but does not report them)
    idle = [line["perf/idle_decode_rows"] for line in steps if "perf/idle_decode_rows" in line]
    summary["idle_decode_rows"] = statistics.fmean(idle) if idle else None
    return summary


def compare(summaries: dict[str, list[dict]]) -> list[dict]:
    """Table rows: per side the value of each round and the mean over rounds; per other side (RATIO_SIDES)
    `ratio_<side>`, ours' mean over that side's."""
    keys = [(phase, f"{label} s") for phase, label in TABLE_PHASES] + [
        ("tokens_per_s", "tokens/s (step)"), ("idle_decode_rows", "idle decode rows"),
        ("mean_reward", "mean reward"), ("first_step_s", "first step s"),
        ("wall_s", "run wall s"), ("peak_rss_gib", "peak RSS GiB (all)")]
    rows = []
    for key, label in keys:
        row = {"key": key, "label": label}
        for side, runs in summaries.items():
            row[side] = [run[key] for run in runs]
            known = [value for value in row[side] if value is not None]
            row[f"{side}_mean"] = statistics.fmean(known) if known else None
        ours = row.get("ours_mean")
        for side in RATIO_SIDES:
            if side in summaries:
                theirs = row.get(f"{side}_mean")
                row[f"ratio_{side}"] = ours / theirs if ours is not None and theirs else None
        rows.append(row)
    return rows


def format_table(rows: list[dict], rounds: int) -> str:
    """Each side's value per round, then ours over each other side that ran."""
    def cell(value) -> str:
        return "-" if value is None else f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"

    sides = [side for side in SIDES if rows and side in rows[0]]
    ratios = [side for side in RATIO_SIDES if rows and f"ratio_{side}" in rows[0]]
    header = f"{'':<18}" + "".join(f"{f'{side} r{i + 1}':>13}" for side in sides for i in range(rounds)) + \
        "".join(f"{f'ours/{side}':>16}" for side in ratios)
    out = [header, "-" * len(header)]
    for row in rows:
        values = [v for side in sides for v in (row[side] + [None] * rounds)[:rounds]]
        line = f"{row['label']:<18}" + "".join(f"{cell(v):>13}" for v in values)
        for side in ratios:
            ratio = row[f"ratio_{side}"]
            line += f"{f'{ratio:.2f}x' if ratio is not None else '-':>16}"
        out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------- driver

def prepare_case(args: argparse.Namespace, workdir: str) -> dict:
    """Where the policy, tokenizer and model YAML of the case are (converting the 0.5B model once per workdir)."""
    if args.case == "arith":
        return {"policy_dir": os.path.join(ARITH, "policy"), "tokenizer_dir": os.path.join(ARITH, "policy"),
                "yaml": os.path.join(ARITH, "train.yaml"), "seq_length": 256}
    if args.case == "smollm2":
        folder = SMOLLM2_MODEL_DIR
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fetch_smollm2.py"), "--output_dir", folder],
                       check=True)
        return {"policy_dir": folder, "tokenizer_dir": folder, "yaml": os.path.join(SMOLLM2, "train.yaml"),
                "seq_length": 1024}  # the shipped YAML's (up to 512 new tokens)
    from versus_hf import model_dir

    folder = model_dir(workdir, "0.5b")
    print(f"[versus_trl] preparing the 0.5B model in {folder} ...", flush=True)
    # in a process of its own, run in benchmarks/ (a `-c` command imports from its working directory)
    subprocess.run([sys.executable, "-c", "import sys; from versus_hf import prepare_model; "
                    "prepare_model(sys.argv[1], '0.5b')", workdir], check=True, cwd=HERE,
                   env=dict(os.environ, GLOG_v="3"))
    return {"policy_dir": os.path.join(folder, "hf"), "tokenizer_dir": os.path.join(ARITH, "policy"),
            "yaml": os.path.join(folder, "model.yaml"), "seq_length": 512}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("GLOG_v", "3")
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="versus_trl_"))
    os.makedirs(workdir, exist_ok=True)
    load_before = os.getloadavg()
    python = ensure_trl_venv() if set(args.sides) & set(TRL_SIDES) else None
    model = prepare_case(args, workdir)
    if args.case == "0.5b":
        import psutil

        available = psutil.virtual_memory().available / 2**30
        if available < MEMORY_0_5B_GIB:
            print(f"[versus_trl] warning: {available:.1f} GiB of memory available; the 0.5b case's runs peak at "
                  f"~{MEMORY_0_5B_GIB} GiB (one at a time)", flush=True)
    overrides = job_overrides(args)
    case = CASES[args.case]
    settings = job_settings(os.path.join(case["configs"], "grpo.yaml"), overrides)
    configs = {side: trl_config(settings, args.steps, side) for side in TRL_SIDES}
    config = configs["trl"]
    batch, group = settings["schedule"]["batch_size"], settings["generation"]["num_generations"]
    rows, special = job_rows(DATA, model["tokenizer_dir"], workdir, args.steps, batch, settings["schedule"]["seed"],
                             case["template"])
    job = {"policy_dir": model["policy_dir"], "tokenizer_dir": model["tokenizer_dir"], "rows": rows,
           "stop_token_ids": special["stop_token_ids"], "reward_funcs": settings["reward"]["reward_funcs"],
           "warmup_steps": settings["optimizer"]["warmup_steps"], "updates_per_step": updates_per_step(config),
           "torch_threads": args.torch_threads, "keep_group_order": True, "peft_lora": peft_lora(settings)}
    job_paths = {}
    for side, side_config in configs.items():
        job_paths[side] = os.path.join(workdir, f"{side}_job.json")
        with open(job_paths[side], "w") as f:
            json.dump({**job, "trl_config": side_config}, f, indent=1)
    prompt_tokens = step_prompt_tokens(rows, batch, group)

    runs: dict[str, list[dict]] = {side: [] for side in args.sides}
    summaries: dict[str, list[dict]] = {side: [] for side in args.sides}
    print(f"[versus_trl] case {args.case}: {args.steps} steps x {args.rounds} rounds, {batch} prompts x {group} "
          f"generations; work folder {workdir}", flush=True)
    for round_index in range(args.rounds):
        for side in args.sides:
            out = os.path.join(workdir, f"{side}_round{round_index + 1}")
            load = os.getloadavg()[0]
            if side in OURS_SIDES:
                whole = {k: v for k, v in overrides.items() if k not in LORA_FIELDS}
                run = run_ours(args, overrides if side == "ours" else whole, model, out)
            else:
                run = run_theirs(python, job_paths[side], out, args.torch_threads)
            run["load_average"] = [load, os.getloadavg()[0]]
            runs[side].append(run)
            summaries[side].append(run_summary(run, prompt_tokens, batch * group))
            s = summaries[side][-1]
            print(f"  round {round_index + 1} {side}: step {s['step']:.3f} s (median of later steps), "
                  f"{s['tokens_per_s']:.1f} tokens/s, mean reward {s['mean_reward']:.3f}, wall {s['wall_s']:.0f} s, "
                  f"load average {run['load_average'][0]:.1f} -> {run['load_average'][1]:.1f}", flush=True)
    table_rows = compare(summaries)
    load_after = os.getloadavg()
    theirs = next((runs[side][0] for side in TRL_SIDES if runs.get(side)), {})
    layouts = runs["ours"][0]["layouts"] if runs.get("ours") else "-"
    print(f"\nGRPO job '{args.case}': mindrlhf (bash run_grpo.sh, {args.workers} worker(s): train {layouts}) vs TRL "
          f"{theirs.get('versions', {}).get('trl', '?')} GRPOTrainer (1 process, {args.torch_threads} torch "
          f"threads; trl: its defaults, bf16 autocast and gradient checkpointing; trl_fp32: fp32, no "
          f"checkpointing); {batch} prompts x {group} generations, {updates_per_step(config)} update(s) per step")
    if args.lora_rank:
        print(f"LoRA: ours and TRL (PEFT) train adapters of rank {args.lora_rank}, alpha {args.lora_alpha:g} on "
              f"{' '.join(args.lora_target_modules)}; ours_full is ours training the whole policy")
    print(f"seconds: median of steps 2..{args.steps} of each round; tokens/s: (prompt + response tokens) / step "
          f"time; mean reward over all steps; load average {load_before[0]:.1f} -> {load_after[0]:.1f} on "
          f"{os.cpu_count()} CPUs")
    print(format_table(table_rows, args.rounds))
    print("ours/trl < 1 on the seconds rows and > 1 on tokens/s: mindrlhf is faster.")
    print("Not equal between the sides:")
    for note in NOT_EQUAL:
        print(f"  - {note}")
    result = {"benchmark": "versus_trl", "case": args.case, "steps": args.steps, "rounds": args.rounds,
              "ours_workers": args.workers, "settings": settings, "overrides": overrides, "trl_configs": configs,
              "trl_requirements": list(TRL_REQUIREMENTS), "rows": table_rows, "summaries": summaries,
              "runs": runs, "not_equal": list(NOT_EQUAL), "prompt_sample_indices": [r["sample_index"] for r in rows],
              "environment": {"python": platform.python_version(), "machine": platform.machine(),
                              "cpus": os.cpu_count(), "load_average_before": load_before,
                              "load_average_after": load_after}}
    write_results(result, args.output or results_path(f"versus_trl_{args.case}.json"))
    return result


if __name__ == "__main__":
    main()
