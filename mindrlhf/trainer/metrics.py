"""A step's metrics and their sinks: one line per step in the log, JSONL in the output folder, optional
TensorBoard events. docs/metrics.md is the table of every metric the trainer writes (its test checks it).

Names follow MindSpeed-RL's (and verl's) where the quantity is the same: `critic/score/*`, `actor/pg_clipfrac`,
`timing/<phase>`, `e2e_tps`, ...; one name per quantity, the same in the log line, JSONL and TensorBoard.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterable, Mapping

import numpy as np

from mindrlhf.algorithms import dynamic_sampling_mask, explained_variance
from mindrlhf.data.experience import REWARD_TERM_PREFIX, Experience
from mindrlhf.utils.logging import format_metrics

logger = logging.getLogger("mindrlhf.trainer")

# The per-step log line: these metrics when the step has them, in this order, then each reward term `reward/<fn>`
# and each other held-out score `eval/<score>`. JSONL and TensorBoard get every metric.
LINE_METRICS = (
    "critic/score/mean", "critic/score/std", "actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/entropy",
    "actor/grad_norm", "actor/lr", "critic/vf_loss", "critic/vf_explained_var", "response_length/mean",
    "response_length/clip_ratio", "num_turns/mean", "tool/call_share", "sft/loss", "sft/grad_norm", "sft/lr",
    "reward_model/loss", "reward_model/accuracy", "reward_model/margin", "reward_model/grad_norm", "dpo/loss",
    "rewards/accuracies", "rewards/margins", "dpo/grad_norm", "timing/step", "e2e_tps", "eval/accuracy",
)
LINE_UNITS = {"timing/step": "s"}
TOOL_PREFIX = "tool/"
TOOL_COUNTS = ("tool/calls", "tool/errors", "tool/timeouts", "tool/truncated")  # a response's calls, by outcome
NOT_ON_THE_LINE = ("reward/frac_zero_std",)
# metrics that measure the machine (clock, throughput, memory), not the job: names or name prefixes
MACHINE_METRICS = ("timing/", "perf/", "memory/", "e2e_tps", "update_tps", "vllm_tps")
# what a resumed run need not give again on the steps it shares with the run it resumes (docs/metrics.md): the
# machine's metrics, and swap/bytes_moved, which counts the moves from what was on device when the step began, and a
# fresh process starts its first step from another residency than the run that went on
NOT_REPRODUCED_ON_RESUME = (*MACHINE_METRICS, "swap/bytes_moved")


def step_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    """`step 3/40 | critic/score/mean 0.75 | ... | reward/accuracy 0.25 | eval/hash_format 0.5`."""
    shown: dict = {"step": f"{step}/{total_steps}"}
    shown.update({key: metrics[key] for key in LINE_METRICS if key in metrics})
    shown.update({key: value for key, value in metrics.items() if key.startswith(("reward/", "eval/"))
                  and key not in shown and key not in NOT_ON_THE_LINE})
    return format_metrics(shown, units=LINE_UNITS)


def score_metrics(scores: np.ndarray, terms: Mapping[str, np.ndarray], group_size: int) -> dict:
    """`critic/score/{mean,std,max,min}` of the responses' sequence scores (each the weighted sum of its reward
    terms, before any KL penalty), each term's mean `reward/<fn>` (NaN where the function had no opinion on any
    response) and `reward/frac_zero_std`, the share of prompt groups whose responses all scored the same."""
    scores = np.asarray(scores, np.float64)
    metrics = {"critic/score/mean": float(scores.mean()), "critic/score/std": float(scores.std()),
               "critic/score/max": float(scores.max()), "critic/score/min": float(scores.min())}
    with np.errstate(invalid="ignore"):  # a term may be NaN where its function had no opinion (None)
        metrics.update({f"reward/{name}": float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
                        for name, values in terms.items()})
    metrics["reward/frac_zero_std"] = float(1.0 - dynamic_sampling_mask(scores, group_size).mean())
    return metrics


def row_statistics(exp, eos_token_ids: Iterable[int]):
    """Per response, what the step's metrics read (an `Experience` of 1-D columns, cheap to gather): its score
    `rewards` and reward terms, `response_length` (tokens, the end token included), `prompt_length` (unpadded) and
    `clipped` (cut at the response width without an end token); with tools also `model_length` (the model's own
    tokens), `num_turns` and the `tool/*` counts of each response's calls."""
    lengths = exp.response_mask.sum(axis=1)
    last = exp.response_ids[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
    clipped = (lengths == exp.response_mask.shape[1]) & ~np.isin(last, list(eos_token_ids))
    terms = {name: exp[name] for name in exp if name.startswith(REWARD_TERM_PREFIX)}
    tools = {name: exp[name] for name in exp if name.startswith(TOOL_PREFIX) or name == "num_turns"}
    if tools:
        tools["model_length"] = exp.loss_mask.sum(axis=1)
    return Experience({"rewards": exp.rewards, **terms, "response_length": lengths,
                       "prompt_length": exp.prompt_mask.sum(axis=1), "clipped": clipped, **tools})


def token_count(rows) -> int:
    """The prompt and response tokens of the responses of `rows` (`row_statistics`)."""
    return int(rows.prompt_length.sum() + rows.response_length.sum())


def length_metrics(rows) -> dict:
    """`response_length/{mean,max,min}` (tokens, the end token included; with tools the model's own tokens only),
    `response_length/clip_ratio` (the share of responses cut at the response width without an end token) and
    `prompt_length/{mean,max,min}` (unpadded prompt tokens; every prompt has the same number of rows, so these are the
    prompts' own), from `rows` (`row_statistics`)."""
    lengths = rows.model_length if "model_length" in rows else rows.response_length
    prompts = rows.prompt_length
    return {"response_length/mean": float(lengths.mean()), "response_length/max": int(lengths.max()),
            "response_length/min": int(lengths.min()), "response_length/clip_ratio": float(rows.clipped.mean()),
            "prompt_length/mean": float(prompts.mean()), "prompt_length/max": int(prompts.max()),
            "prompt_length/min": int(prompts.min())}


def tool_metrics(rows, tool_seconds: Iterable[float]) -> dict:
    """A multi-turn step's `num_turns/{mean,max,min}` (the model's turns a response), `tool/calls`, `tool/errors`,
    `tool/timeouts`, `tool/truncated` (the step's calls, and those that failed so) and `tool/call_share` (the share of
    responses that called a tool), from `rows` (`row_statistics`), and `timing/tools`, the largest of the ranks'
    `tool_seconds` (within their timing/generate); nothing for a job without tools."""
    if "num_turns" not in rows:
        return {}
    turns = rows.num_turns
    metrics = {"num_turns/mean": float(turns.mean()), "num_turns/max": int(turns.max()),
               "num_turns/min": int(turns.min())}
    metrics.update({name: int(rows[name].sum()) for name in TOOL_COUNTS})
    metrics["tool/call_share"] = float((rows["tool/calls"] > 0).mean())
    metrics["timing/tools"] = round(float(np.max(np.asarray(list(tool_seconds), np.float64))), 4)
    return metrics


def throughput_metrics(step_tokens: int, trained_tokens: int, world_size: int,
                       timings: Mapping[str, float]) -> dict:
    """Tokens per second per device, MindSpeed-RL's three: `e2e_tps` (the step's prompt + response tokens over
    `timing/step`), `update_tps` (the tokens the actor's updates read over `timing/train`; none without an
    update) and `vllm_tps` (the step's tokens over `timing/generate`: the generator's, there is no vLLM here)."""
    metrics = {}
    for name, tokens, phase in (("e2e_tps", step_tokens, "step"), ("update_tps", trained_tokens, "train"),
                                ("vllm_tps", step_tokens, "generate")):
        seconds = timings.get(f"timing/{phase}", 0.0)
        if tokens and seconds > 0:
            metrics[name] = round(tokens / world_size / seconds, 2)
    return metrics


def memory_metrics(rank_peaks_gib: Iterable[float]) -> dict:
    """`perf/max_rss_gib` (the largest rank's peak RSS) and `perf/sum_rss_gib` (what the job's ranks hold together
    at most). Each peak is rounded to MiB-ish precision before the sum, so the sum never exceeds the number of
    ranks times the logged max."""
    peaks = [round(float(peak), 3) for peak in rank_peaks_gib]
    return {"perf/max_rss_gib": max(peaks), "perf/sum_rss_gib": round(sum(peaks), 3)}


def rollout_rank_metrics(generate_seconds: Iterable[float], computed_rows: Iterable[float],
                         idle_rows: Iterable[float]) -> dict:
    """Over every rank's rollouts of a step: `perf/idle_decode_rows`, the share of all the decode rows computed for
    a response that had already ended or for an empty slot, and `timing/generate_spread`, the slowest rank's
    generation seconds minus the fastest's (what the others wait for at the gather)."""
    computed, seconds = float(np.sum(computed_rows)), np.asarray(generate_seconds, np.float64)
    return {"perf/idle_decode_rows": round(float(np.sum(idle_rows)) / computed, 4) if computed else 0.0,
            "timing/generate_spread": round(float(seconds.max() - seconds.min()), 4)}


def critic_metrics(values: np.ndarray, returns: np.ndarray, advantages: np.ndarray,
                   response_mask: np.ndarray) -> dict:
    """PPO: `critic/{values,returns,advantages}/{mean,max,min}` over the response tokens and
    `critic/vf_explained_var`."""
    valid = response_mask > 0
    metrics = {}
    for name, array in (("values", values), ("returns", returns), ("advantages", advantages)):
        tokens = array[valid]
        metrics.update({f"critic/{name}/mean": float(tokens.mean()), f"critic/{name}/max": float(tokens.max()),
                        f"critic/{name}/min": float(tokens.min())})
    metrics["critic/vf_explained_var"] = explained_variance(returns, values, response_mask)
    return metrics


class MetricsError(ValueError):
    """A step's metrics could not be written (a full disk, a file size limit): the job stops with one line."""


def summary_writer_class():
    """tensorboardX's `SummaryWriter` (1.5 s to import: only with --tensorboard_dir), imported without torch:
    tensorboardX's writer module imports torch whenever it is installed, which put ~190 MB on rank 0's RSS
    (measured on the bundled job) for scalars that never meet a torch tensor."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # `import torch` raises ImportError: tensorboardX's fallback
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules["torch"]
    return SummaryWriter


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
            truncate_after_step(self.jsonl_path, resume_step)
        if tensorboard_dir:
            self._tb = summary_writer_class()(tensorboard_dir, purge_step=resume_step + 1 if resume_step else None)

    def write(self, step: int, total_steps: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        logger.info(step_line(step, total_steps, metrics))
        self.record(step, metrics)

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """JSONL and TensorBoard only, no log line: for values outside a training step (the evaluation before
        the first step is recorded at step 0)."""
        if not self.enabled:
            return
        if self.jsonl_path:
            append_lines(self.jsonl_path, json.dumps({"step": step, **_plain(metrics)}) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def append_lines(path: str, line: str, what: str = "this step's metrics") -> None:
    """Appends `line` (one or more lines) whole or not at all: a write that fails (a full disk, a file size limit) is
    cut back off and raised as `MetricsError` naming `what` could not be written."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line)
    except OSError as err:
        try:
            os.truncate(path, size)
        except OSError:
            pass
        raise MetricsError(f"{path}: cannot write {what} ({err.strerror or err}); the lines before it "
                           "and the checkpoints are intact") from None


def _plain(metrics: Mapping[str, float]) -> dict:
    """`metrics` as JSON takes them: floats as Python floats, NaN and inf as None (JSON null: strict JSON has no
    NaN; the log line still shows nan)."""
    return {k: (float(v) if math.isfinite(v) else None) if isinstance(v, (float, np.floating)) else v
            for k, v in metrics.items()}


def truncate_after_step(path: str, step: int) -> None:
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
