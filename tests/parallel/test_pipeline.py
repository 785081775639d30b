"""Pipeline stages: the layout's coordinates and groups, the decoder split into stages, and (msrun) a GRPO train step
in 2 or 4 stages over micro-batches equal to the whole model in one process. (The online reshard from pipeline
stages: tests/parallel/test_reshard.py.)"""
import numpy as np
import pytest
from support.cases import Run, Runs, selected, waits_for
from support.configs import tiny_qwen2_config
from support.msrun import load_ranks
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.algorithms.policy_cells import GRPOLossNet
from mindrlhf.parallel.layout import Layout, LayoutError

STAGED = dict(num_layers=4, n_kv_heads=2)  # the tiny Qwen2 (support.configs) with 4 layers to split


def test_pipeline_coordinates_groups_and_pairs():
    # MindSpore's order: stages outermost, then [dp, tp] with tp fastest
    layout = Layout(dp=1, tp=2, pp=2, rank=3)
    assert layout.world_size == 4 and layout.stage == 1 and layout.coords() == (0, 1)
    assert layout.tp_group_ranks() == [2, 3] and layout.dp_group_ranks() == [3]
    assert layout.pp_group_ranks() == [1, 3] and layout.next_stage_pair(0) == [1, 3]
    assert str(layout) == "dp=1 x tp=2 x pp=2"
    assert layout.end_stage_ranks() == [1, 3]  # with 2 stages the end stages are the neighbours
    four = Layout(dp=1, tp=1, pp=4, rank=2)
    assert four.stage == 2 and four.next_stage_pair(1) == [1, 2] and four.next_stage_pair(2) == [2, 3]
    assert four.end_stage_ranks() == [0, 3] and Layout(dp=2, tp=1, pp=4, rank=5).end_stage_ranks() == [1, 7]
    wide = Layout(dp=2, tp=1, pp=2, rank=2)
    assert wide.stage == 1 and wide.dp_group_ranks() == [2, 3] and wide.pp_group_ranks() == [0, 2]
    with pytest.raises(LayoutError, match=r"data_parallel=1 x model_parallel=2 x pipeline_stage=2 = 4 ranks, but "
                                          r"the job has 2"):
        Layout.for_world(1, 2, 2, 0, pp=2)


@pytest.mark.usefixtures("graph_mode")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_two_stages_compose_to_the_whole_model(tied):
    """Stage 0 (embedding, layers 0-1) feeding stage 1 (layers 2-3, norm, head) gives the whole model's GRPO loss
    outputs; stage parameters keep their global names. A tied embedding is held by both stages (the last scores
    with its copy), and only it."""
    import mindspore as ms

    from mindrlhf.algorithms import GRPOLossCell
    from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseHidden
    from mindrlhf.models.qwen2 import Qwen2ForCausalLM
    from mindrlhf.parallel.layers import init_random_weights

    cfg = tiny_qwen2_config(**STAGED, tie_word_embeddings=tied)
    whole = Qwen2ForCausalLM(cfg)
    stages = [Qwen2ForCausalLM(cfg, Layout(pp=2, rank=r)) for r in range(2)]
    for net, layout in ((whole, Layout()), (stages[0], Layout(pp=2, rank=0)), (stages[1], Layout(pp=2, rank=1))):
        init_random_weights(net, layout, seed=3)
    names = [sorted(p.name for p in net.trainable_params()) for net in stages]
    shared = set(names[0]) & set(names[1])
    assert shared == set(stages[0].stage_shared_params) == set(stages[1].stage_shared_params)
    assert shared == ({"model.tok_embeddings.embedding_weight"} if tied else set())
    assert whole.stage_shared_params == ()
    assert sorted(set(names[0]) | set(names[1])) == sorted(p.name for p in whole.trainable_params())
    assert "model.tok_embeddings.embedding_weight" in names[0] and "model.layers.1.ffn_norm.weight" in names[0]
    assert "model.layers.2.ffn_norm.weight" in names[1] and ("lm_head.weight" in names[1]) != tied
    assert not any(".layers.0." in n or ".layers.1." in n for n in names[1])
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, 96, (2, 5)).astype(np.int32), np.ones((2, 5), np.int32),
             rng.integers(0, 96, (2, 4)).astype(np.int32), np.ones((2, 4), np.int32)]
    batch += [rng.normal(-4, 0.1, (2, 4)).astype(np.float32), rng.normal(-4, 0.1, (2, 4)).astype(np.float32),
              np.array([1.0, -1.0], np.float32), np.full((2, 4), 1 / 8, np.float32)]
    tensors = [ms.Tensor(a) for a in batch]
    cell = GRPOLossCell(beta=0.05, epsilon_low=0.2, epsilon_high=0.2, kl_estimator="k3")
    expected = [o.asnumpy() for o in GRPOLossNet(whole, cell)(*tensors)]
    hidden = ResponseHidden(stages[0])(*tensors[:4])
    assert hidden.shape == (2, 8, 32)
    got = [o.asnumpy() for o in GRPOLossNet(stages[1], cell)(*tensors, hidden)]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.usefixtures("graph_mode")
