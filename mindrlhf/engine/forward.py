"""The forward engine: a scoring cell (log-probs, values, reward-model scores) over a rank's rows, in sized
micro-batches, plain or through pipeline stages."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mindrlhf.algorithms.policy_cells import (
    PACKED_COLUMNS,
    ResponseHidden,
    response_hidden_shape,
    response_values_shape,
)
from mindrlhf.engine.sizing import RESPONSE_COLUMNS, MicroBatchSizer
from mindrlhf.parallel.layers import to_ms_dtype
from mindrlhf.parallel.pipeline import PipelineForward


def check_response_cell(cell) -> None:
    """Engines hand a cell the columns it declares (`cell.INPUTS`); the response columns come first (or, for packed
    rows, which have no prompt, `PACKED_COLUMNS`)."""
    inputs = tuple(getattr(cell, "INPUTS", ()))
    if not any(inputs[:len(first)] == first for first in (RESPONSE_COLUMNS, PACKED_COLUMNS)):
        raise TypeError(f"{type(cell).__name__}.INPUTS must start with {RESPONSE_COLUMNS} or {PACKED_COLUMNS}, "
                        f"got {inputs}")


class ForwardEngine:
    """`run(columns)` gives the output of `cell` for every row of `columns` (a mapping from column name to array,
    e.g. an `Experience`), one micro-batch of `sizer`'s plan per graph call, outputs concatenated (per-token outputs
    padded back to the responses' width with zeros: the positions cut were padding).

    With pipeline stages (`layout.pp > 1`) the cell runs on the last stage and `net`'s hidden states of the response
    positions (`ResponseHidden`) on the stages before it, every micro-batch at once so that the stages overlap; the
    last stage's per-token output ([rows, R]) reaches every stage."""

    def __init__(self, cell, sizer: MicroBatchSizer, net=None, layout=None, model_config=None):
        check_response_cell(cell)
        self.cell, self.sizer, self.columns = cell, sizer, tuple(cell.INPUTS)
        self.pipeline = None
        if layout is not None and layout.pp > 1:
            self.pipeline = _pipeline_forward(cell, net, layout, model_config)

    def run(self, columns: Mapping[str, np.ndarray], first_row: int = 0) -> np.ndarray:
        """The output for every row of `columns`, rows `first_row`.. of their experience (where its prompt groups
        begin: a row j G + i is response i of prompt j)."""
        micro_batches = self.sizer.split(columns, first_row=first_row, names=self.columns)
        if self.pipeline is not None:
            outputs = self.pipeline.map(micro_batches)
        else:
            outputs = [self.cell(*inputs) for inputs in micro_batches]
        out = np.concatenate([output.asnumpy() for output in outputs])
        full = columns["response_ids"].shape[1]
        if out.ndim == 2 and out.shape[1] < full:
            out = np.pad(out, ((0, 0), (0, full - out.shape[1])))
        return out


def _pipeline_forward(cell, net, layout, model_config):
    """`PipelineForward` of `cell` (a per-token output, [rows, R]) on the last stage of `net`'s stages."""
    last = layout.stage == layout.pp - 1
    return PipelineForward(cell if last else ResponseHidden(net), layout,
                           response_hidden_shape(model_config.hidden_size), to_ms_dtype(model_config.compute_dtype),
                           response_values_shape)
