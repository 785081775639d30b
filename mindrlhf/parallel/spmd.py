"""Explicit-SPMD training cells: gradients reduced over the data-parallel group and clipped, then the optimizer;
whole batches in one graph or micro-batches with gradient accumulation."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer

from mindrlhf.optim import update_groups
from mindrlhf.parallel.comm import AllReduceInPlace, DataParallelGradReducer, SumInPlaceOnHost, check_dp_sums
from mindrlhf.parallel.layers import param_split_axes, param_split_shards
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.shared_memory import SharedMemoryGroup


def sum_of_squares(x):
    """Sum of the squares of all elements of `x`, by rows: on MindSpore's CPU backend a full reduction of a large
    tensor (an embedding gradient) is much slower than reducing the last axis first (`docs/performance.md`, "Where
    the tiny train step goes")."""
    if x.ndim < 2:
        return ops.square(x).sum()
    return ops.square(ops.norm(x, dim=-1)).sum()


class ReducedClippedGradients(nn.Cell):
    """This rank's gradients -> `(grads, grad_norm, clip_scale)`: reduced over dp, their global norm and the factor
    that clips them (None without clipping), which the caller applies (:class:`SPMDGradients`) or hands to the
    optimizer (:func:`step_if_finite`), so that no clipped copy of every gradient exists at once.

    Tensor-parallel layers already produce correct shard gradients through their custom bprops, so only
    data parallel needs a reduction here: `grad_reduction="mean"` when each dp rank's loss is a mean over
    its own rows, `"sum"` when each rank's loss is its share of one globally normalised loss.
    `grad_norm` is the global norm of the whole (unsplit) model's gradient: the squares of tp-split shards
    are summed over the tp group (a shard that tp peers share counted once), replicated parameters count once.
    With `max_grad_norm > 0` the clip factor is min(1, max_grad_norm / (grad_norm + 1e-6)), as
    `torch.nn.utils.clip_grad_norm_`. `reduced`: the gradients arrive reduced over dp already
    (`comm.AllReduceInPlace`). `counted_elsewhere` names parameters whose gradient another pipeline stage
    holds too (a tied embedding's, summed over the stages beforehand) and counts in the norm instead of this rank.
    `dp_sums`: the shared-memory group of `layout.dp_group` the dp sums go through
    (:mod:`mindrlhf.parallel.shared_memory`, CPU ranks on one host); None = MindSpore's AllReduce.
    """

    def __init__(self, loss_net: nn.Cell, params, layout: Layout | None = None, grad_reduction: str = "mean",
                 max_grad_norm: float = 0.0, counted_elsewhere=(), reduced: bool = False,
                 dp_sums: SharedMemoryGroup | None = None):
        super().__init__(auto_prefix=False)
        if grad_reduction not in ("mean", "sum"):
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {grad_reduction!r}")
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 = no clipping), got {max_grad_norm}")
        layout = layout or Layout()
        self.grad_reducer = None if reduced else DataParallelGradReducer(layout.dp_group, layout.dp,
                                                                         mean=grad_reduction == "mean",
                                                                         dp_sums=dp_sums)
        axes, shards = param_split_axes(loss_net), param_split_shards(loss_net, layout.tp)
        counted = [i for i, p in enumerate(params) if p.name not in counted_elsewhere]
        # the norm's terms as index tuples, so that its loops hold no `if` (graph mode nests a call per `if` in
        # an unrolled loop, past its call depth limit at a real model's ~300 parameters)
        self.split_terms = tuple(i for i in counted if layout.tp > 1 and axes.get(params[i].name) is not None)
        self.replicated_terms = tuple(i for i in counted if i not in self.split_terms)
        # a shard held by tp / shards peers appears that many times in the sum over the tp group
        self.share_weights = tuple(shards.get(params[i].name, layout.tp) / layout.tp for i in self.split_terms)
        self.tp_sum = ops.AllReduce(ops.ReduceOp.SUM, layout.tp_group) if layout.tp > 1 else None
        self.pp_sum = ops.AllReduce(ops.ReduceOp.SUM, layout.pp_group) if layout.pp > 1 else None  # stages' shares
        self.max_grad_norm = float(max_grad_norm)

    def _global_norm(self, grads):
        replicated = ops.zeros((), ms.float32)
        split = ops.zeros((), ms.float32)
        for k in range(len(self.split_terms)):
            split = split + sum_of_squares(grads[self.split_terms[k]].astype(ms.float32)) * self.share_weights[k]
        for k in range(len(self.replicated_terms)):
            replicated = replicated + sum_of_squares(grads[self.replicated_terms[k]].astype(ms.float32))
        if self.tp_sum is not None:
            split = self.tp_sum(split)
        total = replicated + split
        if self.pp_sum is not None:
            total = self.pp_sum(total)
        return ops.sqrt(total)

    def construct(self, grads):
        if self.grad_reducer is not None:
            grads = self.grad_reducer(grads)
        grad_norm = self._global_norm(grads)
        if self.max_grad_norm > 0:
            return grads, grad_norm, ops.minimum(self.max_grad_norm / (grad_norm + 1e-6), 1.0)
        return grads, grad_norm, None


