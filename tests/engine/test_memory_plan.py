"""The memory plan's arithmetic (mindrlhf.engine.memory_plan) and `grpo_one_stage.py --plan` on the tiny job."""
import os
import re
import subprocess
import sys

import pytest
from support import paths
from support.configs import SMOLLM2_SHAPE

from mindrlhf.engine import memory_budget
from mindrlhf.engine.memory_plan import (
    GIB,
    TERMS,
    Call,
    NetShape,
    PhaseMemory,
    RankMemory,
    Recompute,
    dtype_bytes,
    forward_activation_bytes,
    forward_graph_bytes,
    moment_bytes,
    train_activation_bytes,
    train_graph_bytes,
    verdict,
)
from mindrlhf.models.qwen2 import Qwen2Config
from mindrlhf.parallel.layout import kv_head_shards

# the plan vs a run's peak RSS on this CPU (docs/memory_plan.md: the tiny job 0.82 planned vs 0.81 GiB measured;
# the target of benchmarks/memory_plan.py)
PLAN_TOLERANCE = 0.15
TINY = NetShape(vocab=704, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128)
# Qwen2.5-7B: 28 layers, 28 heads, 4 kv heads, untied, bf16
QWEN7B = NetShape(vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944,
                  param_bytes=2, compute_bytes=2)


def test_weights_per_rank_split_over_tp_and_pipeline_stages():
    # tiny by hand: a layer has q 64x64 + k,v 64x32 each + o 64x64 + biases 64+32+32 + MLP 3x64x128 + norms 2x64
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + (64 + 64) + 3 * 64 * 128 + 128
    assert TINY.layer_elements(1) == layer
    whole = TINY.stage_elements()
    assert whole == 2 * layer + 2 * 704 * 64 + 64  # embedding + untied head + final norm
    # tp=2: q/o/MLP/k/v and their biases halve, the norms stay
    assert TINY.layer_elements(2) == (layer - 128) // 2 + 128
    # pp=2, tp=2: the first stage has the embedding shard, the last the head shard and the final norm
    first, last = TINY.stage_elements(2, 2, 0), TINY.stage_elements(2, 2, 1)
    assert first == TINY.layer_elements(2) + 704 * 64 // 2
    assert last == TINY.layer_elements(2) + 704 * 64 // 2 + 64
    # Qwen2.5-7B: the stages and tp shards add up to the whole net (7.6e9), norms counted once per tp rank
    total = QWEN7B.stage_elements()
    assert 7.6e9 < total < 7.7e9
    norms = 28 * 2 * 3584 + 3584
    assert sum(QWEN7B.stage_elements(4, 2, s) for s in range(2)) * 4 - 3 * norms == total


def test_tied_embedding_is_held_by_both_end_stages():
    tied = NetShape(**{**TINY.__dict__, "tied": True})
    assert tied.stage_elements() == TINY.stage_elements() - 704 * 64
    assert tied.stage_elements(1, 2, 1) == tied.layer_elements() + 704 * 64 + 64  # the last stage's copy


def test_moments_are_two_float32_copies_halved_by_zero1_at_dp2():
    assert moment_bytes(1000) == 8000
    assert moment_bytes(1000, dp=2) == 8000  # without optimizer_shard every dp rank holds them all
    assert moment_bytes(1000, dp=2, optimizer_shard=True) == 4000
    # 7B on tp4 x pp2: ~0.95e9 weights per rank -> 7.6 GB of moments
    assert 7.0 * GIB < moment_bytes(QWEN7B.stage_elements(4, 2, 0)) < 7.2 * GIB


