"""TRL's side of `versus_trl.py`: one `GRPOTrainer` run of the job file the driver wrote, timed per phase.

Runs in the TRL virtualenv (`benchmarks/.venv-trl`, made by `versus_trl.py`), never in the project's: it imports
torch, transformers, trl and datasets, and from this repository only `mindrlhf.reward` (pure Python + numpy), so
both sides score completions with the same functions. That venv has no mindrlhf installed: the driver starts it with
the repository root as PYTHONPATH:

    PYTHONPATH=. benchmarks/.venv-trl/bin/python benchmarks/trl_side.py --job JOB.json --output_dir DIR

and writes `DIR/metrics.jsonl` (one line per GRPO step, keys named like the trainer's `metrics.jsonl`,
docs/metrics.md: `critic/score/mean`, `reward/<fn>`, `response_length/mean`, `timing/<phase>`, `e2e_tps`,
`perf/max_rss_gib`; plus TRL's own `timing/prepare` and `perf/tokens`, the step's prompt + completion tokens),
then prints one `RESULT {...}` line (versions, threads, peak RSS).

What a GRPO step is here: the trainer generates once for `steps_per_generation` optimizer updates, so a step is
that many updates; its time runs from the first update's `on_step_begin` to the last one's `on_step_end`. Phases
are timed by overriding the trainer's methods (TRL 1.16): `_generate_single_turn` (generate), the no-grad calls of
`_get_per_token_logps_and_entropies` (ref, and old when the updates of a batch are more than one),
`_calculate_rewards` (reward) and `_prepare_inputs` (all of generation and scoring); `train` is the step minus
`_prepare_inputs`, i.e. the forward/backward passes and the optimizer steps.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from collections import defaultdict
from contextlib import contextmanager


def read_job(argv=None, description: str = __doc__.splitlines()[0]) -> tuple[argparse.Namespace, dict]:
    """A TRL side's flags (`--job`, `--output_dir`) and its job file; OMP's threads set from it before torch loads."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--job", required=True, help="job file written by the benchmark's driver")
    p.add_argument("--output_dir", required=True)
    args = p.parse_args(argv)
    with open(args.job) as f:
        job = json.load(f)
    os.environ.setdefault("OMP_NUM_THREADS", str(int(job["torch_threads"])))
    return args, job


