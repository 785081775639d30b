"""`--plan`: the bytes each rank holds in each phase of a job (`mindrlhf.engine.memory_plan`), printed as a table,
and whether the job fits `--device_memory_gib`. Reads the job's `JobPlan` only: builds no net, needs no device.

Which weights are on device in which phase comes from the roles' specs (`resident_in` of `plan.roles()`,
`specs.phase_plan`), which the trainer's roles declare too; on a backend that does not really offload (CPU) every
swap group stays in memory in every phase, as in a run. The KV caches are a swap group of their own, on device in
generate and eval only; the gradient-accumulation buffers are in none: once made they stay for the rest of the job.
"""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np

from mindrlhf.configs.base import ConfigError
from mindrlhf.engine.batches import response_widths
from mindrlhf.engine.memory_plan import (
    GIB,
    RUNTIME_OVERHEAD_GIB,
    TERMS,
    Call,
    NetShape,
    PhaseMemory,
    RankMemory,
    Recompute,
    forward_activation_bytes,
    forward_graph_bytes,
    memory_model,
    moment_bytes,
    train_activation_bytes,
    train_graph_bytes,
    verdict,
)
from mindrlhf.engine.sizing import MicroBatchSizer
from mindrlhf.parallel.layout import Layout
from mindrlhf.trainer.plan import JobPlan, yaml_world_size
from mindrlhf.trainer.specs import (
    CRITIC_MOMENTS,
    CRITIC_WEIGHTS,
    INFER_WEIGHTS,
    KV_CACHES,
    OPTIMIZER_MOMENTS,
    REF_WEIGHTS,
    REWARD_MODEL_WEIGHTS,
    ROLLOUT_WEIGHTS,
    TRAIN_WEIGHTS,
    phase_plan,
)

MOMENT_GROUPS = (OPTIMIZER_MOMENTS, CRITIC_MOMENTS)


