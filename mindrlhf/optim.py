"""AdamW as `torch.optim.AdamW` (with bias correction) and the learning-rate schedule as a pure function.

MindSpore's `nn.AdamWeightDecay` has no bias correction: its update is m / (sqrt(v) + eps) from the first
step, several times larger than torch's for the same learning rate, so hyper-parameters from verl/TRL papers
would not transfer. The learning rate lives in a Parameter the host sets before each update, so that the
schedule is a plain function of the update count and a resumed run continues it exactly. `ShardedAdamW` is the
same update with the moments sharded over data parallel (ZeRO-1).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops


def learning_rate_at(step: int, base_lr: float, warmup_steps: int = 0, total_steps: int = 1,
                     schedule: str = "constant", min_lr_ratio: float = 0.0) -> float:
    """Learning rate of update `step` (0 = the first): linear warmup over `warmup_steps` updates, then
    constant or cosine decay to `base_lr * min_lr_ratio` at update `total_steps - 1`."""
    if step < 0 or warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need step >= 0, warmup_steps >= 0, total_steps >= 1; got {step}, {warmup_steps}, "
                         f"{total_steps}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return base_lr
    decay_steps = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def decays_by_default(param) -> bool:
    """Weight decay on matrices only: norm weights and biases (1-D) are not decayed."""
    return len(param.shape) > 1


UPDATE_GROUP_BYTES = 64 * 2**20  # float32 gradient bytes of the parameters one mapped update group holds


def update_groups(numels: list[int], group_bytes: int = UPDATE_GROUP_BYTES) -> tuple[tuple[int, int], ...]:
    """`[start, end)` ranges of consecutive parameters (of `numels` elements each) whose float32 gradients add up
    to at most `group_bytes` (a larger parameter is a group of its own): the groups :class:`AdamW` updates one
    after the other."""
    groups, start, size = [], 0, 0
    for i, numel in enumerate(numels):
        if i > start and size + 4 * numel > group_bytes:
            groups.append((start, i))
            start, size = i, 0
        size += 4 * numel
    if numels:
        groups.append((start, len(numels)))
    return tuple(groups)


_unscaled_update = ops.MultitypeFuncGraph("unscaled_update")
_scaled_update = ops.MultitypeFuncGraph("scaled_update")


@_unscaled_update.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                           "Tensor", "Number", "Tensor")
def _fused_unscaled(kernel, lr, beta1, beta2, eps, decay_scale, done, var, m, v, decay_rate, grad):
    """One parameter's fused AdamW update by its float32 gradient, after `done`."""
    grad = ops.depend(grad, done).astype(ms.float32)
    return kernel(var, m, v, lr, beta1, beta2, eps, decay_rate * decay_scale, grad)


@_scaled_update.register("Function", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor",
                         "Tensor", "Tensor", "Number", "Tensor")
def _fused_scaled(kernel, lr, beta1, beta2, eps, decay_scale, grad_scale, done, var, m, v, decay_rate, grad):
    """One parameter's fused AdamW update by its float32 gradient times `grad_scale`, after `done`."""
    grad = ops.depend(grad, done).astype(ms.float32) * grad_scale
    return kernel(var, m, v, lr, beta1, beta2, eps, decay_rate * decay_scale, grad)