class SPMDGradients(nn.Cell):
    """`(outputs, grads, grad_norm)` of a loss net returning `(loss, *stats)`: the gradients reduced over dp and
    clipped as :class:`ReducedClippedGradients` (whose arguments these are)."""

    def __init__(self, loss_net: nn.Cell, params, layout: Layout | None = None, grad_reduction: str = "mean",
                 max_grad_norm: float = 0.0, dp_sums: SharedMemoryGroup | None = None):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.grad_fn = ops.value_and_grad(loss_net, None, params, has_aux=True)
        self.finish = ReducedClippedGradients(loss_net, params, layout, grad_reduction, max_grad_norm,
                                              dp_sums=dp_sums)

    def construct(self, *inputs):
        outputs, grads = self.grad_fn(*inputs)
        grads, grad_norm, clip_scale = self.finish(grads)
        if clip_scale is not None:
            grads = tuple(g * clip_scale.astype(g.dtype) for g in grads)
        return outputs, grads, grad_norm


def step_if_finite(optimizer: nn.Cell, grads, grad_norm, clip_scale=None):
    """Runs `optimizer(grads)` (with a clip factor: `optimizer(grads, clip_scale)`, as `mindrlhf.optim.AdamW`
    takes it) only when `grad_norm` is finite: a NaN/inf loss or gradient (whose norm is then NaN/inf) leaves
    weights, moments and step count untouched. The norm is global (reduced over dp and tp), so every rank takes
    the same decision. A graph branch, not a select: no gradient-sized temporaries."""
    if ops.isfinite(grad_norm):
        if clip_scale is None:
            optimizer(grads)
        else:
            optimizer(grads, clip_scale)
    return grad_norm


class SPMDTrainStep(nn.Cell):
    """One optimizer step under explicit SPMD: the gradients reduced over dp and their norm
    (:class:`ReducedClippedGradients`), then the optimizer with the clip factor, skipped when the gradient norm is
    not finite (`step_if_finite`).

    Returns `(outputs, grad_norm)` (the norm before clipping). The arguments as :class:`ReducedClippedGradients`.
    """

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Cell, layout: Layout | None = None,
                 grad_reduction: str = "mean", max_grad_norm: float = 0.0, dp_sums: SharedMemoryGroup | None = None):
        super().__init__(auto_prefix=False)
        self.grad_fn = ops.value_and_grad(loss_net, None, optimizer.parameters, has_aux=True)
        self.finish = ReducedClippedGradients(loss_net, optimizer.parameters, layout, grad_reduction, max_grad_norm,
                                              dp_sums=dp_sums)
        self.optimizer = optimizer

    def construct(self, *inputs):
        outputs, grads = self.grad_fn(*inputs)
        grads, grad_norm, clip_scale = self.finish(grads)
        return outputs, step_if_finite(self.optimizer, grads, grad_norm, clip_scale)


class GradientBuffers:
    """One persistent zero-initialised buffer per parameter (`grad_accumulator.<name>`) that graphs add gradients
    to in place (`add_to_buffers`); :meth:`zero` clears them."""

    def __init__(self, params):
        self.buffers = ParameterTuple(
            Parameter(initializer("zeros", p.shape, p.dtype), name=f"grad_accumulator.{p.name}", requires_grad=False)
            for p in params)
        self.clear = _ZeroParameters(self.buffers)

    def zero(self) -> None:
        self.clear(Tensor(0.0, ms.float32))


_add_in_place = ops.MultitypeFuncGraph("add_in_place")
_zero_in_place = ops.MultitypeFuncGraph("zero_in_place")
_MAP = ops.HyperMap()


@_add_in_place.register("Tensor", "Tensor")
def _assign_add(buffer, grad):
    return ops.assign_add(buffer, grad)


@_zero_in_place.register("Tensor", "Tensor", "Tensor")
def _assign_zeros(zero, done, param):
    return ops.assign(param, ops.broadcast_to(ops.depend(zero, done).astype(param.dtype), param.shape))


def add_to_buffers(buffers, grads):
    """`buffers[i] += grads[i]` inside a graph (mapped: inferred once per distinct shape); returns a scalar to
    `ops.depend` on (an unused assign may be dropped)."""
    return ops.depend(ops.zeros((), ms.float32), _MAP(_add_in_place, buffers, grads))


class AccumulateGradients(nn.Cell):
    """Adds this rank's gradients of one micro-batch of a loss net returning `(loss, *stats)` to persistent
    buffers, in place inside the graph (so only one micro-batch's gradients exist besides the buffers), and
    returns the loss net's outputs. :meth:`zero` clears the buffers."""

    def __init__(self, loss_net: nn.Cell, params):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.grad_fn = ops.value_and_grad(loss_net, None, params, has_aux=True)
        self.storage = GradientBuffers(params)
        self.buffers = self.storage.buffers

    def construct(self, *inputs):
        outputs, grads = self.grad_fn(*inputs)
        done = add_to_buffers(self.buffers, grads)
        return (ops.depend(outputs[0], done),) + tuple(outputs[1:])

    def zero(self) -> None:
        self.storage.zero()


