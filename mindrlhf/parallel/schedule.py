"""The 1F1B pipeline schedule (PipeDream-Flush, Megatron's non-interleaved schedule) as a list of steps per stage.

Pure arithmetic, no MindSpore: :class:`mindrlhf.parallel.pipeline.PipelineTrainStep` runs the steps.

Stage ``s`` of ``P`` first runs ``min(P - 1 - s, M)`` forwards (the warm-up that fills the pipeline), then
alternates one forward and one backward, then runs the backwards left (the cool-down). It holds at most
``P - s`` micro-batches in flight. The last stage runs forward and backward of a micro-batch in one step.

Every transfer is between two neighbouring stages. Both ranks of a pair must call their transfers in the same
order, so the two directions of a steady-state exchange are one step on each side:
``send_activation_recv_gradient`` on stage s and ``send_gradient_recv_activation`` on stage s + 1. A rank runs
it as two transfers, the activation first, then the gradient. Both ranks have their own tensor before the
exchange starts, so neither waits for the other's compute inside it.

Steps are tuples ``(kind, micro_batch)``; the two exchanges are ``(kind, sent, received)``.
"""
from __future__ import annotations

COMPUTE = ("forward", "backward", "forward_backward")
WITH_PREVIOUS = ("recv_activation", "send_gradient", "send_gradient_recv_activation")
WITH_NEXT = ("send_activation", "recv_gradient", "send_activation_recv_gradient")


def _ends(stage: int, stages: int, micro_batches: int) -> tuple[bool, bool]:
    """(is `stage` the first, the last) after checking the arguments every schedule takes."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of the pipeline's {stages} stages")
    if micro_batches < 1:
        raise ValueError(f"a pipeline step needs at least one micro-batch, got {micro_batches}")
    return stage == 0, stage == stages - 1


def one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """The steps of `stage` (0-based) in a pipeline of `stages` over `micro_batches` micro-batches, in order."""
    first, last = _ends(stage, stages, micro_batches)
    warmup = min(stages - 1 - stage, micro_batches)
    steady = micro_batches - warmup
    steps: list[tuple] = []
    for i in range(warmup):
        if not first:
            steps.append(("recv_activation", i))
        steps += [("forward", i), ("send_activation", i)]
    if steady and not first:
        steps.append(("recv_activation", warmup))
    for k in range(steady):
        forward, backward = warmup + k, k
        if last:  # no warm-up on the last stage: forward == backward
            steps.append(("forward_backward", forward))
        else:
            steps += [("forward", forward), ("send_activation_recv_gradient", forward, backward),
                      ("backward", backward)]
        if first:
            continue
        if k == steady - 1:
            steps.append(("send_gradient", backward))
        else:
            steps.append(("send_gradient_recv_activation", backward, forward + 1))
    for backward in range(steady, micro_batches):
        steps += [("recv_gradient", backward), ("backward", backward)]
        if not first:
            steps.append(("send_gradient", backward))
    return steps


def one_micro_batch_at_a_time(stage: int, stages: int, micro_batches: int) -> list[tuple]:
    """No overlap: each micro-batch goes forward through every stage and back before the next one starts (the
    baseline `benchmarks/pipeline_memory.py` measures 1F1B against)."""
    first, last = _ends(stage, stages, micro_batches)
    steps: list[tuple] = []
    for i in range(micro_batches):
        if not first:
            steps.append(("recv_activation", i))
        if last:
            steps.append(("forward_backward", i))
        else:
            steps += [("forward", i), ("send_activation", i), ("recv_gradient", i), ("backward", i)]
        if not first:
            steps.append(("send_gradient", i))
    return steps


SCHEDULES = {"1f1b": one_f_one_b, "sequential": one_micro_batch_at_a_time}
