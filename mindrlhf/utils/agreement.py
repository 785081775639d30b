"""The ranks of a job agree on whether a piece of host work failed anywhere before any of them goes on.

A rank that raised between two collectives would leave its peers waiting in the next one until MindSpore's
collective timeout (minutes) or the scheduler's heartbeat wall. Instead, every rank reaches the same agreement
point, reports whether it failed (one flag per rank, summed over the world), and then all of them stop together:
the failed rank with its own one-line error, the others naming the rank(s) that failed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

# every rank calls it at the same point with whether it failed; returns the ranks that did, on every rank
FailedRanks = Callable[[bool], Sequence[int]]


class PeerFailure(RuntimeError):
    """Another rank failed at an agreement point; this rank stops with it."""


def agree(failed_ranks: FailedRanks, failure: BaseException | None, where: str) -> None:
    """Every rank's verdict on `where`: returns when no rank failed; otherwise the failed ranks raise their own
    `failure` and the others a `PeerFailure` naming them."""
    failed = list(failed_ranks(failure is not None))
    if failure is not None:
        raise failure
    if failed:
        raise PeerFailure(f"stopped at {where}: rank {', '.join(map(str, failed))} failed there (its error line "
                          "says why)")


@contextlib.contextmanager
def agreed(failed_ranks: FailedRanks, where: str) -> Iterator[None]:
    """Runs the block, then `agree`s on it: an exception inside the block (on any rank) ends every rank here."""
    failure = None
    try:
        yield
    except Exception as err:  # every kind: the agreement, not the exception, decides how the ranks stop
        failure = err
    agree(failed_ranks, failure, where)
