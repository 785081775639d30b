"""The 1F1B schedule's steps, run on a simulated pipeline: every pair of neighbours calls matching transfers in the
same order (no deadlock, no tensor summed with the wrong one), each stage computes what it has received, and the
stages overlap as 1F1B promises."""
import pytest

from mindrlhf.parallel.schedule import COMPUTE, SCHEDULES, WITH_NEXT, WITH_PREVIOUS, one_f_one_b

# what stage s sends in a pair transfer -> what stage s + 1 calls at the same time
PARTNER = {"send_activation": "recv_activation", "recv_gradient": "send_gradient",
           "send_activation_recv_gradient": "send_gradient_recv_activation"}


def simulate(stages: int, micro_batches: int, forward=1.0, backward=2.0, schedule=one_f_one_b):
    """Run every stage's steps; a compute step takes its time, a transfer waits for its partner (free otherwise).
    Returns the time the last stage finishes and the peak number of micro-batches a stage holds."""
    schedules = [schedule(s, stages, micro_batches) for s in range(stages)]
    position, clock = [0] * stages, [0.0] * stages
    activations = [set() for _ in range(stages)]  # received, not yet used by a forward
    gradients = [set() for _ in range(stages)]
    in_flight, peak = [set() for _ in range(stages)], [0] * stages
    cost = {"forward": forward, "backward": backward + forward, "forward_backward": forward + backward}

    def step(s):
        return schedules[s][position[s]] if position[s] < len(schedules[s]) else None

    progressed = True
    while progressed:
        progressed = False
        for s in range(stages):
            current = step(s)
            if current is None:
                continue
            kind, micro = current[0], current[1]
            if kind in COMPUTE:
                if kind in ("forward", "forward_backward") and s > 0:
                    assert micro in activations[s], f"stage {s} runs forward {micro} before receiving it"
                    activations[s].discard(micro)
                if kind == "forward":
                    in_flight[s].add(micro)
                    peak[s] = max(peak[s], len(in_flight[s]))
                if kind == "backward":
                    assert micro in gradients[s] and micro in in_flight[s], f"stage {s} backward {micro} too early"
                    gradients[s].discard(micro)
                    in_flight[s].discard(micro)
                clock[s] += cost[kind]
                position[s] += 1
                progressed = True
                continue
            if kind in WITH_NEXT:
                partner = step(s + 1)
                if partner is None or partner[0] != PARTNER[kind]:
                    continue  # waits for stage s + 1 to reach its side
                assert partner[1:] == current[1:][::-1] if len(current) == 3 else partner[1] == micro, \
                    f"pair ({s}, {s + 1}) transfers {current} against {partner}"
                if kind != "recv_gradient":
                    activations[s + 1].add(micro)
                if kind != "send_activation":
                    gradients[s].add(current[-1])
                clock[s] = clock[s + 1] = max(clock[s], clock[s + 1])
                position[s] += 1
                position[s + 1] += 1
                progressed = True
            else:
                assert kind in WITH_PREVIOUS and s > 0, f"stage {s} has a transfer with no partner: {current}"
    stuck = [(s, step(s)) for s in range(stages) if step(s) is not None]
    assert not stuck, f"the pipeline deadlocks: {stuck}"
    for s in range(stages):
        forwards = [m for kind, m, *_ in schedules[s] if kind in ("forward", "forward_backward")]
        backwards = [m for kind, m, *_ in schedules[s] if kind in ("backward", "forward_backward")]
        assert forwards == backwards == list(range(micro_batches))
        assert not in_flight[s] and not gradients[s] and not activations[s]
    return max(clock), peak


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 8, 16])
def test_every_pair_calls_matching_transfers_in_the_same_order(stages, micro_batches, schedule):
    simulate(stages, micro_batches, schedule=SCHEDULES[schedule])


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 4), (4, 8), (3, 16)])
def test_stages_overlap_and_hold_few_micro_batches(stages, micro_batches):
    """With equal stages, 1F1B takes (M + P - 1) micro-batch times of one stage (the sequential order M x P), and
    stage s holds at most P - s micro-batches (GPipe: all M)."""
    makespan, peak = simulate(stages, micro_batches, forward=1.0, backward=2.0)
    one_micro_batch = 1.0 + 2.0 + 1.0  # forward, backward and the backward's recomputed forward
    assert makespan <= (micro_batches + stages - 1) * one_micro_batch
    no_overlap, _ = simulate(stages, micro_batches, forward=1.0, backward=2.0, schedule=SCHEDULES["sequential"])
    assert no_overlap == micro_batches * (stages * one_micro_batch - 1.0)  # the last stage recomputes nothing
    assert makespan < no_overlap
    assert peak[:-1] == [min(stages - s, micro_batches) for s in range(stages - 1)]


def test_the_two_stage_schedule_reads_like_1f1b():
    assert one_f_one_b(0, 2, 3) == [
        ("forward", 0), ("send_activation", 0),
        ("forward", 1), ("send_activation_recv_gradient", 1, 0), ("backward", 0),
        ("forward", 2), ("send_activation_recv_gradient", 2, 1), ("backward", 1),
        ("recv_gradient", 2), ("backward", 2)]
    assert one_f_one_b(1, 2, 3) == [
        ("recv_activation", 0), ("forward_backward", 0), ("send_gradient_recv_activation", 0, 1),
        ("forward_backward", 1), ("send_gradient_recv_activation", 1, 2),
        ("forward_backward", 2), ("send_gradient", 2)]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_stage_outside_the_pipeline_is_an_error(schedule):
    with pytest.raises(ValueError, match="stage 2 is not one of the pipeline's 2 stages"):
        SCHEDULES[schedule](2, 2, 4)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        SCHEDULES[schedule](0, 2, 0)
