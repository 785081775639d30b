"""Tensor and data parallel runs of a tiny Qwen2 equal the one-process run (msrun, CPU)."""
import math

import numpy as np
import pytest
from support.cases import Run, Runs, selected, waits_for
from support.msrun import load_ranks, run_worker
from support.tolerances import assert_weights_close_after_adam

from mindrlhf.configs.lora import is_adapter

pytestmark = pytest.mark.msrun
TOL = 1e-5  # logits, losses, gradients and grad norms: no Adam normalisation in between, float noise stays small


# the parallel runs the tests read, by name: (dp, tp, kv heads, the dp sums' route, further flags)
LORA = ("--lora_rank", "2")  # only the adapters train (#68): their gradients' sums over tp are the ones to check
# (the LoRA run over a shared kv head has every kind of adapter split: a column-parallel layer's B split, a row-parallel
# one's A, the shared kv head's B shared by a tp pair; on one tp pair: the dp sums are the same code for any trained
# parameters, which the dp2 runs check)
PARALLEL = {"tp2": (1, 2, 4, "native", ()), "dp2": (2, 1, 4, "native", ()),
            "dp2xtp2-over-1-kv-head-shared-memory-sums-sequence-parallel": (2, 2, 1, "auto", ("--seq_parallel",)),
            "tp2-over-1-kv-head-lora": (1, 2, 1, "native", LORA)}


def reference_of(kv: int, extra) -> str:
    """The one-process run of the model a parallel run trains (its kv heads, with or without adapters)."""
    return "reference" + ("" if kv == 4 else f"-kv{kv}") + ("-lora" if "--lora_rank" in extra else "")


def spmd_run(dp, tp, kv, collectives, extra):
    """A run of tests/workers/spmd_equivalence.py on dp x tp ranks with `kv` kv heads, after the one-process
    reference run of its model."""
    args = ["--dp", str(dp), "--tp", str(tp), "--n_kv_heads", str(kv), "--cpu_collectives", collectives, *extra]
    return Run(dp * tp, args, after=(reference_of(kv, extra),))


# each run launched once, the runs of one process count in one launch, and read by every test of its name
# (test_parallel_run_matches_single_process and test_grpo_and_value_losses_are_normalised_over_the_global_batch
# read the same dp2 and tp2 runs, and the same reference)
RUNS = {"reference": Run(1, []),
        "reference-kv1": Run(1, ["--n_kv_heads", "1"]),  # the same model with 1 kv head (4 query heads)
        "reference-kv1-lora": Run(1, ["--n_kv_heads", "1", *LORA]),
        **{name: spmd_run(*params) for name, params in PARALLEL.items()}}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    return Runs("spmd_equivalence.py", tmp_path_factory.mktemp("spmd"), RUNS, selected(request, "run"))


def results(runs, run):
    """(each rank's results of the parallel run `run`, its one-process reference's, dp, tp)."""
    dp, tp = PARALLEL[run][:2]
    (reference,) = load_ranks(runs(RUNS[run].after[0]), 1)
    return load_ranks(runs(run), dp * tp), reference, dp, tp


