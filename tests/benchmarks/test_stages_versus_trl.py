"""benchmarks/stages_versus_trl.py's pure parts: a run's summary and the table's ratios. No TRL needed."""
from __future__ import annotations

import pytest

from benchmarks import stages_versus_trl as svt


def run_of(seconds, tokens, prepare_s=0.0, peak=2.0):
    return {"steps": [{"timing/step": s, "perf/tokens": t} for s, t in zip(seconds, tokens)],
            "prepare_s": prepare_s, "peak_rss_gib": peak, "wall_s": sum(seconds) + prepare_s}


def test_a_runs_summary_leaves_out_its_first_step_and_adds_its_reference_passes_share():
    """Steps 2 and 3 read 2500 tokens in 5 s; ours' DPO reference pass (6 s for the 3 steps' pairs) adds 2/3 of it."""
    plain = svt.summary(run_of([10.0, 2.0, 3.0], [100, 1000, 1500]), steps=3)
    assert plain["tokens_per_s"] == pytest.approx(2500 / 5) and plain["first_step_s"] == 10.0
    assert plain["tokens_per_step"] == 1250 and plain["step_s"] == pytest.approx(2.5)
    dpo = svt.summary(run_of([10.0, 2.0, 3.0], [100, 1000, 1500], prepare_s=6.0), steps=3)
    assert dpo["tokens_per_s"] == pytest.approx(2500 / 9) and dpo["prepare_s"] == 6.0


def test_the_table_gives_ours_over_each_side():
    ours = svt.summary(run_of([9.0, 1.0, 1.0], [0, 300, 300], peak=3.0), steps=3)
    trl = svt.summary(run_of([9.0, 2.0, 2.0], [0, 300, 300], peak=6.0), steps=3)
    lines = svt.table({"sft": {"ours": ours, "trl": trl}}).splitlines()
    assert lines[0].split()[:4] == ["stage", "side", "tokens/s", "ours/side"]
    assert lines[2].split()[:4] == ["sft", "ours", "300", "-"]
    assert lines[3].split()[:6] == ["sft", "trl", "150", "2.00", "6.00", "0.50"]  # twice the speed, half the memory
