"""Where the benchmarks find the repository's files: one spelling of each path they share."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ARITH = os.path.join(ROOT, "model_configs", "arith")
SMOLLM2 = os.path.join(ROOT, "model_configs", "smollm2")
SMOLLM2_MODEL_DIR = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
RUN_GRPO = os.path.join(ROOT, "run_grpo.sh")


def results_path(name: str) -> str:
    """benchmarks/results/`name`: where a benchmark writes its JSON unless told otherwise."""
    return os.path.join(RESULTS, name)