def recompute_of(cfg, pp: int, stage: int) -> Recompute:
    """The layers of pipeline stage `stage` that recompute, from the YAML's `recompute_config`
    (`RecomputeConfig.layers_of_stage`)."""
    full, selective = cfg.recompute.layers_of_stage(stage, pp, cfg.num_layers // pp)
    return Recompute(full=full, selective=selective)


def largest_call(kind: str, schedule, cfg, layout: Layout, group: int, rows: int, prompt_width: int,
                 response_width: int, training: bool, device: str) -> Call:
    """The graph call the trainer's sizer (`MicroBatchSizer.plan`) makes of `rows` full-width responses on
    `device` (the memory model)."""
    sizer = MicroBatchSizer.for_pass(kind, schedule, cfg, layout, group, training=training, device=device)
    columns = {"prompt_ids": np.zeros((rows, prompt_width), np.int32),
               "prompt_mask": np.ones((rows, prompt_width), np.int32),
               "response_ids": np.zeros((rows, response_width), np.int32),
               "response_mask": np.ones((rows, response_width), np.int32)}
    size, share, width = sizer.plan(columns)
    return Call(size // share, size, prompt_width, width)


def _pass_rows(plan, layout: Layout, training: bool) -> int:
    """Responses a rank of `layout` reads in one pass: an update's (`training`) or the whole rollout's."""
    return plan.shape.pass_rows(layout.dp, training)


def _sized_call(plan, kind: str, net, prompt_width: int, response_width: int, training: bool, device: str) -> Call:
    """`largest_call` of a rank of `net` (a `NetSpec`) over the responses of one pass (`_pass_rows`)."""
    return largest_call(kind, plan.config.schedule, net.model, net.layout, plan.shape.group_size,
                        _pass_rows(plan, net.layout, training), prompt_width, response_width, training, device)


def _decode_rows(plan) -> int:
    """The rows an inference rank starts decoding: all of its samples, or `generation.max_num_seqs` slots."""
    return plan.generation.decode_rows(plan.shape.rollout_rows_per_infer_rank)


def _prefilled(plan, bucket: int) -> int:
    """Prompts of `bucket` positions a prefill call of an inference rank reads: all of its prompts (in chunks within
    `generation.max_num_batched_tokens`), or with `generation.max_num_seqs` slots one."""
    shape = plan.shape
    return plan.generation.prefill_prompts(shape.prompts_per_infer_rank, bucket) \
        if _decode_rows(plan) == shape.rollout_rows_per_infer_rank else 1


def _groups(plan) -> dict[str, int]:
    """Swap group -> bytes on the plan's rank."""
    train, infer = plan.actor.train, plan.actor.infer
    ts, ins = NetShape.of(train.model), NetShape.of(infer.model)
    place = (train.layout.tp, train.layout.pp, train.layout.stage)
    shard = train.model.parallel_config.optimizer_shard
    groups = {TRAIN_WEIGHTS: ts.stage_elements(*place) * ts.param_bytes,
              OPTIMIZER_MOMENTS: moment_bytes(ts.trained_elements(*place), train.layout.dp, shard)}
    if not plan.actor.shares_train_weights:
        groups[INFER_WEIGHTS] = ins.stage_elements(infer.layout.tp) * ins.param_bytes
    if plan.actor.merges_adapters:
        groups[ROLLOUT_WEIGHTS] = ins.adapted_weight_elements(infer.layout.tp) * ins.param_bytes
    if plan.reference and not plan.reference.shares_policy_base:  # the base model: no adapters
        base = NetShape.of(plan.reference.net.model)
        groups[REF_WEIGHTS] = base.stage_elements(plan.reference.net.layout.tp) * base.param_bytes
    if plan.critic:
        cs, cl = NetShape.of(plan.critic.net.model), plan.critic.net.layout
        place = (cl.tp, cl.pp, cl.stage)
        groups[CRITIC_WEIGHTS] = cs.value_model_elements(*place) * cs.param_bytes
        shard = plan.critic.net.model.parallel_config.optimizer_shard
        groups[CRITIC_MOMENTS] = moment_bytes(cs.value_model_elements(*place, trained=True), cl.dp, shard)
    if plan.reward.model:
        rs = NetShape.of(plan.reward.model.model)
        groups[REWARD_MODEL_WEIGHTS] = rs.value_model_elements(plan.reward.model.layout.tp) * rs.param_bytes
    return groups


def _residency(plan) -> dict[str, tuple[str, ...]]:
    """Phase -> resident swap groups, from the roles' specs (the phases this job runs)."""
    phases = ["generate"] + (["reward"] if plan.reward.model else [])
    phases += ["ref"] if plan.reference else []
    phases += ["old"] if plan.config.schedule.num_iterations > 1 else []
    phases += ["values", "update_critic"] if plan.critic else []
    phases += ["train", "reshard"] + (["sync_ref"] if plan.reference and plan.config.schedule.ref_model_sync_steps
                                      else [])
    phases += ["eval"] if plan.job.eval_dataset_file else []
    resident = phase_plan(plan.roles(), phases)
    return {phase: resident[phase] for phase in phases}


def _width_graph_bytes(plan, width: int, device: str) -> int:
    """Bytes the graphs of one response width keep (`GRAPH_MEMORY`), per prompt bucket: the train graph of the
    sizer's call, the reference's and the old policy's log-prob graphs and, with a critic, its value and train
    graphs."""
    sched, train, infer = plan.config.schedule, plan.actor.train, plan.actor.infer
    forwards = int(bool(plan.reference)) + int(sched.num_iterations > 1)
    total = 0
    for bucket in plan.generation.prompt_buckets:
        total += _train_graph_bytes(plan, "train", train, bucket, width, device)
        call = _sized_call(plan, "log_prob", infer, bucket, width, False, device)
        total += forwards * forward_graph_bytes(NetShape.of(infer.model), call, infer.layout.tp, device)
        if plan.critic:
            critic = plan.critic.net
            total += _train_graph_bytes(plan, "critic train", critic, bucket, width, device)
            call = _sized_call(plan, "values", critic, bucket, width, False, device)
            total += forward_graph_bytes(NetShape.of(critic.model), call, critic.layout.tp, device)
    return total


def _train_graph_bytes(plan, kind: str, net, prompt_width: int, response_width: int, device: str) -> int:
    """`train_graph_bytes` of the sizer's train call of `net` at these widths, with its stage's recompute."""
    layout = net.layout
    call = _sized_call(plan, kind, net, prompt_width, response_width, True, device)
    return train_graph_bytes(NetShape.of(net.model), call, layout.tp, layout.pp, layout.stage,
                             recompute_of(net.model, layout.pp, layout.stage), device)


def graph_bytes(plan, device: str) -> tuple[int, int]:
    """(bytes the graphs a rank compiles keep while the job runs, the part of them that belongs to response widths
    narrower than a response row, `response_width`): every width of `schedule.response_buckets` (a long run reaches
    them: a pass reads the narrowest width that holds its longest response), a prefill graph per prompt bucket and
    the decode graph."""
    gen, infer = plan.generation, plan.actor.infer
    ins, tp = NetShape.of(infer.model), infer.layout.tp
    decodes = sum(forward_graph_bytes(ins, Call(rows, 0, 1, 0), tp, device)
                  for rows in gen.decode_row_counts(_decode_rows(plan)))
    rollout = decodes + sum(forward_graph_bytes(ins, Call(_prefilled(plan, bucket), 0, bucket, 0), tp, device)
                            for bucket in gen.prompt_buckets)
    widths = [_width_graph_bytes(plan, width, device)
              for width in response_widths(gen.response_width, plan.config.schedule.response_buckets)]
    return rollout + sum(widths), sum(widths[:-1])


def _transients(plan, device: str) -> dict[str, dict[str, int]]:
    """Phase -> the terms that exist only while it runs on `device` (activations, logits, one call's gradients)."""
    gen = plan.generation
    P, R = max(gen.prompt_buckets), gen.response_width
    train_cfg, infer_cfg = plan.actor.train.model, plan.actor.infer.model
    train, infer = plan.actor.train.layout, plan.actor.infer.layout
    ts, ins = NetShape.of(train_cfg), NetShape.of(infer_cfg)
    prefilled = {bucket: _prefilled(plan, bucket) for bucket in gen.prompt_buckets}
    prefill = max(forward_activation_bytes(ins, Call(prompts, 0, bucket, 0), infer.tp)[0]
                  for bucket, prompts in prefilled.items())
    generate = {"activations": prefill, "logits": 4 * ins.vocab * (max(prefilled.values()) + _decode_rows(plan))}
    acts, logits = forward_activation_bytes(ins, _sized_call(plan, "log_prob", plan.actor.infer, P, R, False, device),
                                            infer.tp)
    forward = {"activations": acts, "logits": logits}
    call = _sized_call(plan, "train", plan.actor.train, P, R, True, device)
    in_flight = train.pp - train.stage if train.stage < train.pp - 1 else 0
    recompute = recompute_of(train_cfg, train.pp, train.stage)
    acts, logits = train_activation_bytes(ts, call, train.tp, train.pp, train.stage, in_flight, recompute)
    grads = ts.trained_elements(train.tp, train.pp, train.stage) * ts.param_bytes
    out = {"generate": generate, "eval": generate, "ref": forward, "old": forward, "values": forward,
           "train": {"activations": acts, "logits": logits, "gradients": grads}}
    if plan.critic:  # the actor's call's activations (the same rows and model), the critic's own gradients
        cs, cl = NetShape.of(plan.critic.net.model), plan.critic.net.layout
        out["update_critic"] = dict(out["train"], gradients=cs.value_model_elements(
            cl.tp, cl.pp, cl.stage, trained=True) * cs.param_bytes)
    out["buffers"] = {"gradients": grads if train.pp > 1 or call.rows < _pass_rows(plan, train, True) else 0}
    return out


def _pooled(transient: dict[str, int]) -> int:
    """A phase's bytes in the memory pool: its largest call's activations and logits."""
    return transient.get("activations", 0) + transient.get("logits", 0)


def rank_memory(plan, rank: int, device: str = "cpu") -> list[PhaseMemory]:
    """Every phase's bytes on `rank` of the job of `plan` (a `JobPlan`) on `device` ("cpu": nothing really
    offloads; "ascend": the swap plan's idle groups are on host)."""
    plan = plan.for_rank(rank)
    groups = _groups(plan)
    transients = _transients(plan, device)
    gen, ins = plan.generation, NetShape.of(plan.actor.infer.model)
    # a KV cache for each row count the rollout's tail can step down to (`generation.min_decode_rows`)
    kv = sum(ins.kv_cache_bytes(rows, gen.cache_length, plan.actor.infer.layout.tp)
             for rows in gen.decode_row_counts(_decode_rows(plan)))
    runtime = int(RUNTIME_OVERHEAD_GIB[device] * GIB) + graph_bytes(plan, device)[0]
    residency = _residency(plan)
    # CPU: the memory pool never gives pages back, so every phase holds the pool's high water (the largest phase's)
    pool = max(_pooled(transients.get(p, {})) for p in residency) if device == "cpu" else 0
    phases = []
    for phase, resident in residency.items():
        on_device = groups if device == "cpu" else {g: b for g, b in groups.items() if g in resident}
        kv_on_device = kv if device == "cpu" or KV_CACHES in resident else 0
        extra = transients.get(phase, {})
        terms = dict.fromkeys(TERMS, 0)
        terms["weights"] = sum(b for g, b in on_device.items() if g not in MOMENT_GROUPS)
        terms["moments"] = sum(b for g, b in on_device.items() if g in MOMENT_GROUPS)
        terms["gradients"] = transients["buffers"]["gradients"] + extra.get("gradients", 0)
        terms.update(activations=extra.get("activations", 0) + max(0, pool - _pooled(extra)),
                     logits=extra.get("logits", 0), kv_cache=kv_on_device, runtime=runtime)
        host = sum(groups.values()) - sum(on_device.values()) + kv - kv_on_device
        phases.append(PhaseMemory(phase, terms, host=host))
    return phases


def job_memory(plan, device: str = "cpu") -> list[RankMemory]:
    """Every rank's phases, ranks with the same figures grouped."""
    grouped: dict[tuple, list[int]] = {}
    figures: dict[tuple, list[PhaseMemory]] = {}
    for rank in range(plan.world_size):
        phases = rank_memory(plan, rank, device)
        key = tuple((p.phase, tuple(p.terms.items()), p.host) for p in phases)
        grouped.setdefault(key, []).append(rank)
        figures[key] = phases
    return [RankMemory(tuple(ranks), figures[key]) for key, ranks in grouped.items()]


def format_report(plans: list[RankMemory], header: str, device_gib: float) -> str:
    """The table (per rank, per phase and term; MiB when every peak is below 4 GiB, else GiB), each group's job
    peak, and the fits / does-not-fit line."""
    unit, scale = ("MiB", 2**20) if max(g.peak_phase().peak for g in plans) < 4 * GIB else ("GiB", GIB)
    lines = [f"{header}; {unit} per rank (device = the phase's peak; host = swapped out)"]
    columns = ("phase",) + TERMS + ("device", "host")
    for group in plans:
        ranks = group.ranks
        lines.append(f"ranks {','.join(map(str, ranks))}:" if len(ranks) > 1 else f"rank {ranks[0]}:")
        lines.append("  " + f"{columns[0]:<14}" + "".join(f"{c:>12}" for c in columns[1:]))
        for p in group.phases:
            cells = [f"{p.terms[t] / scale:.3f}" for t in TERMS] + [f"{p.peak / scale:.3f}", f"{p.host / scale:.3f}"]
            lines.append("  " + f"{p.phase:<14}" + "".join(f"{c:>12}" for c in cells))
        top = group.peak_phase()
        lines.append(f"  peak: {top.peak / GIB:.3f} GiB in phase {top.phase} (largest term: {top.largest()})")
    lines.append(verdict(plans, device_gib))
    return "\n".join(lines)


def device_kind(plan) -> str:
    """The memory model of the job's devices: "ascend" when MindSpore's device target is one or a net computes in
    bfloat16 (no CPU kernels: the YAMLs are for Ascend), else "cpu" (nothing offloads)."""
    return memory_model(ms.get_context("device_target"), [net.model.compute_dtype for net in plan.nets()])


def plan_report(config, job, tokenizer, device: str | None = None) -> str:
    """`--plan`: the `JobPlan` of the YAMLs' world (their layouts' ranks, not the launcher's) and its memory table
    with the fits line. A ConfigError (`--device_memory_gib` < 0) or the plan's checks' errors name the field."""
    if job.device_memory_gib < 0:
        raise ConfigError(f"--device_memory_gib must be >= 0 (0 = host memory / ranks), got {job.device_memory_gib}")
    world = yaml_world_size(job)
    plan = JobPlan.build(config, job, tokenizer, world, 0)
    device = device or device_kind(plan)
    device_gib = job.device_memory_gib or \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / world
    t, i = plan.actor.train.layout, plan.actor.infer.layout
    header = (f"memory plan: {world} rank(s), train dp{t.dp} x tp{t.tp} x pp{t.pp}, infer dp{i.dp} x tp{i.tp}, "
              f"device {device}")
    report = format_report(job_memory(plan, device), header, device_gib).splitlines()
    narrower = graph_bytes(plan, device)[1]
    if narrower:
        report.insert(-1, f"of rank 0's runtime, {narrower / GIB:.2f} GiB are the graphs of the response widths "
                          f"narrower than max_new_tokens, compiled once a pass's longest response fits one "
                          f"(schedule.response_buckets: 1 compiles the widest only)")
    return "\n".join(report)
