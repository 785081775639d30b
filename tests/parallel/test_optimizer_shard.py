"""ZeRO-1: AdamW moments sharded over data parallel (`mindrlhf.optim.ShardedAdamW`): the slice arithmetic, the
trainer's wiring, and a dp=2 msrun run that must equal plain AdamW bit for bit (and its resume)."""
import os
import sys
from types import SimpleNamespace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor
from support.cells import ApplyGrads
from support.msrun import load_ranks, run_command, run_worker
from support.paths import TOOLS
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.optim import AdamW, ShardedAdamW, flat_shard, join_shards, shard_bounds, shard_length


# ---------------------------------------------------------------- slice arithmetic (numpy)
@pytest.mark.parametrize("numel,dp", [(15, 2), (16, 2), (1, 2), (5, 4), (7, 3), (96 * 32, 4), (3, 8)])
def test_slices_are_equal_contiguous_and_cover_the_parameter_once(numel, dp):
    length = shard_length(numel, dp)
    assert 0 <= length * dp - numel < dp  # padding only to the next multiple of dp
    bounds = [shard_bounds(numel, dp, r) for r in range(dp)]
    covered = np.concatenate([np.arange(start, end) for start, end in bounds])
    np.testing.assert_array_equal(covered, np.arange(numel))  # in order, each element once
    assert all(end - start <= length for start, end in bounds)


def test_slice_bounds_of_known_cases():
    assert shard_length(15, 2) == 8 and shard_bounds(15, 2, 0) == (0, 8) and shard_bounds(15, 2, 1) == (8, 15)
    assert shard_bounds(5, 4, 2) == (4, 5) and shard_bounds(5, 4, 3) == (5, 5)  # rank 3 holds only padding
    with pytest.raises(ValueError):
        shard_bounds(5, 2, 2)


@pytest.mark.parametrize("shape,dp", [((5, 3), 2), ((5, 3), 4), ((1,), 2), ((4, 6), 2), ((2, 3, 5), 3)])
def test_flat_shards_round_trip_with_zero_padding(shape, dp):
    array = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape)
    shards = [flat_shard(array, dp, r) for r in range(dp)]
    assert {s.shape for s in shards} == {(shard_length(array.size, dp),)}
    np.testing.assert_array_equal(np.concatenate(shards)[array.size:], 0)  # the padding is zeros
    np.testing.assert_array_equal(shards[0][:2], array.reshape(-1)[:2])
    np.testing.assert_array_equal(join_shards(shards, shape), array)
    with pytest.raises(ValueError):
        join_shards(shards[:-1] + [shards[-1][:-1]], shape)


# ---------------------------------------------------------------- one process
def test_sharding_over_one_rank_is_plain_adamw(graph_mode):
    shapes = {"w": (5, 3), "b": (7,)}
    rng = np.random.default_rng(0)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    grads = [tuple(Tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes.values()) for _ in range(3)]
    results = []
    for make in (lambda ps: AdamW(ps, learning_rate=1e-2, weight_decay=0.1),
                 lambda ps: ShardedAdamW(ps, 1, 0, None, learning_rate=1e-2, weight_decay=0.1)):
        params = [Parameter(Tensor(v.copy()), name=k) for k, v in start.items()]
        optimizer = make(params)
        step = ApplyGrads(optimizer)
        for g in grads:
            step(g, Tensor(0.5, ms.float32))
        results.append(({p.name: p.asnumpy() for p in params}, [m.asnumpy() for m in optimizer.moments1]))
    (plain, plain_m), (sharded, sharded_m) = results
    for name in shapes:
        assert np.abs(plain[name] - start[name]).max() > 1e-3  # it moved
        np.testing.assert_array_equal(sharded[name], plain[name])
    for m_plain, m_sharded in zip(plain_m, sharded_m):
        np.testing.assert_array_equal(m_sharded, m_plain.reshape(-1))  # one flat slice of the whole moment


