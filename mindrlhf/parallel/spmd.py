"""Explicit-SPMD training cells: gradients averaged over the data-parallel group, then the optimizer."""
from __future__ import annotations

from mindspore import nn, ops

from mindrlhf.parallel.comm import DataParallelGradReducer
from mindrlhf.parallel.layout import Layout


class SPMDGradients(nn.Cell):
    """`(outputs, grads)` of a loss net returning `(loss, *stats)`, gradients reduced over the dp group.

    Tensor-parallel layers already produce correct shard gradients through their custom bprops, so only
    data parallel needs a reduction here: `grad_reduction="mean"` when each dp rank's loss is a mean over
    its own rows, `"sum"` when each rank's loss is its share of one globally normalised loss.
    """

    def __init__(self, loss_net: nn.Cell, params, layout: Layout | None = None, grad_reduction: str = "mean"):
        super().__init__(auto_prefix=False)
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        layout = layout or Layout()
        self.loss_net = loss_net
        self.grad_fn = ops.value_and_grad(loss_net, None, params, has_aux=True)
        self.grad_reducer = DataParallelGradReducer(layout.dp_group, layout.dp, mean=grad_reduction == "mean")

    def construct(self, *inputs):
        outputs, grads = self.grad_fn(*inputs)
        return outputs, self.grad_reducer(grads)


class SPMDTrainStep(nn.Cell):
    """One optimizer step under explicit SPMD: :class:`SPMDGradients`, then the optimizer. Returns the outputs."""

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Optimizer, layout: Layout | None = None):
        super().__init__(auto_prefix=False)
        self.gradients = SPMDGradients(loss_net, optimizer.parameters, layout)
        self.optimizer = optimizer

    def construct(self, *inputs):
        outputs, grads = self.gradients(*inputs)
        self.optimizer(grads)
        return outputs
