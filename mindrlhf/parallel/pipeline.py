"""Pipeline-parallel training under explicit SPMD: each rank holds one stage of the layers
(`Layout.pp`, `Qwen2Model`'s stage split), activations and their gradients move between neighbouring stages.

On CPU there is no Send/Receive, so a move is an AllReduce(SUM) over the 2-rank group of the neighbours in which
the receiver contributes zeros (:class:`StageTransfer`); on every backend both ranks call it in the same order.
The schedule is driven from the host, one micro-batch at a time: the first stage runs its forward and sends the
activations; the last stage runs forward and backward of the loss and sends back the gradient of its input; the
first stage runs its backward from that gradient (recomputing its forward, so it holds no activations between
the two). Each stage accumulates its parameters' gradients over the micro-batches in place; then one update:
reduced over dp, clipped by the global norm over pp x tp x dp, AdamW. Host-driven stages do not overlap
(no pipeline fill as in GPipe/1F1B), which costs nothing on ranks that share CPU cores and keeps every collective
in one fixed order whatever order MindSpore gives a backward graph's ops.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from mindrlhf.parallel.comm import AllReduceInPlace
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.spmd import ApplyGradients, GradientBuffers, add_to_buffers


def gather_stage_layouts(local: dict, dtypes: dict, layout: Layout) -> tuple[dict, dict[str, int], dict]:
    """Every stage's parameter layouts of a net in pipeline stages, learnt from the other ranks (each knows its own
    stage's `local` layouts, with full shapes, and the parameters' `dtypes`): (layouts, name -> stage, name ->
    dtype). A world gather on the host; every rank must call it."""
    import json

    from mindrlhf.parallel.host import HostCollectives
    from mindrlhf.parallel.layers import to_ms_dtype
    from mindrlhf.parallel.strategy import ParamLayout

    mine = json.dumps({name: [list(lay.dev_matrix), list(lay.tensor_map), list(lay.full_shape),
                              str(dtypes[name]).lower(), layout.stage] for name, lay in local.items()})
    comm = HostCollectives(layout.world_size, layout.rank)
    data = np.frombuffer(mine.encode(), np.uint8).astype(np.int32)  # CPU collectives carry no 8-bit integers
    longest = int(comm.all_gather(np.array([data.size], np.int32)).max())
    rows = comm.all_gather(np.pad(data, (0, longest - data.size))[None]).reshape(layout.world_size, longest)
    layouts, stages, all_dtypes = {}, {}, {}
    for row in rows:
        text = row.astype(np.uint8).tobytes().rstrip(b"\0")
        for name, (dev_matrix, tensor_map, shape, dtype, stage) in json.loads(text).items():
            if stages.get(name, stage) < stage:
                continue  # a parameter several stages hold (a tied embedding) is taken from the first
            layouts[name] = ParamLayout(name, dev_matrix, tensor_map, shape)
            stages[name] = stage
            all_dtypes[name] = to_ms_dtype(dtype)
    return layouts, stages, all_dtypes


class StageTransfer(nn.Cell):
    """AllReduce(SUM) over the 2-rank group of neighbouring stages: the sender passes its tensor, the receiver
    zeros of the same shape, both get the tensor."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(ops.ReduceOp.SUM, group)

    def construct(self, x):
        return self.all_reduce(x)


class LastStageStep(nn.Cell):
    """Last stage, one micro-batch: the loss net's outputs on (inputs, hidden_in) (`hidden_in` the last of
    `num_inputs`), its parameters' gradients added to `buffers`; returns (outputs..., gradient w.r.t. hidden_in)."""

    def __init__(self, loss_net: nn.Cell, params, buffers, num_inputs: int):
        super().__init__(auto_prefix=False)
        self.loss_net = loss_net
        self.buffers = buffers
        self.grad_fn = ops.value_and_grad(loss_net, num_inputs - 1, params, has_aux=True)

    def construct(self, *inputs):
        outputs, (grad_in, param_grads) = self.grad_fn(*inputs)
        done = add_to_buffers(self.buffers, param_grads)
        return (ops.depend(outputs[0], done),) + tuple(outputs[1:]) + (grad_in,)