class AdamW(nn.Cell):
    """`torch.optim.AdamW` in a graph: decoupled decay, then Adam with bias correction.

    State: `adam_m.<name>`, `adam_v.<name>` per parameter, the update count `adam_step` and the float32
    `learning_rate` the host sets with :meth:`set_learning_rate` (both prefixed with `state_prefix`, so that two
    optimizers of one job have distinct names). `construct(grads)` applies one update.
    """

    def __init__(self, params, learning_rate: float = 1e-6, beta1: float = 0.9, beta2: float = 0.95,
                 eps: float = 1e-8, weight_decay: float = 0.01, decay: Callable | None = None, state_prefix: str = ""):
        super().__init__(auto_prefix=False)
        self.parameters = ParameterTuple(list(params))
        decay = decay or decays_by_default
        self.moments1 = ParameterTuple([Parameter(Tensor(np.zeros(self._state_shape(p), np.float32)),
                                                  name=f"adam_m.{p.name}", requires_grad=False)
                                        for p in self.parameters])
        self.moments2 = ParameterTuple([Parameter(Tensor(np.zeros(self._state_shape(p), np.float32)),
                                                  name=f"adam_v.{p.name}", requires_grad=False)
                                        for p in self.parameters])
        self.adam_step = Parameter(Tensor(0.0, ms.float32), name=f"{state_prefix}adam_step", requires_grad=False)
        self.learning_rate = Parameter(Tensor(float(learning_rate), ms.float32), name=f"{state_prefix}learning_rate",
                                       requires_grad=False)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.decay_rates = tuple(float(weight_decay) if decay(p) else 0.0 for p in self.parameters)
        self.beta1_tensor = Tensor(self.beta1, ms.float32)
        self.beta2_tensor = Tensor(self.beta2, ms.float32)
        self.fused_update = ops.AdamWeightDecay()
        self.map = ops.HyperMap()
        self.groups = update_groups([int(np.prod(p.shape, dtype=np.int64)) for p in self.parameters])

    def set_learning_rate(self, value: float) -> None:
        # written in place: in the trainer's processes `set_data` gave the Parameter a new tensor that graphs compiled
        # earlier did not read (each kept the rate of its first call: warmup and decay were lost)
        ops.assign(self.learning_rate, Tensor(float(value), ms.float32))

    def _state_shape(self, param) -> tuple:
        """Shape of a parameter's moments."""
        return tuple(param.shape)

    def construct(self, grads, grad_scale=None):
        # torch's AdamW, var <- var * (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), written as
        # MindSpore's fused in-place AdamWeightDecay kernel, var <- var - lr' (m / (sqrt(v) + eps') + wd' var),
        # with lr' = lr sqrt(bc2) / bc1, eps' = eps sqrt(bc2), wd' = wd bc1 / sqrt(bc2) (the same numbers up to
        # rounding). One kernel per parameter and no full-size temporaries: an element-wise graph held ~13x
        # the parameters' size in temporaries. `grad_scale` (a clip factor) multiplies each gradient just before
        # its update.
        step = self.adam_step + 1.0
        lr = self.learning_rate
        correction1 = 1.0 - ops.pow(self.beta1, step)
        root_correction2 = ops.sqrt(1.0 - ops.pow(self.beta2, step))
        fused_lr = lr * root_correction2 / correction1
        fused_eps = self.eps * root_correction2
        decay_scale = correction1 / root_correction2
        done = ops.assign(self.adam_step, step)
        return self._update_all(grads, grad_scale, done, fused_lr, fused_eps, decay_scale)

    def _update_all(self, grads, grad_scale, done, fused_lr, fused_eps, decay_scale):
        """Every parameter updated, a group (`update_groups`) after the other: the parameters of a group are mapped
        (`HyperMap`: the frontend infers the update once per distinct shape, where an unrolled loop over the
        parameters compiled ~3x longer at a real model's ~300), and the groups are chained, so that the scaled
        gradients of one group at most exist at a time (the CPU runtime runs every ready multiplication at
        once)."""
        kernel, beta1, beta2 = self.fused_update, self.beta1_tensor, self.beta2_tensor
        if grad_scale is None:
            for start, end in self.groups:
                updated = self.map(ops.partial(_unscaled_update, kernel, fused_lr, beta1, beta2, fused_eps,
                                               decay_scale, done), self.parameters[start:end],
                                   self.moments1[start:end], self.moments2[start:end], self.decay_rates[start:end],
                                   grads[start:end])
                done = ops.depend(done, updated)
            return done
        for start, end in self.groups:
            updated = self.map(ops.partial(_scaled_update, kernel, fused_lr, beta1, beta2, fused_eps, decay_scale,
                                           grad_scale, done), self.parameters[start:end],
                               self.moments1[start:end], self.moments2[start:end], self.decay_rates[start:end],
                               grads[start:end])
            done = ops.depend(done, updated)
        return done


