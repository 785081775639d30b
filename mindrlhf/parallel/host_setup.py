"""A process's share of its host, set once at start: CPU kernel threads, cores, the CPU memory pool, and the
data-parallel gradient sums through shared memory when every rank is on this host.

The pure rules (`threads_per_rank`, `cores_of_rank`, `memory_pool_gib`) take numbers; the `configure_*`, `pin_*` and
`share_*` functions apply them to this process (CPU backend only) and return what they set, or None/empty when they
set nothing. Measurements behind the rules: `docs/performance.md`.
"""
from __future__ import annotations

import os

from mindrlhf.parallel.shared_memory import SharedMemoryGroup, available, open_groups

# MindSpore is imported by the functions that apply the rules: `mindrlhf.trainer.launch` imports this module and
# is MindSpore-free (MINDSPORE_FREE in tests/test_architecture.py)


def threads_per_rank(cores: int, ranks_on_host: int, requested: int = 0) -> int:
    """CPU kernel threads for one rank: `requested`, or (0) this host's cores shared evenly by its ranks.

    MindSpore sizes each process's kernel thread pool on its own (25 threads by default); ranks sharing a few
    cores then oversubscribe them, and barrier-style pools wait on each other, so that several ranks on a few
    cores run slower than one process."""
    return requested or max(1, cores // max(1, ranks_on_host))


def cores_of_rank(cores: list[int], ranks_on_host: int, local_rank: int) -> list[int]:
    """This rank's share of the host's `cores`: consecutive, as even as the count allows; every core when the
    host has fewer cores than ranks (they must share them anyway).

    MindSpore's CPU matmuls run on every core the process may use, whatever its kernel thread setting, so ranks
    sharing a host oversubscribe the cores unless each keeps to its own (`docs/performance.md`, "Ranks pinned to
    their cores")."""
    if ranks_on_host <= 1 or len(cores) < ranks_on_host:
        return list(cores)
    return list(cores[local_rank * len(cores) // ranks_on_host:(local_rank + 1) * len(cores) // ranks_on_host])


def memory_pool_gib(host_memory_gib: float, ranks_on_host: int) -> int:
    """The CPU memory pool's initial size for one rank: this host's memory shared evenly by its ranks (at least
    MindSpore's default 2 GiB).

    The pool grows in separate 2 GiB blocks by default, and a buffer never spans two blocks: a train step whose
    gradients and logits are each hundreds of MiB then fragments the blocks, and the pool grows from one call to
    the next; with one block the size of the rank's share it keeps its size from the first call on
    (`docs/performance.md`, "The CPU memory pool grew from one train step to the next"). Reserving the block costs
    nothing until pages are touched."""
    return max(2, int(host_memory_gib // max(1, ranks_on_host)))


def _ranks_on_host(world_size: int) -> int:
    if world_size <= 1:
        return 1
    from mindspore.communication import get_local_rank_size
    return get_local_rank_size()


def configure_cpu_memory_pool(world_size: int) -> int | None:
    """Sizes the CPU backend's memory pool as one block of this rank's share of the host's memory
    (`memory_pool_gib`; once per process, before the first graph runs); returns the GiB set, or None (another
    backend, or the pool was set already)."""
    import mindspore as ms

    if ms.get_context("device_target") != "CPU":
        return None
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gib = memory_pool_gib(host_gib, _ranks_on_host(world_size))
    try:
        ms.runtime.set_memory(init_size=f"{gib}GB")
    except RuntimeError:  # "can not be set repeatedly": a caller (tests, a notebook) chose it already
        return None
    return gib


def configure_cpu_threads(requested: int, world_size: int) -> int | None:
    """Sets the CPU kernel thread pool of this process (CPU backend only, once per process: MindSpore refuses
    a second setting); returns the threads set, or None."""
    import mindspore as ms
    from mindspore._c_expression import RuntimeConf

    if ms.get_context("device_target") != "CPU" or RuntimeConf.get_instance().is_op_threads_num_configured():
        return None
    from mindspore.device_context.cpu.op_tuning import threads_num

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = threads_per_rank(cores, _ranks_on_host(world_size), requested)
    threads_num(threads)
    return threads


def pin_cpu_cores(mode: str, world_size: int) -> list[int] | None:
    """Keeps this process's threads on its share of the host's cores (`cores_of_rank`; CPU backend, several
    ranks on the host, `mode` "auto"); returns the cores it may now use, or None when nothing was pinned.
    Threads created later inherit the setting."""
    import mindspore as ms

    if mode != "auto" or world_size <= 1 or ms.get_context("device_target") != "CPU" or \
            not hasattr(os, "sched_setaffinity"):
        return None
    from mindspore.communication import get_local_rank

    cores = sorted(os.sched_getaffinity(0))
    my_cores = cores_of_rank(cores, _ranks_on_host(world_size), get_local_rank())
    if my_cores == cores:
        return None
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), my_cores)
        except OSError:  # a thread that ended meanwhile
            pass
    return sorted(os.sched_getaffinity(0))


def share_data_parallel_sums(mode: str, layouts, world_size: int, rank: int) -> dict[str, SharedMemoryGroup]:
    """CPU backend with every rank on this host and `mode` "auto": shared-memory groups
    (:mod:`mindrlhf.parallel.shared_memory`) for this rank's data-parallel groups of `layouts` (None entries and
    dp == 1 skipped), by group name in name order, for their gradient sums: hand `groups.get(layout.dp_group)` to
    the train step of a net in `layout` (its `dp_sums`). Otherwise, or without data parallel, {} (MindSpore's
    AllReduce). Every rank must call it with the same layouts (it waits for the others)."""
    import mindspore as ms

    from mindrlhf.parallel.array_collectives import ArrayCollectives

    if mode != "auto" or world_size <= 1 or ms.get_context("device_target") != "CPU" or not available() or \
            _ranks_on_host(world_size) != world_size:
        return {}
    members = {layout.dp_group: layout.dp_group_ranks() for layout in layouts if layout is not None and layout.dp > 1}
    groups = open_groups(members, rank, ArrayCollectives(world_size, rank).barrier)
    return dict(sorted(groups.items()))