def test_value_model_stages_compose_to_the_whole_values():
    """A value model (the critic) with its 4 layers in 2 and in 4 stages: each stage's hidden states fed to the
    next give the whole model's response values; only the last stage holds the head."""
    import mindspore as ms

    from mindrlhf.algorithms.policy_cells import ResponseHidden, ResponseValues
    from mindrlhf.models.qwen2 import Qwen2ForValue
    from mindrlhf.parallel.layers import load_full_state, random_full_state

    cfg = tiny_qwen2_config(**STAGED, value_head_bias=True)
    whole = Qwen2ForValue(cfg)
    state = random_full_state(whole, Layout(), seed=5)
    state["score.weight"] = state["score.weight"] * 10  # a head that is not zero
    load_full_state(whole, state)
    rng = np.random.default_rng(1)
    batch = [ms.Tensor(a) for a in (rng.integers(0, 96, (2, 5)).astype(np.int32), np.ones((2, 5), np.int32),
                                    rng.integers(0, 96, (2, 4)).astype(np.int32), np.ones((2, 4), np.int32))]
    expected = ResponseValues(whole)(*batch).asnumpy()
    assert expected.shape == (2, 4) and np.ptp(expected) > 1e-2
    for pp in (2, 4):
        stages = [Qwen2ForValue(cfg, Layout(pp=pp, rank=r)) for r in range(pp)]
        for net in stages:
            load_full_state(net, state)
        assert [net.score is not None for net in stages] == [False] * (pp - 1) + [True]
        hidden = None
        for net in stages[:-1]:
            hidden = ResponseHidden(net)(*batch, hidden)
        got = ResponseValues(stages[-1])(*batch, hidden).asnumpy()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"pp={pp}")


@pytest.mark.usefixtures("graph_mode")
def test_what_stages_cannot_hold_is_one_line():
    from mindrlhf.models.qwen2 import Qwen2ForCausalLM

    cfg = tiny_qwen2_config(**STAGED)
    with pytest.raises(LayoutError, match="num_layers=4 is not divisible by the pipeline stages 3"):
        Qwen2ForCausalLM(cfg, Layout(pp=3, rank=0))


