"""Pipeline-parallel training under explicit SPMD: each rank holds one stage of the layers
(`Layout.pp`, `Qwen2Model`'s stage split), activations and their gradients move between neighbouring stages.

On CPU there is no Send/Receive, so a move is an AllReduce(SUM) over the 2-rank group of the neighbours in which
the receiver contributes zeros (:class:`StageTransfer`); on every backend both ranks call it in the same order.
The schedule is 1F1B (:func:`mindrlhf.parallel.schedule.one_f_one_b`), driven from the host with one graph call
per stage and step: stage s warms up with P - 1 - s forwards, then alternates one forward and one backward, so
the stages work on different micro-batches at the same time; the last stage runs forward and backward of the loss
in one graph and sends the gradient of its input back at once. A stage's backward recomputes its forward from the
inputs it kept, so it holds no activations in between. Each stage accumulates its parameters' gradients over the
micro-batches in place; then one update: reduced over dp, clipped by the global norm over pp x tp x dp, AdamW.
The loss net's statistics reach every stage once per step.
"""
from __future__ import annotations

import json

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from mindrlhf.parallel.array_collectives import ArrayCollectives
from mindrlhf.parallel.comm import AllReduceInPlace
from mindrlhf.parallel.layers import to_ms_dtype
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.schedule import SCHEDULES
from mindrlhf.parallel.shared_memory import SharedMemoryGroup
from mindrlhf.parallel.spmd import ApplyGradients, GradientBuffers, add_to_buffers
from mindrlhf.parallel.strategy import ParamLayout


def gather_stage_layouts(local: dict, dtypes: dict, layout: Layout) -> tuple[dict, dict[str, int], dict]:
    """Every stage's parameter layouts of a net in pipeline stages, learnt from the other ranks (each knows its own
    stage's `local` layouts, with full shapes, and the parameters' `dtypes`): (layouts, name -> stage, name ->
    dtype). A world gather on the host; every rank must call it."""
    my_layouts = json.dumps({name: [list(lay.dev_matrix), list(lay.tensor_map), list(lay.full_shape),
                              str(dtypes[name]).lower(), layout.stage] for name, lay in local.items()})
    comm = ArrayCollectives(layout.world_size, layout.rank)
    data = np.frombuffer(my_layouts.encode(), np.uint8).astype(np.int32)  # CPU collectives carry no 8-bit integers
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


class StageLinks:
    """This rank's transfers in a pipeline: from the previous stage and to the next one (their 2-rank pair groups;
    None at the ends), and from the last stage to every stage (the pp group); each an AllReduce(SUM) to which
    the receivers contribute zeros."""

    def __init__(self, layout: Layout):
        self.first, self.last = layout.stage == 0, layout.stage == layout.pp - 1
        self.from_previous = None if self.first else StageTransfer(layout.pair_group(layout.stage - 1))
        self.to_next = None if self.last else StageTransfer(layout.pair_group(layout.stage))
        self.to_every_stage = StageTransfer(layout.pp_group)


def zeros(shape, dtype) -> Tensor:
    """What a receiving rank contributes to a transfer."""
    return Tensor(np.zeros(shape, np.float32), dtype)


class PipelineForward:
    """A forward pass through the stages, no gradients (the critic's values; any last-stage output): each stage
    before the last runs `stage_net` on its inputs (and, after the first, on the previous stage's activations
    [B, S, D] of `hidden_shape(inputs)`) and sends its output on; the last stage's float32 output, of
    `output_shape(inputs)`, reaches every stage. :meth:`map` runs a list of micro-batches, stage s on micro-batch
    i while stage s + 1 is on i - 1, and returns each one's output (Tensors) on every rank; called with one
    micro-batch's input tensors, returns its output, as the one-piece cell does."""

    def __init__(self, stage_net: nn.Cell, layout: Layout, hidden_shape, hidden_dtype, output_shape):
        self.stage_net, self.links = stage_net, StageLinks(layout)
        self.hidden_shape, self.hidden_dtype, self.output_shape = hidden_shape, hidden_dtype, output_shape

    def __call__(self, *inputs) -> Tensor:
        return self.map([inputs])[0]

    def map(self, micro_batches) -> list[Tensor]:
        links, outputs = self.links, []
        for inputs in micro_batches:
            stage_inputs = list(inputs)
            if not links.first:
                stage_inputs.append(links.from_previous(zeros(self.hidden_shape(inputs), self.hidden_dtype)))
            output = self.stage_net(*stage_inputs)
            if links.last:
                outputs.append(output.astype(ms.float32))
            else:
                links.to_next(output)
        # after every micro-batch's forward: a transfer over the whole pp group in between would hold every stage
        # until the last one has finished the micro-batch
        return [links.to_every_stage(outputs[i] if links.last else zeros(self.output_shape(inputs), ms.float32))
                for i, inputs in enumerate(micro_batches)]


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


class StageBackward(nn.Cell):
    """A stage before the last, one micro-batch: recomputes its forward and adds its parameters' gradients, given
    the gradient of its output (the last input), to `buffers`. A stage after the first (`input_grad`) returns the
    gradient w.r.t. its own input `hidden_in` (the forward net's last input), which goes back a stage."""

    def __init__(self, forward_net: nn.Cell, params, buffers, input_grad: bool):
        super().__init__(auto_prefix=False)
        self.forward_net = forward_net
        self.params = params
        self.buffers = buffers
        self.input_grad = input_grad
        self.grad = ops.GradOperation(get_all=input_grad, get_by_list=True, sens_param=True)

    def construct(self, *inputs_and_sens):
        grads = self.grad(self.forward_net, self.params)(*inputs_and_sens)
        if self.input_grad:
            input_grads, param_grads = grads
            return ops.depend(input_grads[-1], add_to_buffers(self.buffers, param_grads))
        return add_to_buffers(self.buffers, grads)


