"""AllReduce(SUM) through shared memory (mindrlhf.parallel.shared_memory) among processes of this host: groups set
up by `open_groups`, sums, the same bits on every member, into a new array or in place, chunks, mismatches reported,
nothing left in /dev/shm."""
import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest

import mindrlhf.parallel.shared_memory as hc

pytestmark = pytest.mark.skipif(not hc.available(), reason="no /dev/shm or FIFOs on this host")


def member_inputs(index: int):
    rng = np.random.default_rng(index)
    return [rng.standard_normal((3, 5)).astype(np.float32),  # one chunk
            rng.standard_normal(1000).astype(np.float64),
            rng.integers(-5, 5, (7,)).astype(np.int32),
            rng.standard_normal((4, 300)).astype(np.float32),  # several chunks of CHUNK_BYTES (set small below)
            np.float16(index + 0.5) * np.ones(2, np.float16)]


def member(index: int, size: int, key: str, barrier, results, mismatch: bool):
    hc.CHUNK_BYTES = 1024
    try:
        groups = hc.open_groups({"g": list(range(10, 10 + size)), "alone": [10 + index]}, 10 + index, barrier.wait,
                                key=key)
        assert list(groups) == ["g"]  # a group of one rank is left out
        group = groups["g"]
        if mismatch:
            x = np.zeros(4 if index == 0 else 5, np.float32)
            try:
                group.all_reduce(x)
            except hc.CollectiveError as err:
                results[index] = ("error", str(err))
            group.close()
            return
        outputs = [group.all_reduce(x) for _ in range(3) for x in member_inputs(index)]
        in_place = member_inputs(index)
        for x in in_place:
            group.all_reduce_in_place(x)
        group.close()
        results[index] = ("ok", [o.tobytes() for o in outputs], [o.dtype.str for o in outputs],
                          [o.shape for o in outputs], [x.tobytes() for x in in_place])
    except Exception as err:  # reported to the test
        results[index] = ("exception", repr(err))


def run_members(size: int, mismatch: bool = False):
    ctx = mp.get_context("fork")
    key = f"test-{uuid.uuid4().hex[:8]}"
    manager = ctx.Manager()
    results, barrier = manager.dict(), ctx.Barrier(size)
    procs = [ctx.Process(target=member, args=(i, size, key, barrier, results, mismatch)) for i in range(size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    leftovers = [name for name in os.listdir(hc.ROOT) if key in name]
    return dict(results), leftovers


@pytest.mark.parametrize("size", [2, 3])
def test_members_get_the_sum_with_the_same_bits(size):
    results, leftovers = run_members(size)
    assert sorted(results) == list(range(size)), results
    assert all(result[0] == "ok" for result in results.values()), results
    expected = [sum(member_inputs(i)[k] for i in range(size)) for _ in range(3) for k in range(5)]
    mine = results[0]
    for got, dtype, shape, want in zip(mine[1], mine[2], mine[3], expected):
        assert dtype == want.dtype.str and tuple(shape) == want.shape
        np.testing.assert_allclose(np.frombuffer(got, dtype).reshape(shape), want, rtol=1e-6)
    for index in range(1, size):
        assert results[index][1] == mine[1]  # bit for bit: every member adds in the same order
    for index in range(size):  # summed into the members' own arrays (chunk by chunk): the same bits
        assert results[index][4] == mine[1][:5]
    assert leftovers == []  # the files are unlinked once every member has them open


def test_members_that_disagree_raise_instead_of_summing():
    results, leftovers = run_members(2, mismatch=True)
    assert all(result[0] == "error" for result in results.values()), results
    assert all("differ in order or shape" in result[1] for result in results.values())
    assert leftovers == []


def test_a_group_that_was_not_set_up_refuses_to_sum():
    group = hc.SharedMemoryGroup("alone", [0, 1], 0, key=f"test-{uuid.uuid4().hex[:8]}")
    try:
        with pytest.raises(hc.CollectiveError, match="set up incompletely"):
            group.all_reduce(np.ones(3, np.float32))
    finally:
        group.unlink_own()
        group.close()


def test_a_member_makes_the_folder_again_when_a_peer_removes_it_before_the_members_file_is_made(monkeypatch):
    """A peer removes the group's folder once it holds no file (after the peer's last slot went); when that falls
    between this member making the folder and creating its tensor's file, the member makes both again instead of
    failing the step (seen under load: FileNotFoundError for its own slot)."""
    group = hc.SharedMemoryGroup("race", [0, 1], 0, key=f"test-{uuid.uuid4().hex[:8]}")
    group.unlink_own()  # set up: the FIFO names and the folder gone, as after `open_groups`
    made, makedirs = [], os.makedirs

    def makedirs_then_the_peer_removes_it(path, *args, **kwargs):
        makedirs(path, *args, **kwargs)
        made.append(path)
        if len(made) == 1:
            os.rmdir(path)  # the peer's `_remove_folder` of the empty folder, between the member's two calls

    monkeypatch.setattr(hc.os, "makedirs", makedirs_then_the_peer_removes_it)
    try:
        slot = group._slot(0, 0, 16)
        assert made == [group.folder, group.folder]
        assert os.path.getsize(os.path.join(group.folder, "slot.0.0.16")) == len(slot) == hc.HEADER_BYTES + 16
    finally:
        monkeypatch.undo()
        group.close()
    assert not os.path.exists(group.folder)
