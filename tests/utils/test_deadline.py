"""Time limits on a call (`mindrlhf.utils.deadline`): the call is stopped at its limit even when it swallows every
Exception, nested limits reach their own callers, other threads run unbounded, and an alarm due just as a call ends
never escapes it nor leaves a limit behind."""
import random
import signal
import threading
import time

import pytest

from mindrlhf.utils import deadline
from mindrlhf.utils.deadline import TimeLimitExceeded, call_with_time_limit


def swallowing_sleep(seconds):
    try:
        time.sleep(seconds)
    except Exception:
        return "swallowed"
    return "slept"


def test_a_call_past_its_limit_raises_even_if_it_catches_every_exception():
    handler, timer = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="did not return within 0.2 s"):
        call_with_time_limit(swallowing_sleep, 0.2, 30)
    assert 0.19 < time.monotonic() - start < 2
    assert call_with_time_limit(swallowing_sleep, 5, 0.01) == "slept"
    assert call_with_time_limit(lambda: 3, None) == 3 and call_with_time_limit(lambda: 4, 0) == 4
    assert deadline._active == [] and signal.getsignal(signal.SIGALRM) is handler
    if timer:  # a timer set before (pytest-timeout's) runs on, less the time spent here
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] < timer


def test_a_timer_set_before_keeps_its_deadline_and_handler():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(time.monotonic()))
    saved_timer = signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        start = time.monotonic()
        with pytest.raises(TimeLimitExceeded):
            call_with_time_limit(swallowing_sleep, 1.0, 30)  # the foreign alarm at 0.3 s is its handler's
        assert len(fired) == 1 and 0.29 < fired[0] - start < 0.6
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, *saved_timer)


def test_an_outer_limit_reaches_the_outer_caller_through_inner_ones():
    def inner_calls():
        results = []
        for _ in range(10):
            try:
                results.append(call_with_time_limit(swallowing_sleep, 0.15, 30))
            except TimeLimitExceeded:
                results.append("inner timeout")  # the inner caller treats its own timeout as a result
        return results

    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded, match="within 0.4 s"):
        call_with_time_limit(inner_calls, 0.4)
    assert time.monotonic() - start < 1.0  # not 10 x 0.15 s: the outer limit was not swallowed by the inner caller
    assert call_with_time_limit(inner_calls, 30)[:2] == ["inner timeout"] * 2
    assert deadline._active == []


def test_another_thread_runs_without_a_limit():
    results = []
    worker = threading.Thread(target=lambda: results.append(call_with_time_limit(swallowing_sleep, 0.05, 0.2)))
    worker.start()
    worker.join()
    assert results == ["slept"] and deadline.limits_enforced()


def test_an_alarm_due_as_the_call_ends_never_escapes_nor_stays():
    """Calls that end within microseconds of their limit, either side: each returns or raises TimeLimitExceeded,
    and leaves no limit in force (an alarm handled in the clean-up once escaped as the internal BaseException)."""
    rng = random.Random(0)
    outcomes = set()
    for _ in range(1500):
        end = time.monotonic() + 0.001 + rng.uniform(-300e-6, 200e-6)

        def spin(end):
            while time.monotonic() < end:
                pass
            return "done"

        try:
            outcomes.add(call_with_time_limit(spin, 0.001, end))
        except TimeLimitExceeded:
            outcomes.add("timeout")
        assert deadline._active == []
    assert "timeout" in outcomes and outcomes <= {"done", "timeout"}  # past its end a spin always times out