def distinct_shards(ranks, tp, d, key):
    """dp replica `d`'s shards of `key` along its split axis, one per distinct shard (a shard that tp peers share,
    as kv heads when tp exceeds them, is taken once and must be equal on every peer)."""
    name = key.split("/", 1)[1]
    parts = int(ranks[0][f"shards/{name}"]) if int(ranks[0][f"axis/{name}"]) >= 0 else 1
    share = tp // parts
    shards = [ranks[d * tp + t][key] for t in range(tp)]
    for t in range(tp):
        np.testing.assert_allclose(shards[t], shards[t // share * share], atol=TOL,
                                   err_msg=f"{key}: tp rank {t} differs from the peers sharing its shard")
    return shards[::share]


def assert_close_to_reference(got, expected, key):
    """`got` equals the one-process `expected` within float32 noise, which grows with the tensor's magnitude (sums in
    another order: TOL absolute up to magnitude 1, relative to the largest value above it)."""
    np.testing.assert_allclose(got, expected, atol=TOL * max(1.0, float(np.abs(expected).max())), err_msg=key)


def assemble(ranks, dp, tp, key):
    """Full tensor of `key` from per-rank shards (tp-split along the recorded axis, dp replicas equal)."""
    name = key.split("/", 1)[1]
    axis = int(ranks[0][f"axis/{name}"])
    replicas = []
    for d in range(dp):
        shards = distinct_shards(ranks, tp, d, key)
        replicas.append(np.concatenate(shards, axis=axis) if axis >= 0 else shards[0])
    for r in replicas[1:]:
        np.testing.assert_allclose(r, replicas[0], atol=TOL, err_msg=f"{key}: dp replicas differ")
    return replicas[0]


def replica_weights(ranks, tp, d, t, prefix="weight/"):
    """dp replica `d`'s full weights (keys `prefix<name>`): tp-split ones from their shards, unsplit (tp-replicated)
    ones as tp rank `t` holds them."""
    weights = {}
    for key in (k for k in ranks[0] if k.startswith(prefix)):
        axis = int(ranks[0][f"axis/{key.split('/', 1)[1]}"])
        weights[key] = (np.concatenate(distinct_shards(ranks, tp, d, key), axis=axis) if axis >= 0
                        else ranks[d * tp + t][key])
    return weights


@waits_for(2)  # the references, then the runs of its process count
@pytest.mark.parametrize("run", list(PARALLEL))
def test_parallel_run_matches_single_process(runs, run):
    """dp2xtp2-over-1-kv-head-...: the one kv head (wk/wv rows) is held by both ranks of a tp pair (tp wider than
    the kv heads), whose gradients of it are summed, and the global norm counts it once; the dp gradient sums (of
    the whole step, in the graph, and of the micro-batches' buffers, in place between graphs) go through shared
    memory, as the trainer's on one CPU host; and the tp pairs run sequence parallel (norm weights' gradients summed
    over tp). *-lora: LoRA adapters on every linear layer, the only trained parameters (A whole and B split in a
    column-parallel layer, A split and B whole in a row-parallel one, B of the shared kv head shared)."""
    ranks, reference, dp, tp = results(runs, run)
    logits = np.concatenate([ranks[d * tp]["logits"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(logits, reference["logits"], atol=TOL)
    losses = np.mean([ranks[d * tp]["losses"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(losses, reference["losses"], atol=TOL)
    # the global gradient norm (tp shards summed, replicas once, after the dp reduction) is the one-process norm
    for rank in ranks:
        np.testing.assert_allclose(rank["first_grad_norm"], reference["first_grad_norm"], rtol=TOL)
        np.testing.assert_allclose(rank["grad_norms"], reference["grad_norms"], rtol=TOL)
    full_norm = np.sqrt(sum(np.square(reference[k].astype(np.float64)).sum() for k in reference
                            if k.startswith("grad/")))
    np.testing.assert_allclose(reference["first_grad_norm"], full_norm, rtol=1e-5)
    grad_keys = [k for k in reference if k.startswith("grad/")]
    assert len(grad_keys) > 20
    assert all(is_adapter(k.split("/", 1)[1]) for k in grad_keys) == run.endswith("-lora")
    for key in grad_keys:
        assert_close_to_reference(assemble(ranks, dp, tp, key), reference[key], key)
    # weights after the AdamW updates: Adam turns float noise in near-zero gradients into weight differences of a
    # fraction of lr, so every rank's copy is compared with the one-process weights in lr units
    # (tests/support/tolerances.py)
    weights = {k: v for k, v in reference.items() if k.startswith("weight/")}
    lr, updates = float(reference["adam/lr"]), int(reference["adam/updates"])
    for d in range(dp):
        for t in range(tp):
            got = replica_weights(ranks, tp, d, t)
            assert_weights_close_after_adam(got, weights, lr, updates, what=f"dp replica {d}, tp rank {t}")
    # the same updates over 1-row micro-batches (buffers reduced over dp in place, the clip applied inside AdamW)
    # are the one-process whole-batch updates
    for rank in ranks:
        np.testing.assert_allclose(rank["micro_grad_norms"], reference["grad_norms"], rtol=TOL)
    micro_losses = np.mean([ranks[d * tp]["micro_losses"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(micro_losses, reference["losses"], atol=TOL)
    for d in range(dp):
        for t in range(tp):
            micro = replica_weights(ranks, tp, d, t, "micro_weight/")
            got = {"weight/" + k.split("/", 1)[1]: v for k, v in micro.items()}
            assert_weights_close_after_adam(got, weights, lr, updates,
                                            what=f"micro-batched, dp replica {d}, tp rank {t}")


@waits_for(2)
@pytest.mark.parametrize("run", ["dp2", "tp2", "dp2xtp2-over-1-kv-head-shared-memory-sums-sequence-parallel"])
def test_grpo_and_value_losses_are_normalised_over_the_global_batch(runs, run):
    """dp=2 with 18 response tokens on rank 0 and 4 on rank 1: the ranks' shares of loss, KL, clip fraction
    and entropy add up to the one-process values, and the summed gradients equal the one-process ones, for
    `token-mean` and `seq-mean-token-mean` (a per-rank mean would weigh rank 1's tokens 4.5x more). With
    tp=2 the vocabulary-parallel entropy and log-probs equal the one-process ones. The PPO critic on the same
    responses (critic dp=2 or tp=2): its values, value-loss shares and gradients equal the one-process ones.
    With dp=2 x tp=2 and sequence parallel the [prompt | response] rows of 15 positions are cut into two parts of 8
    (one padded) over each tp pair between the blocks: the same values, losses and gradients."""
    ranks, reference, dp, tp = results(runs, run)
    for name in ("token-mean", "seq-mean-token-mean"):
        expected = reference[f"grpo_outputs/{name}"]
        assert np.all(np.abs(expected[[1, 2, 3, 6]]) > 1e-4), expected  # pg_loss, kl_loss, pg_clipfrac, entropy
        total = sum(ranks[d * tp][f"grpo_outputs/{name}"] for d in range(dp))
        np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-6, err_msg=name)
        grad_keys = [k for k in reference if k.startswith(f"grpo_grad_{name}/")]
        assert len(grad_keys) > 20
        for key in grad_keys:
            assert_close_to_reference(assemble(ranks, dp, tp, key), reference[key], key)
    values = np.concatenate([ranks[d * tp]["critic_values"] for d in range(dp)], axis=0)
    np.testing.assert_allclose(values, reference["critic_values"], atol=TOL)
    assert np.all(reference["critic_outputs"] > 1e-3), reference["critic_outputs"]  # a loss, and some clipping
    total = sum(ranks[d * tp]["critic_outputs"] for d in range(dp))
    np.testing.assert_allclose(total, reference["critic_outputs"], rtol=1e-5, atol=1e-6)
    grad_keys = [k for k in reference if k.startswith("critic_grad/")]
    assert len(grad_keys) > 20 and "critic_grad/critic.score.weight" in grad_keys
    for key in grad_keys:
        assert_close_to_reference(assemble(ranks, dp, tp, key), reference[key], key)


def test_graphs_over_every_parameter_compile_within_a_real_models_call_depth_budget(tmp_path):
    """At dp=2: micro-batched updates (gradients accumulated, summed over dp in place, clipped inside AdamW) equal
    the whole-batch fused step, and the reshard into tp=2 gives the train weights bit for bit, all compiled under a
    call depth limit of 1000 / 315 per parameter (the default limit at 315 parameters, more than SmolLM2-135M's 272
    or Qwen2.5-0.5B's 290). Graph mode unrolls the loops over parameters into nested calls; a loop that nests one
    call more per parameter failed only at a real model's size (tests/workers/many_params_worker.py)."""
    run_worker("many_params_worker.py", ["--out", str(tmp_path)], 2, tmp_path / "log")
    ranks = load_ranks(tmp_path, 2)
    assert int(ranks[0]["num_params"]) == 75 and int(ranks[0]["max_call_depth"]) == math.ceil(75 * 1000 / 315)
    whole = {k.split("/", 1)[1]: v for k, v in ranks[0].items() if k.startswith("whole/")}
    assert len(whole) == int(ranks[0]["num_params"])
    for rank in ranks:
        assert np.all(rank["whole_norms"] > 0.05), rank["whole_norms"]  # above the clip: every update clipped
        np.testing.assert_allclose(rank["micro_norms"], rank["whole_norms"], rtol=TOL)
        micro = {k.split("/", 1)[1]: v for k, v in rank.items() if k.startswith("micro/")}
        assert_weights_close_after_adam(micro, whole, lr=1e-3, updates=2, what="micro-batched vs whole")
    for name, weight in whole.items():
        np.testing.assert_array_equal(ranks[1][f"whole/{name}"], weight, err_msg=f"dp replicas differ: {name}")
        axis = int(ranks[0][f"axis/{name}"])
        shards = [rank[f"infer/{name}"] for rank in ranks]
        for resharded in [np.concatenate(shards, axis=axis)] if axis >= 0 else shards:
            np.testing.assert_array_equal(resharded, ranks[0][f"micro/{name}"], err_msg=f"resharded {name}")