def test_kv_cache_bytes_and_replicated_kv_heads():
    # 2 (k, v) x 2 layers x 8 rows x 2 kv heads x 100 slots x 16 dims x 4 bytes
    assert TINY.kv_cache_bytes(rows=8, length=100) == 2 * 2 * 8 * 2 * 100 * 16 * 4
    assert TINY.kv_cache_bytes(8, 100, tp=2) == TINY.kv_cache_bytes(8, 100) // 2
    # tp 4 over 2 kv heads: each rank keeps one whole head (replicated), not half of one
    assert TINY.kv_cache_bytes(8, 100, tp=4) == TINY.kv_cache_bytes(8, 100) // 2
    assert kv_head_shards(4, 8) == 4 and kv_head_shards(4, 2) == 2
    with pytest.raises(ValueError, match="n_kv_heads=3 and the tensor-parallel size 2: one must divide the other"):
        kv_head_shards(3, 2)
    # 7B, 64 rows of 4096 + 1024 slots in bf16 on tp4: 28 layers x 1 kv head x 128 dims
    assert QWEN7B.kv_cache_bytes(64, 5120, 4) == 2 * 28 * 64 * 1 * 5120 * 128 * 2


def test_recomputed_layers_keep_less_activation_memory():
    shape = dict(hidden=576, intermediate=1536, heads=9, vocab=0)
    args = (4, 4, 64, 192)
    off = memory_budget.train_bytes(*args, layers=30, **shape)
    full = memory_budget.train_bytes(*args, layers=30, recomputed_layers=30, **shape)
    half = memory_budget.train_bytes(*args, layers=30, recomputed_layers=15, **shape)
    selective = memory_budget.train_bytes(*args, layers=30, selective_layers=30, **shape)
    assert full < half < selective < off
    # measured at this shape (SmolLM2-135M, rows of 64 + 192 tokens): all layers recomputed saved 1.21 GiB of the
    # step's peak with 4 rows and 0.30 GiB with 2, the recomputing graph costing ~20 MiB a layer (0.59 GiB) once
    graph = 30 * 20 * 2**20 / GIB
    assert 1.1 < (off - full) / GIB - graph < 1.3
    two = [memory_budget.train_bytes(2, 2, 64, 192, layers=30, recomputed_layers=n, **shape) for n in (0, 30)]
    assert 0.2 < (two[0] - two[1]) / GIB - graph < 0.4
    assert 0.45 < (off - half) / GIB - graph / 2 < 0.8  # measured 0.72
    assert 0.08 < (off - selective) / GIB < 0.2  # measured 0.13
    with pytest.raises(ValueError, match="recomputed_layers=20 \\+ selective_layers=20"):
        memory_budget.train_bytes(*args, layers=30, recomputed_layers=20, selective_layers=20, **shape)


def test_activations_follow_the_compute_dtype_and_the_stage():
    call = Call(prompts=2, rows=16, prompt_width=4096, response_width=1024)
    acts, logits = train_activation_bytes(QWEN7B, call, tp=4, pp=2, stage=1)
    acts32, logits32 = train_activation_bytes(NetShape(**{**QWEN7B.__dict__, "compute_bytes": 4}), call, 4, 2, 1)
    assert acts * 2 == acts32 and logits == logits32  # bf16 halves the layers' part; the logits stay float32
    first, no_logits = train_activation_bytes(QWEN7B, call, 4, 2, 0)
    assert no_logits == 0 and first == acts  # the head is on the last stage only
    kept, _ = train_activation_bytes(QWEN7B, call, 4, 2, 0, in_flight=2)
    assert kept - first == 2 * call.tokens * 3584 * 2
    full, _ = train_activation_bytes(QWEN7B, call, 4, 2, 0, recompute=Recompute(full=14))
    assert abs(full - first * (1 - memory_budget.FULL_RECOMPUTE_FREES)) < 8  # every layer of the stage recomputes
    fwd, fwd_logits = forward_activation_bytes(QWEN7B, call, tp=4)
    assert fwd < acts and fwd_logits == 4 * 16 * 1024 * 3 * 152064 // 4


