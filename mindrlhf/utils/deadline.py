"""Time limits on a call of Python code (a reward function, one answer's check), nested, on SIGALRM.

A limit is enforced in the main thread only (signals reach no other thread): there `call_with_time_limit` arms
`ITIMER_REAL` for the nearest of the limits in force and raises `TimeLimitExceeded` inside the call when its own
limit passes. An outer limit that passes inside an inner call reaches the outer caller, not the inner one (nor the
call's own `except Exception`), so a caller that treats its own timeout as a result (an answer that took too long
is wrong) never swallows its caller's.
In another thread the call runs without a limit (`limits_enforced()` tells which). A timer set before the first limit
(pytest-timeout's, say) keeps its deadline and handler.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class TimeLimitExceeded(TimeoutError):
    """The call given to `call_with_time_limit` ran past its limit."""


class _LimitPassed(BaseException):
    """Raised inside the call when a limit passes; a BaseException, so that the call's own `except Exception`
    cannot swallow it; `call_with_time_limit` turns its own into `TimeLimitExceeded` and lets an outer one pass."""

    def __init__(self, limit: _Limit):
        super().__init__(limit.seconds)
        self.limit = limit


class _Limit:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.done = False  # its call has ended: its passing no longer matters


_active: list[_Limit] = []  # the main thread's limits in force, outermost first
_saved_handler = None
_foreign_deadline: float | None = None  # a timer someone else had set (e.g. pytest-timeout): kept, and honoured


def limits_enforced() -> bool:
    """Whether a limit set from this thread is enforced (the main thread, where SIGALRM's handler runs)."""
    return threading.current_thread() is threading.main_thread()


def _running() -> list[_Limit]:
    return [limit for limit in _active if not limit.done]


def _on_alarm(signum, frame) -> None:
    global _foreign_deadline
    if _foreign_deadline is not None and _foreign_deadline <= time.monotonic():
        _foreign_deadline = None
        _arm()
        if callable(_saved_handler):
            _saved_handler(signum, frame)  # the timer set before ours: its own handler, as if we were not here
        return
    running = _running()
    if not running:
        return
    passed = min(running, key=lambda limit: limit.deadline)
    if passed.deadline > time.monotonic():  # woken early, or for a call that has ended: wait for the rest
        _arm()
        return
    raise _LimitPassed(passed)


def _arm() -> None:
    deadlines = [limit.deadline for limit in _running()]
    if _foreign_deadline is not None:
        deadlines.append(_foreign_deadline)
    if deadlines:
        signal.setitimer(signal.ITIMER_REAL, max(min(deadlines) - time.monotonic(), 1e-4))
    else:
        signal.setitimer(signal.ITIMER_REAL, 0)


def call_with_time_limit(fn: Callable[..., T], seconds: float | None, *args, **kwargs) -> T:
    """`fn(*args, **kwargs)`, raising `TimeLimitExceeded` if it has not returned after `seconds` (None or 0: no
    limit; no limit either outside the main thread, see the module doc)."""
    global _saved_handler, _foreign_deadline
    if not seconds or not limits_enforced():
        return fn(*args, **kwargs)
    limit = _Limit(float(seconds))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # no alarm while the limits change
    if not _active:
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        _foreign_deadline = time.monotonic() + left if left > 0 else None
        _saved_handler = signal.signal(signal.SIGALRM, _on_alarm)
    _active.append(limit)
    _arm()
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            return fn(*args, **kwargs)
        finally:
            limit.done = True  # an alarm handled from here on is not this call's (no call in between)
    except _LimitPassed as passed:
        if passed.limit is not limit:
            raise  # an outer limit: its caller's to report
        raise TimeLimitExceeded(f"did not return within {limit.seconds:g} s") from None
    finally:
        _remove(limit, mask)


def _remove(limit: _Limit, mask) -> None:
    """Takes `limit` out of force, with the limits set inside its call (left there when an outer limit passing cut
    their clean-up short), SIGALRM blocked meanwhile; the timer re-armed for the limits left, the saved handler back
    once none is."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    signal.setitimer(signal.ITIMER_REAL, 0)
    if limit in _active:
        del _active[_active.index(limit):]
    while signal.sigtimedwait({signal.SIGALRM}, 0) is not None:  # a pending alarm: `_arm` sets the timer anew
        pass
    _arm()  # with no limit left: the foreign timer's rest, if one was set
    if not _active:
        signal.signal(signal.SIGALRM, _saved_handler if _saved_handler is not None else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