@pytest.mark.usefixtures("graph_mode")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stage_strategy_files_merge_and_transform_like_mindspore(tmp_path, tied):
    """pp=2 x tp=2: each rank's checkpoint holds its stage's shards and each rank writes its stage's strategy file
    (`current_stage`); MindSpore merges the stages' files and transforms the checkpoints back into the whole model
    bit for bit, and so do the merged file the trainer writes and our own merge. A tied embedding is in both
    stages' files; the merged one names it once, at the first stage."""
    import os

    import mindspore as ms

    from mindrlhf.models.qwen2 import Qwen2ForCausalLM
    from mindrlhf.parallel.layers import init_random_weights, random_full_state
    from mindrlhf.parallel.strategy import (
        merge_shards,
        net_layouts,
        read_staged_strategy_file,
        write_strategy_file,
    )

    cfg = tiny_qwen2_config(**STAGED, tie_word_embeddings=tied)
    expected = random_full_state(Qwen2ForCausalLM(cfg), Layout(), seed=5)
    all_layouts, stages, shards = {}, {}, []
    for rank in range(4):
        layout = Layout(dp=1, tp=2, pp=2, rank=rank)
        net = Qwen2ForCausalLM(cfg, layout)
        init_random_weights(net, layout, seed=5)
        os.makedirs(tmp_path / "ckpt" / f"rank_{rank}")
        ms.save_checkpoint(net, str(tmp_path / "ckpt" / f"rank_{rank}" / "net.ckpt"))
        write_strategy_file(tmp_path / "strategy" / f"strategy_{rank}.ckpt", net_layouts(net, layout),
                            stage=layout.stage)
        for name, lay in net_layouts(net, layout).items():
            all_layouts.setdefault(name, lay)
            stages.setdefault(name, layout.stage)
        shards.append({p.name: p.asnumpy() for p in net.get_parameters()})
    ms.parallel.merge_pipeline_strategys(str(tmp_path / "strategy"), str(tmp_path / "merged.ckpt"))
    # the trainer writes the merged file itself, from every stage's layouts: the same content as MindSpore's merge
    ours = write_strategy_file(tmp_path / "ours.ckpt", all_layouts, stages=stages)
    theirs = read_staged_strategy_file(tmp_path / "merged.ckpt")
    assert read_staged_strategy_file(ours) == theirs and set(theirs[1].values()) == {0, 1}
    for strategy in (tmp_path / "merged.ckpt", ours):
        out = tmp_path / f"full_{os.path.basename(strategy)}"
        ms.parallel.transform_checkpoints(str(tmp_path / "ckpt"), str(out), "full_", str(strategy), None)
        (name,) = os.listdir(out / "rank_0")
        merged = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(out / "rank_0" / name)).items()}
        assert set(merged) == set(expected)
        for key, value in expected.items():
            np.testing.assert_array_equal(merged[key], value, err_msg=key)
    layouts, stage_of = theirs
    ours_merged = merge_shards(shards, layouts, "stages", stage_of)  # our offline merge reads it alike
    for key, value in expected.items():
        np.testing.assert_array_equal(ours_merged[key], value, err_msg=key)


# the pipelined runs test_pipeline_train_step_equals_the_whole_model reads, by name: (pp, tp, micro-batches, tied,
# further flags); the runs of one world size go in one launch, after the one-piece runs of their model (untied and
# tied), both in one plain Python process
PIPELINED = {"pp2-mb1": (2, 1, 1, False, ()),
             "pp2-mb4-selective-recompute": (2, 1, 4, False, ("--recompute", "selective")),
             "pp2xtp2-mb2-tied-sequence-parallel-full-recompute": (2, 2, 2, True, ("--seq_parallel", "--recompute",
                                                                                    "full")),
             "pp4-mb4-tied": (4, 1, 4, True, ()),
             "pp2xtp2-mb2-lora": (2, 2, 2, False, ("--lora_rank", "2"))}  # only the adapters train (#68)


def one_piece(tied: bool, extra=()) -> str:
    return "one-piece" + ("-tied" if tied else "") + ("-lora" if "--lora_rank" in extra else "")


def pipeline_runs(root) -> dict[str, Run]:
    runs = {}
    for name, (pp, tp, micro_batches, tied, extra) in PIPELINED.items():
        lora = list(extra[extra.index("--lora_rank"):][:2]) if "--lora_rank" in extra else []
        reference = one_piece(tied, extra)
        runs[reference] = Run(1, ["--reference_only"] + ["--tied"] * tied + lora)
        runs[name] = Run(pp * tp, ["--pp", str(pp), "--tp", str(tp), "--micro_batches", str(micro_batches),
                                   "--reference", str(root / reference / "rank_0.npz"), *extra] + ["--tied"] * tied,
                         (reference,))
    return runs