# `benchmarks/memory_plan.py --parts graphs` (SmolLM2-135M's shape, vocabulary 1024, 2 vs 4 layers, each call after a
# wider one): MiB a compiled graph kept per decoder layer, by (prompts, rows, prompt width, response width)
MEASURED_GRAPH_MIB = {
    "forward": {(1, 4, 72, 256): 19.9, (1, 8, 72, 96): 18.8, (1, 1, 72, 512): 9.3, (1, 1, 72, 256): 7.9,
                (1, 1, 72, 128): 5.8, (4, 32, 72, 96): 45.3, (4, 32, 72, 32): 24.4, (2, 16, 72, 96): 25.6,
                (1, 8, 72, 64): 12.5},
    "train": {(1, 1, 72, 344): 63.5, (1, 1, 72, 176): 34.9, (1, 2, 72, 96): 30.2, (1, 8, 72, 32): 37.9,
              (1, 4, 72, 64): 37.0},
}
# the probe's model (`tests/workers/graph_memory.py`) cut to one layer
SMOLLM2_LAYER = NetShape.of(Qwen2Config(**{**SMOLLM2_SHAPE, "vocab_size": 1024, "num_layers": 1}))


def test_a_compiled_graph_keeps_memory_that_follows_its_call_as_measured():
    planned = {"forward": forward_graph_bytes, "train": train_graph_bytes}
    for kind, calls in MEASURED_GRAPH_MIB.items():
        for call, mib in calls.items():
            assert planned[kind](SMOLLM2_LAYER, Call(*call)) / 2**20 == pytest.approx(mib, abs=3.5), (kind, call)
    # thirty layers keep thirty times one layer's
    thirty = NetShape(**{**SMOLLM2_LAYER.__dict__, "layers": 30})
    call = Call(2, 16, 72, 96)
    assert forward_graph_bytes(thirty, call) == pytest.approx(30 * forward_graph_bytes(SMOLLM2_LAYER, call), abs=30)
    # a decode step (one position a row) keeps about a graph's fixed part; the per-position part splits over tp
    decode = forward_graph_bytes(SMOLLM2_LAYER, Call(32, 0, 1, 0))
    assert 5 * 2**20 < decode < 6 * 2**20
    fixed = 5 * 2**20
    assert forward_graph_bytes(QWEN7B, call, tp=4) - 28 * fixed == pytest.approx(
        (forward_graph_bytes(QWEN7B, call) - 28 * fixed) / 4, rel=1e-6)
    # recompute does not shrink what the train graph keeps on CPU (its backward's buffers), it adds a larger graph
    recomputed = train_graph_bytes(thirty, call, recompute=Recompute(full=30))
    assert recomputed - train_graph_bytes(thirty, call) == 30 * 20 * 2**20
    # Ascend's graphs are in its runtime overhead
    assert forward_graph_bytes(QWEN7B, call, device="ascend") == train_graph_bytes(QWEN7B, call, device="ascend") == 0


def _phase(name, **terms):
    return PhaseMemory(name, {t: int(terms.get(t, 0) * GIB) for t in TERMS})


def test_fits_and_does_not_fit_name_the_rank_phase_and_largest_term():
    plans = [RankMemory((0, 1), [_phase("generate", weights=10, kv_cache=20), _phase("train", weights=10,
                                                                                     moments=30, activations=5)]),
             RankMemory((2, 3), [_phase("train", weights=12, moments=40)])]
    assert plans[0].peak_phase().phase == "train"
    assert verdict(plans, 64).startswith("fits: the largest rank needs 52.00 GiB (rank 2, phase train)")
    line = verdict(plans, 48)
    assert line.startswith("does not fit: rank 2 needs 52.00 GiB in phase train (> 48 GiB per device; largest: "
                           "moments 40.00 GiB); try parallel_config.optimizer_shard: true")
    with pytest.raises(ValueError, match="--device_memory_gib must be > 0"):
        verdict(plans, 0)
    with pytest.raises(ValueError, match="model_config.compute_dtype='int8'"):
        dtype_bytes("int8", "model_config.compute_dtype")


def _plan_cmd(tmp_path, *extra):
    data = tmp_path / "prompts.mindrecord"  # --plan reads no prompt: the file must only exist
    data.write_bytes(b"")
    tiny = str(paths.TINY)
    return [sys.executable, str(paths.GRPO_SCRIPT), "--plan",
            "--sft_path_train", os.path.join(tiny, "train.yaml"), "--sft_path_infer", os.path.join(tiny, "infer.yaml"),
            "--tokenizer_dir", os.path.join(tiny, "tokenizer"), "--mind_dataset_dir", str(data),
            "--config", os.path.join(tiny, "grpo.yaml"), *extra]