def shard_length(numel: int, dp: int) -> int:
    """Elements of each of the `dp` equal slices of a flattened parameter of `numel` elements (the last ones
    zero-padded)."""
    if numel < 1 or dp < 1:
        raise ValueError(f"need numel >= 1 and dp >= 1, got {numel}, {dp}")
    return -(-numel // dp)


def shard_bounds(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """`[start, end)` of the real (unpadded) elements of dp rank `rank`'s slice of the flattened parameter; empty
    (start == end) when the slice is all padding."""
    if not 0 <= rank < dp:
        raise ValueError(f"rank {rank} is not in [0, {dp})")
    length = shard_length(numel, dp)
    return min(rank * length, numel), min((rank + 1) * length, numel)


def flat_shard(array: np.ndarray, dp: int, rank: int) -> np.ndarray:
    """Dp rank `rank`'s zero-padded slice of the flattened `array` (what :class:`ShardedAdamW` keeps per rank)."""
    flat = np.asarray(array).reshape(-1)
    start, end = shard_bounds(flat.size, dp, rank)
    out = np.zeros(shard_length(flat.size, dp), flat.dtype)
    out[:end - start] = flat[start:end]
    return out


def join_shards(shards, shape) -> np.ndarray:
    """The array of `shape` from every dp rank's slice (:func:`flat_shard`, in rank order), padding dropped."""
    numel = int(np.prod(shape, dtype=np.int64))
    lengths = {len(s) for s in shards}
    if lengths != {shard_length(numel, len(shards))}:
        raise ValueError(f"{len(shards)} slices of lengths {sorted(lengths)} do not split {numel} elements")
    return np.concatenate(shards)[:numel].reshape(shape)


class ShardedAdamW(AdamW):
    """:class:`AdamW` with its state sharded over data parallel (ZeRO-1, MindSpore's "parallel optimizer").

    Every parameter is flattened and split into `dp` equal contiguous slices, the last zero-padded
    (:func:`shard_bounds`); dp rank `dp_rank` keeps the moments of its slice only (`adam_m.<name>`, `adam_v.<name>`
    of shape `(shard_length,)`) and updates its slice of the weight with its slice of the (dp-reduced, clipped)
    gradient by the same fused kernel. The updated weights are then assembled on every dp rank by an AllReduce(SUM)
    over `dp_group` of zero buffers holding each rank's slice (a gather inside a sub-group on every backend), one
    parameter after the other. The weights stay whole on every rank; they equal :class:`AdamW`'s bit for bit
    (the same element-wise kernel on the same numbers, and x + 0 is exact).
    """

    def __init__(self, params, dp: int, dp_rank: int, dp_group: str | None, **kwargs):
        if dp < 1 or not 0 <= dp_rank < dp or (dp > 1 and not dp_group):
            raise ValueError(f"need 0 <= dp_rank < dp and a dp group when dp > 1; got dp={dp}, dp_rank={dp_rank}, "
                             f"dp_group={dp_group!r}")
        self.dp, self.dp_rank = int(dp), int(dp_rank)
        super().__init__(params, **kwargs)
        numels = [int(np.prod(p.shape, dtype=np.int64)) for p in self.parameters]
        lengths = [shard_length(n, self.dp) for n in numels]
        self.numels = tuple(numels)
        self.paddings = tuple(length * self.dp - n for length, n in zip(lengths, numels))
        self.starts = tuple(length * self.dp_rank for length in lengths)
        self.ends = tuple(length * (self.dp_rank + 1) for length in lengths)
        # the zeros around this rank's slice in the padded flat buffer that is summed over dp
        self.around = tuple((length * self.dp_rank, length * (self.dp - 1 - self.dp_rank)) for length in lengths)
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, dp_group) if self.dp > 1 else nn.Identity()

    def _state_shape(self, param) -> tuple:
        return (shard_length(int(np.prod(param.shape, dtype=np.int64)), self.dp),)

    def _local(self, i, x):
        """This rank's slice of parameter i's flattened weight or gradient `x`."""
        return ops.pad(x.reshape(-1), (0, self.paddings[i]))[self.starts[i]:self.ends[i]]

    def _update_all(self, grads, grad_scale, done, fused_lr, fused_eps, decay_scale):
        # one parameter after the other, in the same order on every rank: each update ends in a collective. The
        # branch stays outside the loops over parameters (an `if` in an unrolled loop nests a call per parameter
        # in graph mode, past its call depth limit at a real model's size)
        if grad_scale is None:
            for i in range(len(self.parameters)):
                grad = self._local(i, ops.depend(grads[i], done)).astype(ms.float32)
                done = self._update(i, grad, done, fused_lr, fused_eps, decay_scale)
            return done
        for i in range(len(self.parameters)):
            grad = self._local(i, ops.depend(grads[i], done)).astype(ms.float32) * grad_scale
            done = self._update(i, grad, done, fused_lr, fused_eps, decay_scale)
        return done

    def _update(self, i, grad, done, fused_lr, fused_eps, decay_scale):
        """This rank's slice of parameter i and its moments updated by `grad` (its slice), then the whole weight
        assembled over dp, after `done`."""
        param = self.parameters[i]
        # a copy of this rank's slice, which the fused kernel updates in place (it takes a Tensor as well as a
        # Parameter); no slice-sized Parameter is kept besides the moments
        part = self._local(i, ops.depend(param, done))
        done = ops.depend(done, self.fused_update(part, self.moments1[i], self.moments2[i], fused_lr,
                                                  self.beta1_tensor, self.beta2_tensor, fused_eps,
                                                  self.decay_rates[i] * decay_scale, grad))
        whole = self.all_reduce(ops.pad(ops.depend(part, done).astype(ms.float32), self.around[i]))
        whole = whole[:self.numels[i]].reshape(param.shape).astype(param.dtype)
        return ops.depend(done, ops.assign(param, whole))
