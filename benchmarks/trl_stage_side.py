"""TRL's side of `stages_versus_trl.py`: one `SFTTrainer` (packed) or `DPOTrainer` run of the job file the driver
wrote, each update timed, in the TRL virtualenv (`benchmarks/.venv-trl`, made by `versus_trl.py`):

    benchmarks/.venv-trl/bin/python benchmarks/trl_stage_side.py --job JOB.json --output_dir DIR

writes `DIR/metrics.jsonl` (one line per optimizer update: `timing/step`, `perf/tokens` (the tokens the update's
forward passes read, padding left out), `loss`) and prints one `RESULT {...}` line (versions, threads, peak RSS).
The data is the JSONL of chat `messages` (SFT) or `prompt` / `chosen` / `rejected` messages (DPO) that mindrlhf's
side tokenised, read through the model's chat template by TRL itself.
"""
from __future__ import annotations

import json
import os
import resource
import time

from trl_side import print_result, read_job


def main(argv=None) -> None:
    args, job = read_job(argv, __doc__.splitlines()[0])
    threads = int(job["torch_threads"])

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    torch.set_num_threads(threads)
    with open(job["data"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32)
    mixed = job["side"] == "trl"  # TRL's defaults on this CPU: bf16 autocast, gradient checkpointing
    common = dict(output_dir=os.path.join(args.output_dir, "trainer"), max_steps=int(job["steps"]),
                  per_device_train_batch_size=int(job["batch_size"]), gradient_accumulation_steps=1,
                  learning_rate=float(job["learning_rate"]), lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, dataloader_num_workers=0, seed=int(job["seed"]), bf16=mixed,
                  gradient_checkpointing=mixed, max_length=int(job["max_length"]))
    tokens: list[int] = []

    def count(inputs) -> None:
        """The tokens a batch's forward passes read, padding left out (DPO: each pair's prompt twice, once before
        each answer, as TRL reads it)."""
        mask = inputs.get("attention_mask")
        tokens.append(int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel()))

    if job["stage"] == "sft":
        config = SFTConfig(packing=True, packing_strategy="bfd", **common)
        base = SFTTrainer
    else:
        config = DPOConfig(beta=float(job["beta"]), **common)
        base = DPOTrainer

    class CountingTrainer(base):
        def training_step(self, model, inputs, *rest, **kwargs):
            count(inputs)
            return super().training_step(model, inputs, *rest, **kwargs)

    lines: list[dict] = []

    class StepTimer(TrainerCallback):
        start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            lines.append({"step": state.global_step, "timing/step": round(time.perf_counter() - self.start, 4),
                          "perf/tokens": tokens[-1] if tokens else 0,
                          "perf/max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and lines and lines[-1]["step"] == state.global_step:
                lines[-1]["loss"] = float(logs["loss"])

    trainer = CountingTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                              callbacks=[StepTimer()])
    torch.set_num_threads(threads)
    trainer.train()
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(line) + "\n" for line in lines))
    print_result()

if __name__ == "__main__":
    main()
