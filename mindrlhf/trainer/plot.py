"""A PNG of a run's progress (reward or loss per step, held-out scores at its evaluations) from `metrics.jsonl`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mindrlhf.utils.atomic import atomic_output


@dataclass(frozen=True)
class ProgressPanels:
    """What the two panels show: the training metrics per step (left) and the held-out ones (right, `eval/*`)."""

    train_keys: tuple[str, ...] = ("critic/score/mean", "reward/accuracy")
    train_title: str = "training reward"
    eval_title: str = "held-out, greedy (share of answers)"
    eval_in_percent: bool = True
    step_name: str = "GRPO step"


def progress_series(records: list[dict], train_keys=ProgressPanels.train_keys) -> dict[str, tuple[list, list]]:
    """(steps, values) of `train_keys`, `eval/accuracy` and any other held-out score `eval/<name>` (step 0 = before
    training).

    A step logged twice (a resumed run rewrote it) keeps its last record; a value written as null (NaN) is left
    out."""
    by_step: dict[int, dict] = {}
    for record in records:
        by_step.setdefault(int(record["step"]), {}).update(record)
    series = {}
    evals = sorted({key for r in records for key in r if key.startswith("eval/") and key != "eval/accuracy"})
    for key in (*train_keys, "eval/accuracy", *evals):
        points = [(step, float(r[key])) for step, r in sorted(by_step.items()) if r.get(key) is not None]
        series[key] = ([s for s, _ in points], [v for _, v in points])
    return series


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_progress(metrics_path: str, png_path: str, panels: ProgressPanels = ProgressPanels()) -> None:
    """Writes `png_path`: the training score (and its accuracy term; SFT: the loss) per step, held-out scores per
    evaluation, each labelled with its metric name."""
    import matplotlib  # only this plot needs it; the backend is chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = progress_series(read_metrics(metrics_path), panels.train_keys)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for key in panels.train_keys:  # RL: the score (weighted sum of the terms) and its accuracy
        steps, values = series[key]
        if steps:
            left.plot(steps, values, label=key, linewidth=1.2)
    left.set(title=panels.train_title, xlabel=panels.step_name)
    left.grid(alpha=0.3)
    for key, (steps, values) in series.items():
        if key.startswith("eval/") and steps:
            right.plot(steps, [100 * v for v in values] if panels.eval_in_percent else values, marker="o", label=key,
                       color="tab:green" if key == "eval/accuracy" else None)
    right.set(title=panels.eval_title, xlabel=f"{panels.step_name} (0 = before)",
              ylabel="%" if panels.eval_in_percent else "")
    right.grid(alpha=0.3)
    for axes in (left, right):
        if axes.get_legend_handles_labels()[0]:  # a run without a held-out set has nothing on the right
            axes.legend()
    os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
    with atomic_output(png_path, ".png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