class PipelineTrainStep:
    """One optimizer step of a pipeline of `layout.pp` stages over micro-batches (see the module doc).

    `stage_net` is this rank's stage: on the last stage the loss net, called as `loss_net(*inputs, hidden_in)` and
    returning `(loss, *stats)` (its loss summed over micro-batches must be the batch's loss, as the GRPO loss with
    global token weights); on a stage before it the forward net, `forward_net(*inputs[:forward_inputs])` on the
    first stage and `forward_net(*inputs[:forward_inputs], hidden_in)` on the others, returning the activations
    [B, S, D] (`hidden_shape(inputs)` gives their shape, the receiver needs it). Called with a list of
    micro-batches (each the `num_inputs` input tensors of the loss net but `hidden_in`), returns
    `(outputs, grad_norm)` on every rank: the loss net's outputs summed over the micro-batches (numpy) and the
    global norm before clipping (not finite: the update was skipped). `stage_shared` names the parameters the
    first and the last stage both hold (`Qwen2ForCausalLM.stage_shared_params`): their gradients are summed over
    those two stages. `schedule` names the order of the steps (:data:`mindrlhf.parallel.schedule.SCHEDULES`).
    `dp_sums`: the shared-memory group of `layout.dp_group` the dp gradient sums go through (None = MindSpore's
    AllReduce), as :class:`mindrlhf.parallel.spmd.ApplyGradients`.
    """

    def __init__(self, stage_net: nn.Cell, optimizer: nn.Cell, layout: Layout, hidden_shape, hidden_dtype,
                 num_inputs: int, forward_inputs: int, num_outputs: int, grad_reduction: str = "mean",
                 max_grad_norm: float = 0.0, stage_shared=(), schedule: str = "1f1b",
                 dp_sums: SharedMemoryGroup | None = None):
        if layout.pp < 2:
            raise ValueError(f"a pipeline train step needs at least 2 stages, the layout has {layout.pp}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of {sorted(SCHEDULES)}")
        self.schedule = SCHEDULES[schedule]
        self.layout, self.stage, self.links = layout, layout.stage, StageLinks(layout)
        self.hidden_shape, self.hidden_dtype = hidden_shape, hidden_dtype
        self.forward_inputs, self.num_outputs = forward_inputs, num_outputs
        params = optimizer.parameters
        self.storage = GradientBuffers(params)
        self.buffers = self.storage.buffers
        if self.links.last:
            self.last = LastStageStep(stage_net, params, self.buffers, num_inputs + 1)
        else:
            self.forward = stage_net
            self.backward = StageBackward(stage_net, params, self.buffers, input_grad=not self.links.first)
        shared = [buffer for param, buffer in zip(params, self.buffers) if param.name in stage_shared]
        # the end stages' gradients of a shared weight are summed first, in a graph of their own: with 2 stages
        # their group is the pp group too, whose collectives in one graph may run in either order
        self.sum_shared = AllReduceInPlace(ParameterTuple(shared), layout.end_stages_group) if shared else None
        self.apply = ApplyGradients(stage_net, optimizer, self.buffers, layout, grad_reduction, max_grad_norm,
                                    counted_elsewhere=stage_shared if self.stage > 0 else (), dp_sums=dp_sums)

    def __call__(self, micro_batches):
        links, dtype = self.links, self.hidden_dtype
        shapes = [self.hidden_shape(inputs) for inputs in micro_batches]
        total = np.zeros(self.num_outputs, np.float64)
        received, kept, sent, grads_out, grads_in = {}, {}, {}, {}, {}  # by micro-batch, while in flight

        def receive(link, micro):
            return link(zeros(shapes[micro], dtype))

        for kind, micro, *other in self.schedule(self.stage, self.layout.pp, len(micro_batches)):
            if kind == "recv_activation":
                received[micro] = receive(links.from_previous, micro)
            elif kind == "forward":
                first_inputs = list(micro_batches[micro][:self.forward_inputs])
                kept[micro] = first_inputs + ([] if links.first else [received.pop(micro)])
                sent[micro] = self.forward(*kept[micro])
            elif kind == "forward_backward":
                *outputs, grads_in[micro] = self.last(*micro_batches[micro], received.pop(micro))
                total += ops.stack([o.astype(ms.float32) for o in outputs]).asnumpy().astype(np.float64)
            elif kind == "backward":
                grad_in = self.backward(*kept.pop(micro), grads_out.pop(micro))
                if not links.first:
                    grads_in[micro] = grad_in
            elif kind == "send_activation":
                links.to_next(sent.pop(micro))
            elif kind == "recv_gradient":
                grads_out[micro] = receive(links.to_next, micro)
            elif kind == "send_gradient":
                links.from_previous(grads_in.pop(micro))
            elif kind == "send_activation_recv_gradient":  # the activation first, on both sides of the pair
                links.to_next(sent.pop(micro))
                grads_out[other[0]] = receive(links.to_next, other[0])
            elif kind == "send_gradient_recv_activation":
                received[other[0]] = receive(links.from_previous, other[0])
                links.from_previous(grads_in.pop(micro))
            else:
                raise AssertionError(f"unknown pipeline step {kind}")
        total = links.to_every_stage(Tensor(total if links.last else np.zeros_like(total), ms.float32))
        if self.sum_shared is not None:
            self.sum_shared()
        grad_norm = float(self.apply().asnumpy())
        self.storage.zero()
        return total.asnumpy().astype(np.float64), grad_norm
