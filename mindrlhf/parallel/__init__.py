"""Explicit SPMD parallelism: layouts, tensor-parallel layers, strategy files, online reshard, host swap."""
from mindrlhf.parallel.layout import DP_AXIS, NOT_SPLIT, TP_AXIS, Layout, LayoutError

__all__ = ["DP_AXIS", "NOT_SPLIT", "TP_AXIS", "Layout", "LayoutError"]
