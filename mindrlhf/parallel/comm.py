"""Collectives with the backward each tensor-parallel use needs (Megatron's f/g operators).

Only what works on every backend is used: AllReduce(SUM) on sub-groups, AllGather/Broadcast on the
world group. A gather inside a sub-group is an AllReduce(SUM) of zero-padded shards. MindSpore's
built-in bprops do not fit here (AllReduce's all-reduces the gradient, AllGather's needs
ReduceScatter), so each op below is a Cell with its own `bprop`.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import dtype as mstype
from mindspore import nn, ops

from mindrlhf.parallel.shared_memory import SharedMemoryGroup, all_reduce_op


class CopyToTensorParallel(nn.Cell):
    """Identity forward, AllReduce(SUM) of the gradient over the tp group (input of column-parallel layers)."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout),)


class ReduceFromTensorParallel(nn.Cell):
    """AllReduce(SUM) forward over the tp group, identity backward (output of row-parallel layers).

    The result is replicated on every tp rank and consumed by replicated computation, so each rank's
    gradient w.r.t. its partial sum is the gradient of the sum itself.
    """

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)

    def construct(self, x):
        return self.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


def _zero_padded(x, axis: int, before: int, after: int):
    """`x` with `before` / `after` zeros along `axis` (a shard placed in a zero tensor of the gathered shape)."""
    axis = axis % x.ndim
    pads = [(0, 0)] * x.ndim
    pads[axis] = (before, after)
    flat_pads = []
    for lo, hi in reversed(pads):
        flat_pads += [lo, hi]
    return ops.pad(x, tuple(flat_pads))


def _own_part(x, axis: int, tp_size: int, tp_rank: int):
    """This rank's part of `x` cut into `tp_size` equal parts along `axis` (the last, or 1). Indexing, not
    `ops.split` / `ops.narrow`: their argument checks fail on a gradient inside a bprop."""
    width = x.shape[axis] // tp_size
    start = tp_rank * width
    if axis == 1:
        return x[:, start:start + width]
    return x[..., start:start + width]


class GatherFromTensorParallel(nn.Cell):
    """Concatenates the tp shards of `x` along `axis` (default: the last; AllReduce of zero-padded shards).

    Backward keeps this rank's slice of the gradient: the consumers of the gathered tensor are replicated (or take
    their input through `CopyToTensorParallel`), so every rank holds the whole gradient.
    """

    def __init__(self, group: str, tp_size: int, tp_rank: int, axis: int = -1):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        if axis not in (1, -1):
            raise ValueError(f"a tensor-parallel gather is along axis 1 or -1, not {axis}")
        self.axis = axis

    def construct(self, x):
        width = x.shape[self.axis]
        return self.all_reduce(_zero_padded(x, self.axis, self.tp_rank * width,
                                            (self.tp_size - 1 - self.tp_rank) * width))

    def bprop(self, x, out, dout):
        return (_own_part(dout, self.axis, self.tp_size, self.tp_rank),)


class SplitToTensorParallel(nn.Cell):
    """This rank's part of a replicated `x` cut into tp equal parts along `axis`; backward gathers the parts'
    gradients (AllReduce of zero-padded parts), so the replicated producer gets the whole gradient. After a
    `ReduceFromTensorParallel` it is Megatron's reduce-scatter (sequence parallel's output of row-parallel layers).
    """

    def __init__(self, group: str, tp_size: int, tp_rank: int, axis: int):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)
        self.tp_size, self.tp_rank, self.axis = tp_size, tp_rank, axis

    def construct(self, x):
        return _own_part(x, self.axis, self.tp_size, self.tp_rank)

    def bprop(self, x, out, dout):
        width = dout.shape[self.axis]
        return (self.all_reduce(_zero_padded(dout, self.axis, self.tp_rank * width,
                                             (self.tp_size - 1 - self.tp_rank) * width)),)


class MaxOverGroup(nn.Cell):
    """Element-wise max over a group without a MAX reduction: gathered along a new last axis (as
    :class:`GatherFromTensorParallel` does), then reduced locally.

    No gradient (used for the stabilising max of a softmax, which cancels out).
    """

    def __init__(self, group: str, group_size: int, group_rank: int):
        super().__init__()
        self.gather = GatherFromTensorParallel(group, group_size, group_rank)

    def construct(self, x):
        gathered = self.gather(ops.expand_dims(ops.stop_gradient(x), -1))
        return ops.max(gathered, axis=-1)[0]


def sum_over(group: str, dp_sums: SharedMemoryGroup | None = None):
    """An AllReduce(SUM) over `group` for the data-parallel gradient sums: through shared memory when `dp_sums` (the
    shared-memory group of `group`, :mod:`mindrlhf.parallel.shared_memory`, CPU ranks on one host) is given, else
    MindSpore's. Returns (op, shared): calls of a shared-memory op must be chained (`ops.depend`) so that every
    member issues them in the same order."""
    if dp_sums is not None:
        check_dp_sums(dp_sums, group)
        return all_reduce_op(dp_sums), True
    return ops.AllReduce(ops.ReduceOp.SUM, group), False


