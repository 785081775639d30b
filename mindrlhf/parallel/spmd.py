"""Explicit-SPMD training cells: gradients averaged over the data-parallel group, then the optimizer."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

from mindrlhf.parallel.comm import DataParallelGradReducer
from mindrlhf.parallel.layers import param_split_axes
from mindrlhf.parallel.layout import Layout


class SPMDGradients(nn.Cell):
    """`(outputs, grads, grad_norm)` of a loss net returning `(loss, *stats)`, gradients reduced over dp.

    Tensor-parallel layers already produce correct shard gradients through their custom bprops, so only
    data parallel needs a reduction here: `grad_reduction="mean"` when each dp rank's loss is a mean over
    its own rows, `"sum"` when each rank's loss is its share of one globally normalised loss.
    `grad_norm` is the global norm of the whole (unsplit) model's gradient: the squares of tp-split shards
    are summed over the tp group, replicated parameters count once. With `max_grad_norm > 0` the gradients
    are scaled by min(1, max_grad_norm / (grad_norm + 1e-6)), as `torch.nn.utils.clip_grad_norm_`.
    """

    def __init__(self, loss_net: nn.Cell, params, layout: Layout | None = None, grad_reduction: str = "mean",
                 max_grad_norm: float = 0.0):
        super().__init__(auto_prefix=False)
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 = no clipping), got {max_grad_norm}")
        layout = layout or Layout()
        self.loss_net = loss_net
        self.grad_fn = ops.value_and_grad(loss_net, None, params, has_aux=True)
        self.grad_reducer = DataParallelGradReducer(layout.dp_group, layout.dp, mean=grad_reduction == "mean")
        axes = param_split_axes(loss_net)
        self.split = tuple(layout.tp > 1 and axes.get(p.name) is not None for p in params)
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, layout.tp_group) if layout.tp > 1 else None
        self.max_grad_norm = float(max_grad_norm)

    def _global_norm(self, grads):
        replicated = ops.zeros((), ms.float32)
        split = ops.zeros((), ms.float32)
        for i in range(len(grads)):
            square = ops.square(grads[i].astype(ms.float32)).sum()
            if self.split[i]:
                split = split + square
            else:
                replicated = replicated + square
        if self.tp_sum is not None:
            split = self.tp_sum(split)
        return ops.sqrt(replicated + split)

    def construct(self, *inputs):
        outputs, grads = self.grad_fn(*inputs)
        grads = self.grad_reducer(grads)
        grad_norm = self._global_norm(grads)
        if self.max_grad_norm > 0:
            scale = ops.minimum(self.max_grad_norm / (grad_norm + 1e-6), 1.0)
            grads = tuple(g * scale.astype(g.dtype) for g in grads)
        return outputs, grads, grad_norm


class SPMDTrainStep(nn.Cell):
    """One optimizer step under explicit SPMD: :class:`SPMDGradients`, then the optimizer.

    Returns `(outputs, grad_norm)` (the norm before clipping).
    """

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Cell, layout: Layout | None = None,
                 grad_reduction: str = "mean", max_grad_norm: float = 0.0):
        super().__init__(auto_prefix=False)
        self.gradients = SPMDGradients(loss_net, optimizer.parameters, layout, grad_reduction, max_grad_norm)
        self.optimizer = optimizer

    def construct(self, *inputs):
        outputs, grads, grad_norm = self.gradients(*inputs)
        self.optimizer(grads)
        return outputs, grad_norm