@pytest.fixture(scope="module")
def pipelined(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    runs = Runs("pipeline_equivalence.py", root, pipeline_runs(root), selected(request, "run"))
    assert all(runs.out(name) == root / name for name in runs.runs)  # the names are the folders --reference reads
    return runs


@pytest.mark.msrun
@waits_for(2)  # the one-piece runs, then the pipelined runs of its world size
@pytest.mark.parametrize("run", list(PIPELINED))
def test_pipeline_train_step_equals_the_whole_model(pipelined, run):
    """2 clipped AdamW updates of the GRPO loss (global token weights, responses of unequal lengths) with the
    4 layers split over `pp` stages: the summed loss outputs, the global gradient norm (summed over the stages)
    and every stage's weights equal the whole model's run in one process. A tied embedding (used by the first
    stage's embedding and the last stage's head) gets both end stages' gradients, so its two copies stay equal;
    the stages between hold no copy and pass activations and gradients both ways. The 1F1B schedule runs every
    kind of its steps: pp2-mb1 only warm-up and cool-down, pp4-mb4 steady-state exchanges on the middle stages.
    Two variants recompute the stages' layers in the backward pass (the attention only, and full layers with tp
    collectives inside, the latter with the stages' residual stream cut along the sequence over tp: sequence
    parallel, the stages exchanging whole activations): neither may change a value. pp2xtp2-mb2-lora trains LoRA
    adapters alone (on every linear layer of each stage, split over tp like their layers)."""
    pp, tp, _, tied, extra = PIPELINED[run]
    world = pp * tp
    (whole,) = load_ranks(pipelined(one_piece(tied, extra)), 1)  # the one-piece run's outputs, norms and weights
    ranks = [{**whole, **result} for result in load_ranks(pipelined(run), world)]
    embedding = "weight/model.tok_embeddings.embedding_weight"
    for rank in range(tp, world):  # the last stage holds the tied copy, bit for bit its first-stage peer's
        last_stage = rank >= world - tp
        assert (embedding in ranks[rank]) == (tied and last_stage)
        if tied and last_stage:
            np.testing.assert_array_equal(ranks[rank][embedding], ranks[rank - (pp - 1) * tp][embedding])
    nonzero = [GRPOLossNet.OUTPUTS.index(name) for name in ("loss", "pg_loss", "kl_loss", "entropy")]
    for rank, result in enumerate(ranks):
        assert np.all(np.abs(result["whole_outputs"][:, nonzero]) > 1e-5)  # loss, pg_loss, kl, entropy
        # the outputs' float32 noise (sums in another order) follows the largest of them, not each one's size
        scale = max(1.0, float(np.abs(result["whole_outputs"]).max()))
        np.testing.assert_allclose(result["pipe_outputs"], result["whole_outputs"], rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=f"rank {rank}")
        # (the LoRA run's norms, of adapter gradients summed over the tp pair, came 1.9e-5 apart on a host without
        # AVX-512; a missing or doubled sum moves a norm by far more)
        np.testing.assert_allclose(result["pipe_norms"], result["whole_norms"], rtol=5e-5, err_msg=f"rank {rank}")
    lr, updates = float(ranks[0]["adam/lr"]), int(ranks[0]["adam/updates"])
    held = set()
    for rank, result in enumerate(ranks):
        stage, stage_tp = divmod(rank, tp)
        layers = {int(k.split(".")[2]) for k in result if k.startswith("weight/model.layers.")}
        assert layers == set(range(stage * 4 // pp, (stage + 1) * 4 // pp)), f"rank {rank}"
        got, want = {}, {}
        for key in (k for k in result if k.startswith("weight/")):
            name = key.split("/", 1)[1]
            held.add(name)
            axis = int(result[f"axis/{name}"])
            full = result[f"whole/{name}"]
            want[name] = np.split(full, tp, axis=axis)[stage_tp] if axis >= 0 and tp > 1 else full
            got[name] = result[key]
        assert_weights_close_after_adam(got, want, lr, updates, what=f"rank {rank}")
    assert held == {k.split("/", 1)[1] for k in ranks[0] if k.startswith("whole/")}  # every weight on some stage

