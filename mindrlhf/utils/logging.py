"""One logger setup for every entry point: rank-tagged lines, per-step metrics on one line."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: int | str = logging.INFO, rank: int | None = None) -> logging.Logger:
    """Configures the `mindrlhf` logger to stderr (msrun writes each rank's stderr to its own log)."""
    if rank is None:
        rank = int(os.environ.get("RANK_ID", os.environ.get("MS_NODE_ID", 0)) or 0)
    logger = logging.getLogger("mindrlhf")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


def format_metrics(metrics: Mapping[str, object], precision: int = 4, units: Mapping[str, str] | None = None) -> str:
    """`name value | name value unit ...` with floats at a fixed number of significant digits; `units` maps a
    name to the unit written after its value."""
    parts = []
    for name, value in metrics.items():
        text = f"{value:.{precision}g}" if isinstance(value, float) else f"{value}"
        unit = (units or {}).get(name)
        parts.append(f"{name} {text} {unit}" if unit else f"{name} {text}")
    return " | ".join(parts)