class FirstStageBackward(nn.Cell):
    """First stage, one micro-batch: recomputes its forward and adds its parameters' gradients, given the
    gradient of its output, to `buffers`."""

    def __init__(self, forward_net: nn.Cell, params, buffers):
        super().__init__(auto_prefix=False)
        self.forward_net = forward_net
        self.params = params
        self.buffers = buffers
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)

    def construct(self, *inputs_and_sens):
        return add_to_buffers(self.buffers, self.grad(self.forward_net, self.params)(*inputs_and_sens))


class PipelineTrainStep:
    """One optimizer step of a 2-stage pipeline over micro-batches (see the module doc).

    `stage_net` is this rank's stage: on the last stage the loss net, called as `loss_net(*inputs, hidden_in)` and
    returning `(loss, *stats)` (its loss summed over micro-batches must be the batch's loss, as the GRPO loss with
    global token weights); on the first stage the forward net `forward_net(*inputs[:forward_inputs])` returning
    the activations [B, S, D] (`hidden_shape(inputs)` gives their shape, the receiver needs it). Called with a list
    of micro-batches (each the `num_inputs` input tensors of the loss net but `hidden_in`), returns
    `(outputs, grad_norm)` on every rank: the loss net's outputs summed over the micro-batches (numpy) and the
    global norm before clipping (not finite: the update was skipped). `stage_shared` names the parameters both
    stages hold (`Qwen2ForCausalLM.stage_shared_params`): their gradients are summed over the stages.
    """

    def __init__(self, stage_net: nn.Cell, optimizer: nn.Cell, layout: Layout, hidden_shape, hidden_dtype,
                 num_inputs: int, forward_inputs: int, num_outputs: int, grad_reduction: str = "mean",
                 max_grad_norm: float = 0.0, stage_shared=()):
        if layout.pp != 2:
            raise NotImplementedError(f"pipeline train step with {layout.pp} stages: only 2 are supported yet")
        self.layout, self.stage = layout, layout.stage
        self.hidden_shape, self.hidden_dtype = hidden_shape, hidden_dtype
        self.forward_inputs, self.num_outputs = forward_inputs, num_outputs
        params = optimizer.parameters
        self.storage = GradientBuffers(params)
        self.buffers = self.storage.buffers
        self.transfer = StageTransfer(layout.pair_group(0))
        if self.stage == 0:
            self.forward = stage_net
            self.backward = FirstStageBackward(stage_net, params, self.buffers)
        else:
            self.last = LastStageStep(stage_net, params, self.buffers, num_inputs + 1)
        shared = [buffer for param, buffer in zip(params, self.buffers) if param.name in stage_shared]
        # the stages' gradients of a shared weight are summed first, in a graph of their own: the pair group is
        # the pp group too, whose collectives in one graph may run in either order
        self.sum_shared = AllReduceInPlace(ParameterTuple(shared), layout.pair_group(0)) if shared else None
        self.apply = ApplyGradients(stage_net, optimizer, self.buffers, layout, grad_reduction, max_grad_norm,
                                    counted_elsewhere=stage_shared if self.stage > 0 else ())

    def _receive(self, shape) -> Tensor:
        return self.transfer(Tensor(np.zeros(shape, np.float32), self.hidden_dtype))

    def __call__(self, micro_batches):
        total = np.zeros(self.num_outputs, np.float64)
        for inputs in micro_batches:
            shape = self.hidden_shape(inputs)
            if self.stage == 0:
                stage_inputs = inputs[:self.forward_inputs]
                self.transfer(self.forward(*stage_inputs))  # activations -> stage 1
                grad_out = self._receive(shape)  # <- their gradient
                self.backward(*stage_inputs, grad_out)
                stats = self.transfer(Tensor(np.zeros(self.num_outputs, np.float32)))  # <- the loss net's outputs
            else:
                hidden_in = self._receive(shape)
                *outputs, grad_in = self.last(*inputs, hidden_in)
                self.transfer(grad_in)
                stats = self.transfer(ops.stack([o.astype(ms.float32) for o in outputs]))
            total += stats.asnumpy().astype(np.float64)
        if self.sum_shared is not None:
            self.sum_shared()
        grad_norm = float(self.apply().asnumpy())
        self.storage.zero()
        return total, grad_norm