def test_bad_shard_arguments_are_refused():
    param = Parameter(Tensor(np.zeros((2, 2), np.float32)), name="w")
    for dp, rank, group in ((2, 2, "g"), (2, 0, None), (0, 0, None)):
        with pytest.raises(ValueError):
            ShardedAdamW([param], dp, rank, group)


@pytest.mark.parametrize("shard,dp,sharded", [(True, 2, True), (False, 2, False), (True, 1, False)])
def test_the_jobs_optimizer_is_sharded_by_the_model_yaml(shard, dp, sharded):
    from mindrlhf.configs.parallel import ParallelConfig
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.roles import adamw

    optimizer_config = SimpleNamespace(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    parallel_config = ParallelConfig(data_parallel=dp, optimizer_shard=shard)
    net = SimpleNamespace(model=SimpleNamespace(parallel_config=parallel_config), layout=Layout(dp=dp, tp=1))
    params = [Parameter(Tensor(np.zeros((3, 3), np.float32)), name=f"w{dp}{shard}")]
    optimizer = adamw(optimizer_config, net, params, "critic_")
    assert isinstance(optimizer, ShardedAdamW) is sharded
    assert optimizer.moments1[0].shape == ((5,) if sharded else (3, 3))
    assert optimizer.adam_step.name == "critic_adam_step"


def test_trainer_checkpoints_with_sharded_moments_keep_whole_weights_for_the_tools(tmp_path):
    """A dp=2 step folder whose moments are flat slices: the weights merge as before (convert_weight --reverse's
    path), and tools/transform_checkpoint.py merges the weights and says that it copies the moments unchanged."""
    from mindrlhf.checkpoint.step import rank_dir, save_parameters
    from mindrlhf.checkpoint.weights import merge_trainer_checkpoint
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.parallel.strategy import layouts_for, write_strategy_file

    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    write_strategy_file(tmp_path / "train_strategy.ckpt", layouts_for(
        Layout(dp=2, tp=1), {k: None for k in weights}, {k: v.shape for k, v in weights.items()}))
    for rank in range(2):
        os.makedirs(rank_dir(str(tmp_path), rank))
        params = [Parameter(Tensor(v), name=k) for k, v in weights.items()]
        params += [Parameter(Tensor(flat_shard(v + 1, 2, rank)), name=f"adam_m.{k}") for k, v in weights.items()]
        save_parameters(params, os.path.join(rank_dir(str(tmp_path), rank), "train.ckpt"))
    merged = merge_trainer_checkpoint(str(tmp_path))
    assert merged.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(merged[name], value)
    res = run_command([sys.executable, str(TOOLS / "transform_checkpoint.py"), "--src_checkpoint", str(tmp_path),
                       "--src_strategy", str(tmp_path / "train_strategy.ckpt"), "--dst_checkpoint",
                       str(tmp_path / "out")], {**os.environ, "GLOG_v": "3"}, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "adam_m.b, adam_m.w" in res.stderr  # named as copied unchanged
    (out,) = (tmp_path / "out" / "rank_0").glob("*.ckpt")
    state = ms.load_checkpoint(str(out))
    for name, value in weights.items():
        np.testing.assert_array_equal(state[name].asnumpy(), value)


# ---------------------------------------------------------------- msrun, dp=2
@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("shard_dp2")
    run_worker("optimizer_shard_worker.py", ["--dp", "2", "--out", str(out)], 2, out / "log")
    return out, load_ranks(out, 2)


def _named(rank: dict, prefix: str) -> dict:
    return {k.split("/", 1)[1]: v for k, v in rank.items() if k.startswith(prefix + "/")}


@pytest.mark.msrun
def test_sharded_updates_equal_plain_adamw_bit_for_bit(dp2):
    """3 clipped updates: the same element-wise kernel on the same numbers, and x + 0 in the assembling sum is
    exact, so the weights are equal, not close."""
    _, ranks = dp2
    for rank in ranks:
        assert (rank["plain_norms"] > 10 * rank["max_grad_norm"]).all()  # every update clipped
        np.testing.assert_array_equal(rank["sharded_norms"], rank["plain_norms"])
        plain, sharded = _named(rank, "plain"), _named(rank, "sharded")
        assert len(plain) > 10 and plain.keys() == sharded.keys()
        for name, value in plain.items():
            np.testing.assert_array_equal(sharded[name], value, err_msg=name)
        odd_plain, odd_sharded = _named(rank, "odd_plain"), _named(rank, "odd_sharded")
        assert odd_plain.keys() == odd_sharded.keys() == {"odd.w", "odd.b", "odd.one"}
        for name, value in odd_plain.items():
            np.testing.assert_array_equal(odd_sharded[name], value, err_msg=name)
        assert float(rank["sharded_state/adam_step"]) == int(rank["adam/updates"]) == 3  # none skipped


@pytest.mark.msrun
def test_each_rank_holds_its_half_of_the_moments(dp2):
    """Rank r's moments are the r-th flat slice of plain AdamW's (bit for bit): half the size, and together whole."""
    _, ranks = dp2
    plain_state = _named(ranks[0], "plain_state")
    moments = {k: v for k, v in plain_state.items() if k.startswith(("adam_m.", "adam_v."))}
    assert len(moments) > 20
    full = sum(v.size for v in moments.values())
    for rank in ranks:
        held = _named(rank, "sharded_state")
        assert held.keys() == plain_state.keys()
        assert sum(held[k].size for k in moments) == full // 2  # every size even in this model: no padding
        np.testing.assert_array_equal(held["adam_step"], plain_state["adam_step"])
    for name, value in moments.items():
        np.testing.assert_array_equal(join_shards([r["sharded_state/" + name] for r in ranks], value.shape), value,
                                      err_msg=name)
    for name, value in _named(ranks[0], "odd_plain_state").items():  # padded: rank 1 holds odd.one's padding only
        shards = [r["odd_sharded_state/" + name] for r in ranks]
        np.testing.assert_array_equal(join_shards(shards, value.shape), value, err_msg=name)
    assert ranks[0]["odd_sharded_state/adam_v.odd.one"][0] > 0
    assert ranks[1]["odd_sharded_state/adam_v.odd.one"].tolist() == [0.0]


@pytest.mark.msrun
def test_resume_from_the_sharded_checkpoint_equals_the_straight_run(dp2):
    out, ranks = dp2
    for rank, values in enumerate(ranks):
        straight, resumed = _named(values, "sharded"), _named(values, "resumed")
        np.testing.assert_array_equal(values["resumed_norms"], values["sharded_norms"][-1:])
        for name, value in straight.items():
            np.testing.assert_array_equal(resumed[name], value, err_msg=name)
        # the rank file: whole weights, this rank's flat slice of each moment
        state = ms.load_checkpoint(str(out / f"rank_{rank}.ckpt"))
        for name, value in straight.items():
            assert tuple(state[name].shape) == value.shape
            assert tuple(state["adam_m." + name].shape) == (shard_length(value.size, 2),)
        assert set(values["saved_optimizer_entries"]) == {f"adam_{m}.{n}" for m in "mv" for n in straight} | {
            "adam_step", "learning_rate"}


@pytest.mark.msrun
def test_micro_batched_sharded_updates_equal_whole_batch_ones(dp2):
    """Gradient accumulation (buffers reduced over dp in place, the optimizer in `ApplyGradients`, as the pipeline
    step calls it) with sharded moments: the sums are added in another order, so in lr units
    (tests/support/tolerances.py)."""
    _, ranks = dp2
    for rank in ranks:
        np.testing.assert_allclose(rank["micro_norms"], rank["plain_norms"], rtol=1e-5)
        plain = _named(rank, "plain")
        assert_weights_close_after_adam(_named(rank, "micro"), plain, float(rank["adam/lr"]),
                                        int(rank["adam/updates"]), what="micro-batched, sharded")
