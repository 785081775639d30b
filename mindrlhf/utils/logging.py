"""One logger setup for every entry point: rank-tagged lines, per-step metrics on one line."""
from __future__ import annotations

import logging
import os
import sys

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


def format_metrics(metrics: dict[str, float], precision: int = 4) -> str:
    """`name value | name value ...` with floats at a fixed number of significant digits."""
    parts = []
    for name, value in metrics.items():
        if isinstance(value, float):
            parts.append(f"{name} {value:.{precision}g}")
        else:
            parts.append(f"{name} {value}")
    return " | ".join(parts)
