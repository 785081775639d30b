"""Builds the bundled policies with `mindrlhf-sft` (the SFT stage, launched through msrun in the model YAML's
layout): GSM8K-style problems' worked solutions as R1-form conversations (`make_stage_data.py --kind sft`),
tokenised (`rlhf_data.py --kind sft`), fine-tuned from random weights, written as a Hugging Face folder or a `.ckpt`
and scored on held-out problems (greedy accuracy).

    # run_grpo.sh's default policy (model_configs/arith/policy: config.json + model.safetensors + tokenizer),
    # ~20 min on 2 CPU cores: 1100 updates on worked solutions, then 200 in which half of the problems are
    # answered without the working, so that the policy often answers directly (and wrongly): GRPO's room
    .venv/bin/python tools/sft_policy.py --model_yaml model_configs/arith/train.yaml \\
        --tokenizer_dir model_configs/arith/policy --data examples/qwen_grpo_tutorial/data/arithmetic_train.jsonl \\
        --eval_data examples/qwen_grpo_tutorial/data/arithmetic_heldout.jsonl --steps 1100 --direct_steps 200 \\
        --batch_size 16 --learning_rate 1e-3 --warmup_steps 50 --direct_fraction 0.5 --output model_configs/arith/policy
    # the tests' tiny policy (model_configs/tiny/tiny_sft.ckpt), with the defaults
    .venv/bin/python tools/sft_policy.py
    # MODEL=arith_tools's policy (model_configs/arith_tools/policy), ~6 min: the bundled policy's cold start on
    # calculator demonstrations (`make_stage_data.py --kind tool_sft`), half of them answered without a call
    .venv/bin/python tools/tool_tokenizer.py --tokenizer_dir model_configs/arith/policy \
        --output model_configs/arith_tools/policy
    .venv/bin/python tools/sft_policy.py --model_yaml model_configs/arith_tools/train.yaml \
        --tokenizer_dir model_configs/arith_tools/policy --tools calculator --start_from model_configs/arith/policy \
        --data examples/qwen_grpo_tutorial/data/tool_arithmetic_train.jsonl \
        --eval_data examples/qwen_grpo_tutorial/data/tool_arithmetic_heldout.jsonl --steps 0 --direct_steps 300 \
        --batch_size 16 --learning_rate 1e-3 --direct_fraction 0.5 --max_length 336 \
        --output model_configs/arith_tools/policy

The second phase starts from the first one's last checkpoint (fresh AdamW moments, no warmup). The stages' runs,
data and logs stay in `--work_dir`. The output is written atomically; a rerun with the same arguments on the same
machine rebuilds it bit-identically (fixed seeds).
"""
from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

from mindrlhf.checkpoint.weights import read_weights
from mindrlhf.cli import prepare_data
from mindrlhf.data.mindrecord import read_problems
from mindrlhf.models.qwen2.convert import convert_hf_to_ms, convert_ms_to_hf, save_ms_checkpoint
from mindrlhf.trainer.plan import model_world_size
from mindrlhf.utils.jobs import msrun_command, msrun_env, run_job_command, worker_log_tails
from mindrlhf.utils.logging import setup_logging

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("mindrlhf.tools.sft_policy")
TINY = ROOT / "model_configs" / "tiny"
DATA = ROOT / "examples" / "qwen_grpo_tutorial" / "data"
TOOL_TURN_TOKENS = 64  # a tool turn's tokens in the held-out evaluation (model_configs/arith_tools/grpo.yaml's)