def test_plan_flag_prints_the_table_without_msrun(tmp_path):
    proc = subprocess.run(_plan_cmd(tmp_path, "--device_memory_gib", "8"), capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MS_WORKER_NUM": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "memory plan: 2 rank(s), train dp1 x tp2 x pp1, infer dp2 x tp1, device cpu; MiB per rank " \
        "(device = the phase's peak; host = swapped out)"
    assert lines[1] == "ranks 0,1:"  # tp ranks hold the same bytes
    assert lines[2].split() == ["phase", *TERMS, "device", "host"]
    peak = next(i for i, line in enumerate(lines) if line.startswith("  peak:"))
    phases = [line.split()[0] for line in lines[3:peak]]
    assert phases == ["generate", "ref", "old", "train", "reshard"]  # num_iterations 2: the old log-probs too
    train = next(line.split() for line in lines if line.strip().startswith("train"))
    gradients, moments = float(train[2]), float(train[3])
    assert gradients > 0 and moments > 0
    assert lines[-1].startswith("fits: the largest rank needs ")
    # no KL term (beta 0) and one pass over the rollout: no reference net, no ref or old phase, fewer graphs
    proc = subprocess.run(_plan_cmd(tmp_path, "--device_memory_gib", "8", "--beta", "0", "--num_iterations", "1"),
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MS_WORKER_NUM": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lean = proc.stdout.splitlines()
    lean_peak = next(i for i, line in enumerate(lean) if line.startswith("  peak:"))
    assert [line.split()[0] for line in lean[3:lean_peak]] == ["generate", "train", "reshard"]
    lean_train = next(line.split() for line in lean if line.strip().startswith("train"))
    # the reference's weights: the whole model on an infer rank (tp1), twice a train rank's tp2 share (= gradients)
    assert float(lean_train[1]) == pytest.approx(float(train[1]) - 2 * gradients, abs=2e-3)
    assert float(lean_train[7]) < float(train[7])  # runtime: the graphs of the two forward passes are not compiled
    # 2 decode slots (generation.max_num_seqs) instead of the rank's 8 rows, stepping down to 1 for the tail
    # (generation.min_decode_rows): KV caches of 2 + 1 rows, 3/8 of 8 rows'; 3 response widths: the narrower ones'
    # graphs are said apart
    proc = subprocess.run(_plan_cmd(tmp_path, "--device_memory_gib", "8", "--max_num_seqs", "2", "--min_decode_rows",
                                    "1", "--response_buckets", "3"), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MS_WORKER_NUM": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.fullmatch(r"of rank 0's runtime, \d+\.\d\d GiB are the graphs of the response widths narrower than "
                        r"max_new_tokens, .* \(schedule.response_buckets: 1 compiles the widest only\)",
                        proc.stdout.splitlines()[-2])
    kv = 1 + TERMS.index("kv_cache")
    slots_train = next(line.split() for line in proc.stdout.splitlines() if line.strip().startswith("train"))
    assert float(slots_train[kv]) == pytest.approx(float(train[kv]) * 3 / 8, abs=2e-3) and float(train[kv]) > 0
    proc = subprocess.run(_plan_cmd(tmp_path, "--device_memory_gib", "0.01"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[-1].startswith("does not fit: rank 0 needs ")
    proc = subprocess.run(_plan_cmd(tmp_path, "--device_memory_gib", "-1"), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "error: --device_memory_gib must be >= 0" in proc.stderr


def test_plan_of_mindrlhfs_qwen2_5_7b_grpo_yamls_covers_8_ranks(tmp_path):
    """MindRLHF's tutorial pair (model_configs/qwen_grpo) with the default GRPO config: train tp4 x pp2 and infer dp2 x
    tp4 on 8 ranks, the Ascend memory model (bfloat16), and not a word about the YAMLs' keys."""
    data = tmp_path / "prompts.mindrecord"
    data.write_bytes(b"")
    configs = str(paths.MODEL_CONFIGS)
    cmd = [sys.executable, str(paths.GRPO_SCRIPT), "--plan",
           "--sft_path_train", os.path.join(configs, "qwen_grpo", "finetune_qwen2_5_7b.yaml"),
           "--sft_path_infer", os.path.join(configs, "qwen_grpo", "predict_qwen2_5_7b_instruct.yaml"),
           "--tokenizer_dir", os.path.join(configs, "tiny", "tokenizer"), "--mind_dataset_dir", str(data),
           "--device_memory_gib", "59.6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "MS_WORKER_NUM": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "has no effect here" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("memory plan: 8 rank(s), train dp1 x tp4 x pp2, infer dp2 x tp4, device ascend; ")
    assert [line for line in lines if line.startswith("ranks")] == ["ranks 0,1,2,3:", "ranks 4,5,6,7:"]  # 2 stages
    assert lines[-1].startswith("fits: the largest rank needs ") and lines[-1].endswith(" of 59.6 GiB per device")


@pytest.mark.msrun
def test_plan_is_within_its_tolerance_of_a_real_runs_peak_rss(straight_run, mindrecord):
    """The tiny GRPO job on 2 ranks (msrun: tests/conftest.py's `straight_run`): the largest rank's peak RSS in
    its first step (what a 1-step job of these flags measures) vs the per-rank peak of the plan of the same
    flags."""
    import json

    from support.jobs import straight_args
    from support.msrun import run_command

    run_dir, _ = straight_run
    metrics = [json.loads(line) for line in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    measured = metrics[0]["perf/max_rss_gib"]  # step 1: the plan's phases, before any checkpoint is written
    plan = run_command([sys.executable, str(paths.GRPO_SCRIPT), "--plan", *straight_args(mindrecord, run_dir / "out")],
                       timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    planned = max(float(line.split()[1]) for line in plan.stdout.splitlines() if line.startswith("  peak: "))
    print(f"tiny job: plan {planned:.3f} GiB, measured {measured:.3f} GiB per rank in step 1 (after 4 steps and "
          f"2 checkpoints: {metrics[-1]['perf/max_rss_gib']:.3f})")
    assert abs(planned / measured - 1) < PLAN_TOLERANCE, (planned, measured, plan.stdout)


def _planned_graph_bytes(tmp_path, **overrides) -> tuple[int, int]:
    """`memory_report.graph_bytes` of the tiny job (rank 0, CPU) with `{section: {field: value}}`, checked against
    the graphs' part of the plan's runtime term."""
    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.configs.job import JobOptions
    from mindrlhf.engine.memory_plan import RUNTIME_OVERHEAD_GIB
    from mindrlhf.models.tokenizer import load_tokenizer
    from mindrlhf.trainer.memory_report import graph_bytes, rank_memory
    from mindrlhf.trainer.plan import JobPlan

    data = tmp_path / "prompts.mindrecord"
    data.write_bytes(b"")
    config = GRPOConfig.from_yaml(str(paths.TINY / "grpo.yaml")).replace(overrides)
    job = JobOptions(sft_path_train=str(paths.TINY / "train.yaml"), sft_path_infer=str(paths.TINY / "infer.yaml"),
                     mind_dataset_dir=str(data))
    plan = JobPlan.build(config, job, load_tokenizer(paths.TINY / "tokenizer"), 2, 0)
    total, narrower = graph_bytes(plan, "cpu")
    cpu, ascend = rank_memory(plan, 0, "cpu"), rank_memory(plan, 0, "ascend")
    assert cpu[0].terms["runtime"] == int(RUNTIME_OVERHEAD_GIB["cpu"] * GIB) + total
    # CPU: the memory pool keeps its high water, so every phase holds the largest phase's activations and logits
    # (Ascend's figures: each phase its own)
    pooled = [[p.terms["activations"] + p.terms["logits"] for p in phases] for phases in (cpu, ascend)]
    assert pooled[0] == [max(pooled[1])] * len(cpu) and min(pooled[1]) < max(pooled[1])
    # the KV caches: on device in every phase on CPU; on Ascend in generate only, on host in the other phases
    kv = cpu[0].terms["kv_cache"]
    assert kv > 0 and all(p.terms["kv_cache"] == kv for p in cpu)
    assert {p.phase: p.terms["kv_cache"] for p in ascend if p.terms["kv_cache"]} == {"generate": kv}
    train = next(p for p in ascend if p.phase == "train")
    generate = next(p for p in ascend if p.phase == "generate")
    assert train.host - generate.host == kv + sum(generate.terms[t] for t in ("weights", "moments")) - sum(
        train.terms[t] for t in ("weights", "moments"))
    return total, narrower


def test_the_plan_counts_the_graphs_of_every_width_and_bucket_a_run_reaches(tmp_path):
    one, none_narrower = _planned_graph_bytes(tmp_path)  # the tiny job: one response width, one prompt bucket
    assert none_narrower == 0
    widths, narrower = _planned_graph_bytes(tmp_path, schedule={"response_buckets": 3})
    # two narrower widths (32 and 64 of 96) add their train and log-prob graphs, each keeping less than the widest's
    assert widths - one == narrower and 0 < narrower < 2 * one
    buckets, _ = _planned_graph_bytes(tmp_path, generation={"prompt_buckets": [128, 256]})
    assert one < buckets < 2 * one  # a prefill, train and log-prob graph for the 128-token prompts too
    # no reference (beta 0) and one pass over the rollout (no old log-probs): two log-prob graphs fewer
    lean, _ = _planned_graph_bytes(tmp_path, loss={"beta": 0.0}, schedule={"num_iterations": 1})
    assert 0 < lean < one
    # a prefill budget of one 256-token prompt (generation.max_num_batched_tokens): a rank's 2 prompts in 2 calls,
    # a prefill graph of 1 prompt, not 2
    budget, _ = _planned_graph_bytes(tmp_path, generation={"max_num_batched_tokens": 256})
    both, _ = _planned_graph_bytes(tmp_path, generation={"max_num_batched_tokens": 512})
    assert budget < one == both


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_lora_adapters_are_counted_as_the_net_holds_them_and_alone_are_trained(tp):
    """A tp rank's LoRA net (rank 3 on q, k, o and down: both kinds of layer, k's kv head shared at tp 4) holds
    what `stage_elements` counts and trains what `trained_elements` counts."""
    from mindrlhf.configs.lora import LoraConfig
    from mindrlhf.models.qwen2 import Qwen2ForCausalLM
    from mindrlhf.parallel.layout import Layout

    cfg = Qwen2Config(vocab_size=704, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=128,
                      seq_length=32, max_position_embedding=32,
                      lora=LoraConfig(lora_rank=3, lora_target_modules=["q_proj", "k_proj", "o_proj", "down_proj"]))
    net = Qwen2ForCausalLM(cfg, Layout(dp=1, tp=tp, rank=tp - 1))
    shape = NetShape.of(cfg)
    assert shape.stage_elements(tp) == sum(p.size for p in net.get_parameters())
    assert shape.trained_elements(tp) == sum(p.size for p in net.trainable_params())
    assert shape.trained_elements(tp) < shape.stage_elements(tp) // 10
    plain = NetShape(**{**shape.__dict__, "lora_rank": 0, "lora_modules": ()})
    assert plain.trained_elements(tp) == plain.stage_elements(tp) == shape.stage_elements(tp) - \
        shape.trained_elements(tp)
    # the rollout's merged copy: the weights of the adapted layers, as the net holds them
    adapted = [name[:-len("lora_a")] + "weight" for name, _ in net.parameters_and_names() if name.endswith("lora_a")]
    held = {p.name: p.size for p in net.get_parameters()}
    assert len(adapted) == 4 * 2 and shape.adapted_weight_elements(tp) == sum(held[n] for n in adapted)


@pytest.mark.parametrize("tp,pp,rank,tied,lora", [(1, 1, 0, False, False), (1, 1, 0, True, False),
                                                  (2, 1, 1, False, True), (1, 2, 0, True, False),
                                                  (1, 2, 1, True, True), (2, 2, 3, False, True)])
def test_a_value_models_weights_and_trained_parameters_are_counted_as_the_net_holds_them(tp, pp, rank, tied, lora):
    """A critic's or reward model's stage (`Qwen2ForValue`: no LM head, a scalar head on the last stage; with LoRA
    its adapters and the head train) holds what `value_model_elements` counts and trains what it counts as trained."""
    from mindrlhf.configs.lora import LoraConfig
    from mindrlhf.models.qwen2 import Qwen2ForValue
    from mindrlhf.parallel.layout import Layout

    adapters = LoraConfig(lora_rank=3, lora_target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]) if lora \
        else LoraConfig()
    cfg = Qwen2Config(vocab_size=704, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2, intermediate_size=128,
                      seq_length=32, max_position_embedding=32, tie_word_embeddings=tied, lora=adapters)
    layout = Layout(dp=1, tp=tp, rank=rank, pp=pp)
    net = Qwen2ForValue(cfg, layout)
    shape, place = NetShape.of(cfg), (tp, pp, layout.stage)
    assert shape.value_model_elements(*place) == sum(p.size for p in net.get_parameters())
    assert shape.value_model_elements(*place, trained=True) == sum(p.size for p in net.trainable_params())
    if lora:
        assert shape.value_model_elements(*place, trained=True) < shape.value_model_elements(*place) // 10


def test_a_lora_jobs_critic_holds_adapter_moments_and_gradients_unless_it_trains_whole(tmp_path):
    """PPO with LoRA: in `update_critic` the critic's moments and gradients are its adapters' and head's
    (`critic.use_lora`, the default), or its whole backbone's with `critic.use_lora: false`; its weights differ by
    the adapters alone."""
    from mindrlhf.configs.grpo_configs import GRPOConfig
    from mindrlhf.configs.job import JobOptions
    from mindrlhf.models.tokenizer import load_tokenizer
    from mindrlhf.trainer.memory_report import rank_memory
    from mindrlhf.trainer.plan import JobPlan

    data = tmp_path / "prompts.mindrecord"
    data.write_bytes(b"")
    job = JobOptions(sft_path_train=str(paths.TINY / "train.yaml"), sft_path_infer=str(paths.TINY / "infer.yaml"),
                     sft_path_critic=str(paths.TINY / "train.yaml"), mind_dataset_dir=str(data))
    lora = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ["all-linear"]}
    phases = {}
    for critic_lora in (True, False):
        config = GRPOConfig.from_yaml(str(paths.TINY / "grpo.yaml")).replace(
            {"algorithm": {"adv_estimator": "gae"}, "lora": lora, "critic": {"use_lora": critic_lora}})
        plan = JobPlan.build(config, job, load_tokenizer(paths.TINY / "tokenizer"), 2, 0)
        assert plan.critic.net.model.lora.enabled == critic_lora
        phases[critic_lora] = next(p for p in rank_memory(plan, 0, "ascend") if p.phase == "update_critic").terms
    shape = NetShape.of(plan.critic.net.model)  # the whole critic's, tp2
    adapted = NetShape(**{**shape.__dict__, "lora_rank": 4, "lora_modules": plan.actor.train.model.lora.modules()})
    adapter_moments, whole_moments = (moment_bytes(adapted.value_model_elements(2, trained=True)),
                                      moment_bytes(shape.value_model_elements(2, trained=True)))
    assert whole_moments > 10 * adapter_moments
    # the actor's moments (its adapters) are not resident in update_critic on Ascend: the critic's alone
    assert phases[True]["moments"] == adapter_moments and phases[False]["moments"] == whole_moments
    assert phases[False]["gradients"] - phases[True]["gradients"] == (whole_moments - adapter_moments) // 2
    assert phases[True]["weights"] - phases[False]["weights"] == adapted.value_model_elements(2) * 4 - \
        shape.value_model_elements(2) * 4  # the adapters' own bytes