def check_dp_sums(member: SharedMemoryGroup, group: str) -> None:
    """Raises ValueError unless `member` is the shared-memory group of `group`."""
    if member.name != group:
        raise ValueError(f"the shared-memory group {member.name!r} is not the data-parallel group {group!r}")


CHAIN_BLOCK = 32  # gradients a chained reduction appends to its output tuple in one unrolled loop


class DataParallelGradReducer(nn.Cell):
    """Reduces a tuple of gradients over the data-parallel group (identity when dp == 1).

    `mean=True` averages (each dp rank's loss is a mean over its own rows); `mean=False` sums (each dp
    rank's loss is its share of one global loss, e.g. token weights normalised over the global batch). `dp_sums`:
    the shared-memory group of `group` to sum through (:func:`sum_over`), None = MindSpore's AllReduce.
    """

    def __init__(self, group: str | None, dp_size: int, mean: bool = True, dp_sums: SharedMemoryGroup | None = None):
        super().__init__()
        self.dp_size = dp_size
        self.all_reduce, self.chained = sum_over(group, dp_sums) if dp_size > 1 else (None, False)
        self.scale = 1.0 / dp_size if mean else 1.0

    def construct(self, grads):
        if self.all_reduce is None:
            return grads
        if self.chained:
            return self._one_after_the_other(grads)
        if self.scale == 1.0:  # a sum: no gradient-sized product (the CPU backend keeps each op's output)
            return tuple(self.all_reduce(g) for g in grads)
        return tuple(self.all_reduce(g) * self.scale for g in grads)

    def _one_after_the_other(self, grads):
        # Graph mode nests a call per iteration of an unrolled loop that grows a tuple (or holds an `if`; see
        # AllReduceInPlace), past its call depth limit (1000) at a real model's ~300 parameters: the tuple grows
        # in blocks, each chained inside `_chain`.
        reduced = ()
        done = ops.zeros((), mstype.float32)
        for start in range(0, len(grads), CHAIN_BLOCK):
            block, done = self._chain(grads[start:start + CHAIN_BLOCK], done)
            reduced = reduced + block
        if self.scale == 1.0:
            return reduced
        return tuple(g * self.scale for g in reduced)

    def _chain(self, grads, done):
        block = ()
        for i in range(len(grads)):
            total = self.all_reduce(ops.depend(grads[i], done))
            done = ops.depend(done, total)
            block = block + (total,)
        return block, done


class WorldAllGather(nn.Cell):
    """Concatenates every rank's `x` along axis 0, in rank order (the world group: works on every backend)."""

    def __init__(self):
        super().__init__()
        self.all_gather = ops.AllGather()

    def construct(self, x):
        return self.all_gather(x)


class GroupSum(nn.Cell):
    """AllReduce(SUM) of `x` over `group` (a host-side reduction of metrics, or a barrier)."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)

    def construct(self, x):
        return self.all_reduce(x)


class AllReduceInPlace(nn.Cell):
    """Sums each of `params` over `group` in place (times `scale`), one parameter after the other: only one
    parameter's reduced copy exists at a time, and every rank issues the collectives in the same order."""

    def __init__(self, params, group: str, scale: float = 1.0):
        super().__init__()
        self.params = params
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)  # chained: one parameter after the other
        self.scale = float(scale)

    def construct(self):
        # the branch stays outside the loops: an `if` inside a loop over ~300 parameters nests a call per
        # iteration and exceeds graph mode's call depth limit (1000)
        if self.scale == 1.0:
            return self._sum()
        return self._scaled_sum()

    def _sum(self):
        done = ops.zeros((), mstype.float32)
        for i in range(len(self.params)):
            reduced = self.all_reduce(ops.depend(self.params[i], done))
            done = ops.depend(done, ops.assign(self.params[i], reduced))
        return done

    def _scaled_sum(self):
        done = ops.zeros((), mstype.float32)
        for i in range(len(self.params)):
            reduced = self.all_reduce(ops.depend(self.params[i], done)) * self.scale
            done = ops.depend(done, ops.assign(self.params[i], reduced))
        return done


class SumInPlaceOnHost:
    """`AllReduceInPlace` over a shared-memory group (`member`, :mod:`mindrlhf.parallel.shared_memory`), called from
    Python between graphs: each parameter's memory is summed over the group in place and scaled, one parameter after
    the other. On CPU a parameter's `asnumpy()` is a view of its memory, so no copy is made; the in-graph op
    (`sum_over`) would keep a copy of every parameter it is given (for gradient buffers, a model's worth)."""

    def __init__(self, params, member: SharedMemoryGroup, scale: float = 1.0):
        self.params, self.member, self.scale = list(params), member, float(scale)

    def __call__(self) -> None:
        for param in self.params:
            data = param.asnumpy()
            view = np.shares_memory(data, param.asnumpy())  # a fresh copy each call would share nothing
            if not view:
                data = np.array(data)
            self.member.all_reduce_in_place(data)
            if self.scale != 1.0:
                data *= np.asarray(self.scale, data.dtype)
            if not view:
                param.set_data(ms.Tensor(data))