def conversations(problems: str, output: Path, direct_fraction: float, seed: int, tokenizer_dir: str,
                  max_length: int, kind: str = "sft") -> Path:
    """`problems` as an SFT MindRecord next to `output` (.jsonl of chat messages first; `kind` tool_sft: calculator
    demonstrations); returns the MindRecord."""
    command = [sys.executable, str(DATA / "make_stage_data.py"), "--kind", kind, "--input", str(problems),
               "--output", str(output), "--direct_fraction", str(direct_fraction), "--seed", str(seed)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    record = output.with_suffix(".mindrecord")
    code = prepare_data.main(["--kind", "sft", "--tokenizer_dir", tokenizer_dir, "--file_path", str(output),
                              "--output_path", str(record), "--max_length", str(max_length)])
    if code != 0:
        raise SystemExit(f"error: tokenising {output} failed")
    return record


def run_sft(args: argparse.Namespace, data: Path, out: Path, steps: int, warmup_steps: int,
            start: Path | None, eval_data: Path | None) -> Path:
    """One `mindrlhf-sft` run of `steps` updates on `data` into `out` (from random weights, or from the step folder
    `start`); returns its last step folder."""
    flags = ["--sft_path_train", args.model_yaml, "--tokenizer_dir", args.tokenizer_dir,
             "--mind_dataset_dir", str(data), "--output_dir", str(out), "--steps", str(steps),
             "--batch_size", str(args.batch_size), "--learning_rate", str(args.learning_rate),
             "--warmup_steps", str(warmup_steps), "--lr_schedule", "constant", "--weight_decay", "0",
             "--max_grad_norm", "1.0", "--seed", str(args.seed), "--save_interval", "0", "--keep_last", "1"]
    flags += ["--eval_fraction", "0"] + (["--eval_dataset_file", str(eval_data)] if eval_data else [])
    flags += ["--load_sft_checkpoint_train", str(start)] if start else []
    log_dir = out / "msrun_log"
    logger.info("mindrlhf-sft: %d updates on %s -> %s (worker logs in %s)", steps, data.name, out, log_dir)
    command = msrun_command(Path(sys.executable).parent / "mindrlhf-sft", flags, model_world_size(args.model_yaml),
                            log_dir)
    result = run_job_command(command, env=msrun_env())
    if result.returncode != 0:
        raise SystemExit(f"error: mindrlhf-sft into {out} failed ({result.returncode}):{worker_log_tails(log_dir)}")
    log = (log_dir / "worker_0.log").read_text(errors="replace")
    summary = [line.split("trainer: ", 1)[1] for line in log.splitlines() if "trainer: held-out loss: " in line]
    logger.info("%s: %s", out.name, summary[-1] if summary else "done")
    return out / "checkpoints" / f"step_{steps:06d}"


def save_policy(step_dir: Path, model_yaml: str, output: str, tokenizer_dir: str) -> None:
    """A `.ckpt` path gets a MindSpore checkpoint of the step folder's policy, anything else a Hugging Face folder
    (with the tokenizer)."""
    weights = read_weights(str(step_dir))
    if output.endswith(".ckpt"):
        save_ms_checkpoint(weights, output)
    else:
        convert_ms_to_hf(step_dir, model_yaml, output, weights=weights, tokenizer_dir=tokenizer_dir)


def heldout_accuracy(model_yaml: str, step_dir: Path, tokenizer_dir: str, problems_path: str,
                     batch_size: int = 50, tools: list[str] | None = None) -> float:
    """Greedy accuracy of the step folder's policy on every problem of `problems_path` (the r1_think prompt; with
    `tools`, the chat template's prompt offering them, and the rollout calling them: one tool turn)."""
    import mindspore as ms

    from mindrlhf.configs.generation import GenerationConfig
    from mindrlhf.data.templates import build_prompt
    from mindrlhf.generation import Generator
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.tokenizer import load_tokenizer
    from mindrlhf.tool_use import ToolRunner, ToolTurns, load_tools
    from mindrlhf.trainer.evaluation import count_correct

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    model = Qwen2ForCausalLM(Qwen2Config.from_yaml(model_yaml))
    ms.load_param_into_net(model, {k: ms.Parameter(v, name=k) for k, v in read_weights(str(step_dir)).items()},
                           strict_load=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    problems = list(read_problems(problems_path))
    turns = ToolTurns(ToolRunner(load_tools(tools)), tokenizer, TOOL_TURN_TOKENS) if tools else None
    schemas = [tool.schema for tool in turns.runner.tools.values()] if turns else None
    prompts = [tokenizer.encode(build_prompt(p.question, "chat" if tools else "r1_think", tokenizer.apply_chat_template,
                                             tools=schemas)) for p in problems]
    width = -(-max(len(p) for p in prompts) // 16) * 16
    tool_tokens = TOOL_TURN_TOKENS if tools else 0
    generator = Generator(model, GenerationConfig(
        max_new_tokens=min(model.config.seq_length - width - tool_tokens, 256), num_generations=1, do_sample=False,
        eos_token_ids=tokenizer.stop_token_ids, pad_token_id=tokenizer.pad_token_id, prompt_buckets=[width],
        max_tool_calling_iterations=1 if tools else 0, max_tool_response_tokens=TOOL_TURN_TOKENS), tools=turns)
    return count_correct(generator, tokenizer, prompts, [p.answer for p in problems], batch_size) / len(problems)


def build(args: argparse.Namespace) -> Path:
    """The phases of the recipe; returns the last step folder."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    kind = "tool_sft" if args.tools else "sft"
    held = conversations(args.eval_data, work / "heldout.jsonl", 0.0, args.seed, args.tokenizer_dir,
                         args.max_length, kind) if args.eval_data else None
    step_dir = start_checkpoint(args.start_from, args.model_yaml, work) if args.start_from else None
    if args.steps:
        worked = conversations(args.data, work / "worked.jsonl", 0.0, args.seed, args.tokenizer_dir, args.max_length,
                               kind)
        step_dir = run_sft(args, worked, work / "worked", args.steps, args.warmup_steps, step_dir, held)
    if args.direct_steps:
        mixed = conversations(args.data, work / "direct.jsonl", args.direct_fraction, args.seed, args.tokenizer_dir,
                              args.max_length, kind)
        step_dir = run_sft(args, mixed, work / "direct", args.direct_steps, 0, step_dir, held)
    return step_dir


def start_checkpoint(model_dir: str, model_yaml: str, work: Path) -> Path:
    """The Hugging Face policy folder `model_dir` as a MindSpore checkpoint in `work`, for the first run to start
    from."""
    path = work / "start.ckpt"
    convert_hf_to_ms(model_dir, str(path), config_path=model_yaml)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_yaml", default=str(TINY / "model.yaml"), help="model YAML: the net and its layout")
    parser.add_argument("--tokenizer_dir", default=str(TINY / "tokenizer"), help="the tokenizer's folder")
    parser.add_argument("--data", default=str(DATA / "gsm8k_sample.jsonl"), help="GSM8K-style training problems")
    parser.add_argument("--eval_data", default=None,
                        help="held-out problems: the stages' eval/loss, and the greedy accuracy at the end")
    parser.add_argument("--steps", type=int, default=400, help="updates on the worked solutions")
    parser.add_argument("--direct_steps", type=int, default=0,
                        help="updates after them in which --direct_fraction of the problems (a seeded choice) are "
                             "answered without the working")
    parser.add_argument("--direct_fraction", type=float, default=0.5)
    parser.add_argument("--tools", nargs="*", default=[],
                        help="tool-use demonstrations instead of worked solutions (make_stage_data.py --kind "
                             "tool_sft; the calculator), evaluated with the tools called")
    parser.add_argument("--start_from", default="",
                        help="a Hugging Face policy folder the first run starts from (default: random weights)")
    parser.add_argument("--batch_size", type=int, default=8, help="conversations an update")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="constant after the warmup")
    parser.add_argument("--warmup_steps", type=int, default=0)
    parser.add_argument("--max_length", type=int, default=2048, help="longer tokenised conversations are dropped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work_dir", default=str(ROOT / "output" / "sft_policy"),
                        help="the stages' data, runs and logs")
    parser.add_argument("--output", default=str(TINY / "tiny_sft.ckpt"),
                        help="a .ckpt file, or a folder for a Hugging Face model (config.json + model.safetensors)")
    args = parser.parse_args(argv)
    setup_logging()
    step_dir = build(args)
    save_policy(step_dir, args.model_yaml, args.output, args.tokenizer_dir)
    logger.info("wrote %s from %s", args.output, step_dir)
    if args.eval_data:
        accuracy = heldout_accuracy(args.model_yaml, step_dir, args.tokenizer_dir, args.eval_data, tools=args.tools)
        logger.info("held-out greedy accuracy: %.1f%%", 100 * accuracy)


if __name__ == "__main__":
    main()
