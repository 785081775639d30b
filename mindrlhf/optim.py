"""AdamW as `torch.optim.AdamW` (with bias correction) and the learning-rate schedule as a pure function.

MindSpore's `nn.AdamWeightDecay` has no bias correction: its update is m / (sqrt(v) + eps) from the first
step, several times larger than torch's for the same learning rate, so hyper-parameters from verl/TRL papers
would not transfer. The learning rate lives in a Parameter the host sets before each update, so that the
schedule is a plain function of the update count and a resumed run continues it exactly.
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
        self.moments1 = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"adam_m.{p.name}",
                                                  requires_grad=False) for p in self.parameters])
        self.moments2 = ParameterTuple([Parameter(Tensor(np.zeros(p.shape, np.float32)), name=f"adam_v.{p.name}",
                                                  requires_grad=False) for p in self.parameters])
        self.adam_step = Parameter(Tensor(0.0, ms.float32), name=f"{state_prefix}adam_step", requires_grad=False)
        self.learning_rate = Parameter(Tensor(float(learning_rate), ms.float32), name=f"{state_prefix}learning_rate",
                                       requires_grad=False)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.decay_rates = tuple(float(weight_decay) if decay(p) else 0.0 for p in self.parameters)
        self.beta1_tensor = Tensor(self.beta1, ms.float32)
        self.beta2_tensor = Tensor(self.beta2, ms.float32)
        self.fused_update = ops.AdamWeightDecay()

    def set_learning_rate(self, value: float) -> None:
        self.learning_rate.set_data(Tensor(float(value), ms.float32))

    def construct(self, grads, grad_scale=None):
        # torch's AdamW, var <- var * (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), written as
        # MindSpore's fused in-place AdamWeightDecay kernel, var <- var - lr' (m / (sqrt(v) + eps') + wd' var),
        # with lr' = lr sqrt(bc2) / bc1, eps' = eps sqrt(bc2), wd' = wd bc1 / sqrt(bc2) (the same numbers up to
        # rounding). One kernel per parameter and no full-size temporaries: an element-wise graph held ~13x
        # the parameters' size in temporaries. `grad_scale` (a clip factor) multiplies each gradient just before
        # its update, and each update waits for the previous one: at most one scaled gradient exists at a time
        # (the CPU runtime would otherwise run every ready multiplication at once).
        step = self.adam_step + 1.0
        lr = self.learning_rate
        correction1 = 1.0 - ops.pow(self.beta1, step)
        root_correction2 = ops.sqrt(1.0 - ops.pow(self.beta2, step))
        fused_lr = lr * root_correction2 / correction1
        fused_eps = self.eps * root_correction2
        decay_scale = correction1 / root_correction2
        done = ops.assign(self.adam_step, step)
        # the branch stays outside the loops over parameters (an `if` in an unrolled loop nests a call per
        # parameter in graph mode, past its call depth limit at a real model's size)
        if grad_scale is None:
            for i in range(len(self.parameters)):
                grad = ops.depend(grads[i], done).astype(ms.float32)
                done = self._update(i, grad, done, fused_lr, fused_eps, decay_scale)
            return done
        for i in range(len(self.parameters)):
            grad = ops.depend(grads[i], done).astype(ms.float32) * grad_scale
            done = self._update(i, grad, done, fused_lr, fused_eps, decay_scale)
        return done

    def _update(self, i, grad, done, fused_lr, fused_eps, decay_scale):
        """The fused in-place update of parameter i (and its moments) by the float32 `grad`, after `done`."""
        return ops.depend(done, self.fused_update(self.parameters[i], self.moments1[i], self.moments2[i], fused_lr,
                                                  self.beta1_tensor, self.beta2_tensor, fused_eps,
                                                  self.decay_rates[i] * decay_scale, grad))