def print_result(versions: dict | None = None, **extra) -> None:
    """The side's last line, `RESULT {...}`: versions (with `versions`), threads and the process's peak RSS, with
    `extra`."""
    import torch
    import transformers
    import trl

    result = {"versions": {"trl": trl.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "python": platform.python_version(),
                           **(versions or {})},
              "torch_threads": torch.get_num_threads(),
              "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, **extra}
    print("RESULT " + json.dumps(result), flush=True)


def reward_function(name: str):
    """mindrlhf's reward `name` with TRL's calling convention (dataset columns arrive as keyword lists)."""
    from mindrlhf.reward import get_reward_function  # numpy only: no MindSpore in this venv

    fn = get_reward_function(name)

    def reward(completions, solution, **kwargs):
        return fn(list(completions), list(solution))

    reward.__name__ = name
    return reward


def main(argv=None) -> None:
    args, job = read_job(argv)
    threads = int(job["torch_threads"])

    import datasets
    import torch
    import trl.trainer.grpo_trainer as grpo_module
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    if job["keep_group_order"]:
        # TRL shuffles a generation batch's completions before cutting it into the updates' batches; mindrlhf's
        # updates take whole prompt groups in order. Keep TRL's order too, so that both update on the same groups.
        grpo_module.shuffle_sequence_dict = lambda batch: batch

    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer_dir"], padding_side="left")
    rows = job["rows"]
    for index, row in enumerate(rows):
        ids = tokenizer(text=row["prompt"])["input_ids"]
        if ids != row["prompt_ids"]:
            raise SystemExit(f"error: prompt {index}: transformers' token ids differ from rlhf_data.py's "
                             f"({len(ids)} vs {len(row['prompt_ids'])} tokens)")
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "solution": r["solution"]} for r in rows])

    model = AutoModelForCausalLM.from_pretrained(job["policy_dir"], dtype=torch.float32)
    peft_config = None
    if job.get("peft_lora"):  # LoRA: TRL's reference is then the model with its adapters off (use_adapter)
        import peft

        peft_config = peft.LoraConfig(task_type="CAUSAL_LM", **job["peft_lora"])
    in_reference = [False]  # inside TRL's use_adapter: the no-grad pass is the reference's
    adapter_switch = grpo_module.use_adapter

    @contextmanager
    def reference_adapter(*args, **kwargs):
        with adapter_switch(*args, **kwargs):
            in_reference[0] = True
            try:
                yield
            finally:
                in_reference[0] = False

    grpo_module.use_adapter = reference_adapter
    # stop where mindrlhf stops (the tokenizer's stop ids: <|im_end|> and <|endoftext|>); TRL takes its EOS list
    # (generation and completion masks) from the model's generation config plus the tokenizer's EOS
    model.generation_config.eos_token_id = list(job["stop_token_ids"])

    updates_per_step = int(job["updates_per_step"])
    warmup = int(job["warmup_steps"])
    timings: dict[str, float] = defaultdict(float)
    counters: dict[str, float] = defaultdict(float)

    @contextmanager
    def timed(name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            timings[name] += time.perf_counter() - start

    class TimedGRPOTrainer(GRPOTrainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            # mindrlhf's warmup: update k (0-based) gets lr * (k + 1) / warmup; transformers' constant_with_warmup
            # gives k / warmup (lr 0 at the first update)
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda k: min(1.0, (k + 1) / warmup) if warmup else 1.0)
            return self.lr_scheduler

        def _prepare_inputs(self, generation_batch):
            with timed("prepare"):
                return super()._prepare_inputs(generation_batch)

        def _generate_single_turn(self, prompt_ids, *rest, **kwargs):
            with timed("generate"):
                completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *rest, **kwargs)
            counters["prompt_tokens"] += sum(len(ids) for ids in prompt_ids)
            counters["response_tokens"] += sum(len(ids) for ids in completion_ids)
            counters["responses"] += len(completion_ids)
            return completion_ids, logprobs

        def _get_per_token_logps_and_entropies(self, model, *rest, **kwargs):
            if torch.is_grad_enabled():  # the loss's forward: part of the update
                return super()._get_per_token_logps_and_entropies(model, *rest, **kwargs)
            with timed("ref" if model is self.ref_model or in_reference[0] else "old"):
                return super()._get_per_token_logps_and_entropies(model, *rest, **kwargs)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            with timed("reward"):
                rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            weights = self.reward_weights.to(rewards.device)
            counters["reward_sum"] += float((rewards * weights).sum(dim=1).sum())
            for i, name in enumerate(self.reward_func_names):
                counters[f"reward_sum/{name}"] += float(rewards[:, i].sum())
            return rewards

    lines: list[dict] = []
    update_logs: dict[int, dict] = {}

    class StepTimer(TrainerCallback):
        start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % updates_per_step == 0:
                timings.clear()
                counters.clear()
                self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % updates_per_step:
                return
            elapsed = time.perf_counter() - self.start
            responses = counters["responses"] or 1
            tokens = counters["prompt_tokens"] + counters["response_tokens"]
            line = {"step": state.global_step // updates_per_step,
                    "critic/score/mean": counters["reward_sum"] / responses}
            line.update({f"reward/{k.split('/', 1)[1]}": v / responses for k, v in counters.items()
                         if k.startswith("reward_sum/")})
            line["response_length/mean"] = counters["response_tokens"] / responses
            for phase in ("generate", "reward", "ref", "old"):
                line[f"timing/{phase}"] = round(timings[phase], 4)
            line["timing/prepare"] = round(timings["prepare"], 4)
            line["timing/train"] = round(elapsed - timings["prepare"], 4)
            line["timing/step"] = round(elapsed, 4)
            line["perf/tokens"] = int(tokens)
            line["e2e_tps"] = round(tokens / elapsed, 2)  # one process: per device
            line["perf/max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
            lines.append(line)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                update_logs[state.global_step] = dict(logs)

    config = GRPOConfig(output_dir=os.path.join(args.output_dir, "trainer"), **job["trl_config"])
    trainer = TimedGRPOTrainer(model=model, reward_funcs=[reward_function(n) for n in job["reward_funcs"]],
                               args=config, train_dataset=dataset, processing_class=tokenizer,
                               callbacks=[StepTimer()], peft_config=peft_config)
    torch.set_num_threads(threads)
    trainer.train()

    for line in lines:  # the trainer's own per-update logs (loss, kl, grad_norm, learning_rate, ...)
        first = (line["step"] - 1) * updates_per_step + 1
        line["trl/updates"] = [update_logs.get(u, {}) for u in range(first, first + updates_per_step)]
        line["actor/lr"] = [log.get("learning_rate") for log in line["trl/updates"]]
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print_result({"datasets": datasets.__version__}, trainable_parameters=trainable,
                 eos_token_ids=list(trainer.eos_token_ids),
                 optimizer=type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__)

if __name__ == "__main__":
    main()
