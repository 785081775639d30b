"""Explicit SPMD parallelism: layouts, tensor-parallel layers, strategy files, online reshard, host swap.

Online resharding lives in :mod:`mindrlhf.parallel.reshard` (`reshard`, `Resharder`).
"""
from mindrlhf.parallel.layout import DP_AXIS, NOT_SPLIT, TP_AXIS, Layout, LayoutError
from mindrlhf.parallel.strategy import (
                                        ParamLayout,
                                        StrategyError,
                                        net_layouts,
                                        read_strategy_file,
                                        save_net_strategy,
                                        validate_pair,
                                        write_strategy_file,
)
from mindrlhf.parallel.swap import SwapError, SwapManager

__all__ = [
    "DP_AXIS", "NOT_SPLIT", "TP_AXIS",
    "Layout", "LayoutError", "ParamLayout", "StrategyError", "SwapError", "SwapManager", "net_layouts",
    "read_strategy_file", "save_net_strategy", "validate_pair", "write_strategy_file",
]