class _ZeroParameters(nn.Cell):
    """Sets every given Parameter to zero, in place."""

    def __init__(self, params: ParameterTuple):
        super().__init__(auto_prefix=False)
        self.params = params
        self.groups = update_groups([int(np.prod(p.shape, dtype=np.int64)) for p in params])

    def construct(self, zero):
        # a group of parameters (`optim.update_groups`) after the other: the CPU runtime would otherwise make every
        # parameter's zeros at once (a copy of all the parameters' memory)
        done = ops.zeros((), ms.float32)
        for start, end in self.groups:
            done = ops.depend(done, _MAP(ops.partial(_zero_in_place, zero, done), self.params[start:end]))
        return done


class ApplyGradients(nn.Cell):
    """Accumulated gradients in `buffers` (one per optimizer parameter) -> reduced over dp in place
    (`comm.AllReduceInPlace`; with `dp_sums`, `comm.SumInPlaceOnHost` before the graph), clipped, one optimizer step
    (skipped when the norm is not finite); returns the norm before clipping. The other arguments as
    :class:`ReducedClippedGradients`."""

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Cell, buffers: ParameterTuple, layout: Layout | None = None,
                 grad_reduction: str = "mean", max_grad_norm: float = 0.0, counted_elsewhere=(),
                 dp_sums: SharedMemoryGroup | None = None):
        super().__init__(auto_prefix=False)
        layout = layout or Layout()
        self.buffers = buffers
        scale = 1.0 / layout.dp if grad_reduction == "mean" else 1.0
        self.reduce = self.sum_on_host = None
        if layout.dp > 1 and dp_sums is not None:
            check_dp_sums(dp_sums, layout.dp_group)
            self.sum_on_host = SumInPlaceOnHost(buffers, dp_sums, scale)
        elif layout.dp > 1:
            self.reduce = AllReduceInPlace(buffers, layout.dp_group, scale)
        self.finish = ReducedClippedGradients(loss_net, optimizer.parameters, layout, grad_reduction, max_grad_norm,
                                              counted_elsewhere, reduced=True)
        self.optimizer = optimizer

    def __call__(self):
        if self.sum_on_host is not None:  # between the accumulation graphs and this one
            self.sum_on_host()
        return super().__call__()

    def construct(self):
        if self.reduce is not None:
            self.reduce()  # in place: the reads of the buffers below follow it (side effects keep program order)
        grads, grad_norm, clip_scale = self.finish(self.buffers)
        return step_if_finite(self.optimizer, grads, grad_norm, clip_scale)


class MicroBatchedTrainStep:
    """One optimizer step over a batch given as micro-batches (gradient accumulation): each micro-batch's
    forward and backward run on their own, so activation memory is that of one micro-batch; the gradients
    are added in place to buffers (:class:`AccumulateGradients`), then reduced over dp, clipped and applied
    once. The loss of the batch must be the sum of the micro-batches' losses (token weights normalised over
    the whole batch, as the GRPO loss's). One micro-batch runs the fused :class:`SPMDTrainStep`.

    Called with a list of micro-batches (each the loss net's input tensors), returns `(outputs, grad_norm)`:
    the loss net's outputs summed over the micro-batches (numpy), the norm before clipping (float). A norm that
    is not finite means the update was skipped (`step_if_finite`). The arguments as :class:`ReducedClippedGradients`.
    """

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Cell, layout: Layout | None = None,
                 grad_reduction: str = "mean", max_grad_norm: float = 0.0, dp_sums: SharedMemoryGroup | None = None):
        self.loss_net = loss_net
        self.params = optimizer.parameters
        self.whole = SPMDTrainStep(loss_net, optimizer, layout, grad_reduction, max_grad_norm, dp_sums)
        self.layout, self.grad_reduction, self.max_grad_norm = layout, grad_reduction, max_grad_norm
        self.dp_sums = dp_sums
        self.accumulate = self.apply = None  # the buffers (a gradient's worth of memory) exist once micro-batches come

    def __call__(self, micro_batches):
        if len(micro_batches) == 1:
            outputs, grad_norm = self.whole(*micro_batches[0])
            return np.array([o.asnumpy() for o in outputs], np.float64), float(grad_norm.asnumpy())
        if self.accumulate is None:
            self.accumulate = AccumulateGradients(self.loss_net, self.params)
            self.apply = ApplyGradients(self.loss_net, self.whole.optimizer, self.accumulate.buffers, self.layout,
                                        self.grad_reduction, self.max_grad_norm, dp_sums=self.dp_sums)
        total = 0.0
        for inputs in micro_batches:
            total = total + np.array([o.asnumpy() for o in self.accumulate(*inputs)], np.float64)
        grad_norm = float(self.apply().asnumpy())
        self.accumulate.zero()
        return total, grad_norm
