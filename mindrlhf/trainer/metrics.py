"""Metrics sinks: one line per step in the log, JSONL in the output folder, optional TensorBoard events."""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping

from mindrlhf.utils.logging import format_metrics

logger = logging.getLogger("mindrlhf.trainer")

# The per-step log line: column name -> metric (everything goes to JSONL and TensorBoard). The README's
# "Reading the log" explains each column.
LINE_COLUMNS = {
    "reward": "reward/mean", "reward_std": "reward/std", "pg_loss": "actor/pg_loss", "kl": "actor/kl",
    "clipfrac": "actor/clipfrac", "entropy": "actor/entropy", "grad_norm": "actor/grad_norm", "lr": "actor/lr",
    "vf_loss": "critic/vf_loss", "vf_ev": "critic/vf_explained_var",
    "resp_len": "response_length/mean", "clip_ratio": "response_length/clip_ratio", "step_s": "timing_s/step",
    "tok/s/dev": "perf/tokens_per_s_per_device", "heldout_acc": "eval/accuracy",
}


class MetricsWriter:
    """Writes each step's metrics; only the rank that owns it (rank 0) writes anything."""

    def __init__(self, output_dir: str | None, tensorboard_dir: str | None = None, enabled: bool = True,
                 resume_step: int = 0):
        self.enabled = enabled
        self.jsonl_path = os.path.join(output_dir, "metrics.jsonl") if output_dir else None
        self._tb = None
        if not enabled:
            return
        if self.jsonl_path:
            os.makedirs(output_dir, exist_ok=True)
            _truncate_after_step(self.jsonl_path, resume_step)
        if tensorboard_dir:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(tensorboard_dir, purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, total_steps: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        shown = {"step": f"{step}/{total_steps}"}
        shown.update({column: metrics[key] for column, key in LINE_COLUMNS.items() if key in metrics})
        reward_terms = {k.split("/", 1)[1]: v for k, v in metrics.items()
                        if k.startswith("reward/") and k not in LINE_COLUMNS.values() and k != "reward/frac_zero_std"}
        shown.update(reward_terms)
        shown.update({f"heldout_{k.split('/', 1)[1]}": v for k, v in metrics.items()
                      if k.startswith("eval/") and k not in LINE_COLUMNS.values()})
        logger.info(format_metrics(shown))
        self.record(step, metrics)

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """JSONL and TensorBoard only, no log line: for values outside a training step (the evaluation before
        the first step is recorded at step 0)."""
        if not self.enabled:
            return
        if self.jsonl_path:
            with open(self.jsonl_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, **_plain(metrics)}) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _plain(metrics: Mapping[str, float]) -> dict:
    return {k: (float(v) if isinstance(v, float) else v) for k, v in metrics.items()}


def _truncate_after_step(path: str, step: int) -> None:
    """Keeps the JSONL lines of steps <= `step` (a resumed run rewrites what came after its checkpoint); a run
    from the start (`step` 0) starts an empty file."""
    if not os.path.exists(path):
        return
    if step == 0:
        open(path, "w", encoding="utf-8").close()
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)
