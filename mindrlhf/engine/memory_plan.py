"""Bytes a rank holds in each phase of an RL step: weights, gradients, optimizer moments, activations, KV cache,
logits, what is swapped to host, and whether the peak fits a device. Pure arithmetic on the model's shape and the
layouts (no MindSpore, no numpy); `mindrlhf.trainer.memory_report` fills it from a job and prints it.

The activation terms come from `mindrlhf.engine.memory_budget` (the functions the trainer sizes its graph calls
with). The runtime terms (`RUNTIME_OVERHEAD_GIB`, `GRAPH_MEMORY`) were measured on this project's CPU
backend (`benchmarks/memory_plan.py`); the Ascend ones are assumptions stated in `docs/memory_plan.md`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mindrlhf.engine import memory_budget
from mindrlhf.parallel.layout import kv_head_shards

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# Memory a rank holds besides tensors and compiled graphs: the MindSpore runtime, its communication, kernels and the
# Python process. CPU, measured: a lone process that has built a net and run nothing holds 0.39 GiB; an msrun rank
# of the tiny job peaks at 0.81 GiB and the bundled job's at 1.13, where the other terms (`GRAPH_MEMORY` among them)
# leave 0.68 (benchmarks/memory_plan.py --parts runs). Ascend: the HCCL buffers and workspace MindSpore
# reserves on the device: an assumption, not measured here.
RUNTIME_OVERHEAD_GIB = {"cpu": 0.68, "ascend": 3.0}


@dataclass(frozen=True)
class GraphMemory:
    """What a compiled graph keeps per decoder layer while it lives, beyond the memory pool (CPU: the Transpose
    kernels' index tables, oneDNN primitives, heap holes; `docs/performance.md`, "A graph keeps memory that grows
    with its call"). A forward graph (log-probs, prefill, decode) keeps `fixed` + `per_attention_element` x its
    positions x the q, k, v and output widths (about one 8-byte index per element of the four attention
    Transposes); a train graph keeps `train_share` of the activation bytes `memory_budget.train_bytes` counts for its
    layers without recompute (the backward's working buffers, which recompute does not free on CPU), and
    `per_recomputed_layer` for each layer it recomputes."""

    fixed: int = 0
    per_attention_element: float = 0.0
    train_share: float = 0.0
    per_recomputed_layer: int = 0


# CPU, fitted on `benchmarks/memory_plan.py --parts graphs` (SmolLM2-135M's shape: 9 log-prob calls of 1-32 rows,
# 199-3360 positions, within 3.3 MiB a layer of each; 5 train calls, within 2.8 MiB) and the recompute part (~20 MiB
# a recomputed layer). Ascend's graphs live in the runtime overhead above.
GRAPH_MEMORY = {"cpu": GraphMemory(fixed=5 * 2**20, per_attention_element=8.5, train_share=1.55,
                                   per_recomputed_layer=20 * 2**20),
                "ascend": GraphMemory()}


def memory_model(device_target: str, compute_dtypes) -> str:
    """The memory model (`GRAPH_MEMORY`'s key) of nets computing in `compute_dtypes` on MindSpore's `device_target`:
    "cpu" on its CPU target without bfloat16 (nothing offloads, graphs keep memory of their own), else "ascend"
    (a bfloat16 net has no CPU kernels: its YAML is for Ascend)."""
    on_cpu = device_target.upper() == "CPU" and "bfloat16" not in set(compute_dtypes)
    return "cpu" if on_cpu else "ascend"


def dtype_bytes(name: str, where: str = "dtype") -> int:
    """Bytes of one element of dtype `name` (float32, float16, bfloat16)."""
    if name not in DTYPE_BYTES:
        raise ValueError(f"{where}={name!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class NetShape:
    """The numbers of a Qwen2 network that size its memory."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qkv_bias: bool = True
    tied: bool = False
    param_bytes: int = 4
    compute_bytes: int = 4
    lora_rank: int = 0  # LoRA adapters (rank 0: none) on `lora_modules`, Hugging Face names
    lora_modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg) -> NetShape:
        """The shape of a `Qwen2Config` (read by field name)."""
        lora = cfg.lora
        return cls(vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                   kv_heads=cfg.n_kv_heads, head_dim=cfg.get_head_dim(),
                   intermediate=cfg.intermediate_size, qkv_bias=cfg.qkv_has_bias, tied=cfg.tie_word_embeddings,
                   param_bytes=dtype_bytes(cfg.param_init_type, "model_config.param_init_type"),
                   compute_bytes=dtype_bytes(cfg.compute_dtype, "model_config.compute_dtype"),
                   lora_rank=lora.lora_rank, lora_modules=lora.modules() if lora.enabled else ())

    def local_kv_heads(self, tp: int = 1) -> int:
        """Key/value heads a tp rank holds: its shard of them, or one whole head when tp is wider than the heads."""
        return self.kv_heads // kv_head_shards(self.kv_heads, tp)

    def layer_elements(self, tp: int = 1) -> int:
        """Parameters of one decoder layer on a tp rank: q, o, MLP split over tp, k/v over their shards, the two
        norms replicated."""
        q, kv = self.heads * self.head_dim // tp, self.local_kv_heads(tp) * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        base = self.hidden * (2 * q + 2 * kv) + bias + 3 * self.hidden * self.intermediate // tp + 2 * self.hidden
        return base + self.layer_adapter_elements(tp)

    def layer_adapter_elements(self, tp: int = 1) -> int:
        """LoRA parameters of one decoder layer on a tp rank: per column-parallel target A [r, in] whole and B
        [out / tp, r]; per row-parallel one A [r, in / tp] and B [out, r] whole."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.local_kv_heads(tp) * self.head_dim
        i = self.intermediate // tp
        sizes = {"q_proj": d + q // tp, "k_proj": d + kv, "v_proj": d + kv, "gate_proj": d + i, "up_proj": d + i,
                 "o_proj": q // tp + d, "down_proj": i + d}
        return self.lora_rank * sum(sizes[module] for module in self.lora_modules)

    def adapted_weight_elements(self, tp: int = 1) -> int:
        """Base weights of the layers the adapters target, over all layers on a tp rank: the rollout's merged copy
        (`lora.lora_merged_rollout`)."""
        d, q, kv = self.hidden, self.heads * self.head_dim // tp, self.local_kv_heads(tp) * self.head_dim
        i = self.intermediate // tp
        sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q, "gate_proj": i, "up_proj": i, "down_proj": i}
        return self.layers * d * sum(sizes[module] for module in self.lora_modules)

    def trained_elements(self, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
        """The parameters a stage trains on a tp rank: its adapters with LoRA, else all it holds."""
        if self.lora_rank:
            return self.layers // pp * self.layer_adapter_elements(tp)
        return self.stage_elements(tp, pp, stage)

    def value_model_elements(self, tp: int = 1, pp: int = 1, stage: int = 0, trained: bool = False) -> int:
        """Parameters of a value model's stage (`Qwen2ForValue`: the causal LM without an untied LM head, with a
        scalar head on the last stage) on a tp rank; `trained`: those it trains (with LoRA its adapters and the
        head)."""
        last = stage == pp - 1
        if trained and self.lora_rank:
            return self.trained_elements(tp, pp, stage) + (self.hidden if last else 0)
        lm_head = self.vocab * self.hidden // tp if last and not self.tied else 0
        return self.stage_elements(tp, pp, stage) - lm_head + (self.hidden if last else 0)

    def stage_elements(self, tp: int = 1, pp: int = 1, stage: int = 0) -> int:
        """Parameters pipeline stage `stage` of `pp` holds on one tp rank: its layers, the vocab-parallel embedding
        (first stage; the last too when tied and pp > 1), final norm and head (last stage)."""
        if self.layers % pp or not 0 <= stage < pp:
            raise ValueError(f"pipeline_stage={pp} must divide num_layers={self.layers} (stage {stage})")
        first, last = stage == 0, stage == pp - 1
        embedding = self.vocab * self.hidden // tp
        count = self.layers // pp * self.layer_elements(tp)
        count += embedding if first or (last and self.tied) else 0
        count += self.hidden + (0 if self.tied else embedding) if last else 0
        return count

    def kv_cache_bytes(self, rows: int, length: int, tp: int = 1) -> int:
        """Bytes of the static KV cache of `rows` sequences of `length` slots on a tp rank (`KVCache`)."""
        return 2 * self.layers * rows * self.local_kv_heads(tp) * length * self.head_dim * self.compute_bytes


def moment_bytes(elements: int, dp: int = 1, optimizer_shard: bool = False) -> int:
    """AdamW's two float32 moments of `elements` trained weights, 1/dp of them with ZeRO-1 (`optimizer_shard`)."""
    return 2 * 4 * elements // (dp if optimizer_shard else 1)


@dataclass(frozen=True)
class Call:
    """One graph call's rows: `prompts` prompts of `prompt_width` tokens read by `rows` responses of
    `response_width` tokens."""

    prompts: int
    rows: int
    prompt_width: int
    response_width: int

    @property
    def tokens(self) -> int:
        return self.prompts * self.prompt_width + self.rows * self.response_width


@dataclass(frozen=True)
class Recompute:
    """Decoder layers of a pipeline stage that recompute in the backward: fully, or their attention only."""

    full: int = 0
    selective: int = 0


def _budget_shape(shape: NetShape, tp: int) -> dict:
    return dict(hidden=shape.hidden, intermediate=shape.intermediate, heads=shape.heads, tp=tp)


def train_activation_bytes(shape: NetShape, call: Call, tp: int = 1, pp: int = 1, stage: int = 0,
                           in_flight: int = 0, recompute: Recompute = Recompute()) -> tuple[int, int]:
    """(activation bytes, logits bytes) of one train graph call on a rank of stage `stage`: the stage's layers
    (`memory_budget.train_bytes`, scaled to the compute dtype: its constants are float32's), the float32 logits and
    their gradient on the last stage, and `in_flight` micro-batches' stage inputs a 1F1B stage keeps."""
    layers = shape.layers // pp
    args = (call.prompts, call.rows, call.prompt_width, call.response_width)
    kept = memory_budget.train_bytes(*args, layers=layers, vocab=0, recomputed_layers=recompute.full,
                                     selective_layers=recompute.selective, **_budget_shape(shape, tp))
    kept = kept * shape.compute_bytes // memory_budget.FLOAT_BYTES
    kept += in_flight * call.tokens * shape.hidden * shape.compute_bytes
    logits = 0
    if stage == pp - 1:
        logits = memory_budget.train_bytes(*args, layers=0, vocab=shape.vocab, **_budget_shape(shape, tp))
    return kept, logits


def forward_activation_bytes(shape: NetShape, call: Call, tp: int = 1) -> tuple[int, int]:
    """(activation bytes, logits bytes) of one forward-only log-prob call (`memory_budget.log_prob_bytes`; a
    prefill is a call of prompts without responses: `rows` 0)."""
    args = (call.prompts, call.rows, call.prompt_width, max(call.response_width, 1))
    layer = memory_budget.log_prob_bytes(*args, vocab=0, **_budget_shape(shape, tp))
    logits = memory_budget.log_prob_bytes(0, call.rows, 0, max(call.response_width, 1),
                                          hidden=0, intermediate=0, heads=0, vocab=shape.vocab, tp=tp)
    return layer * shape.compute_bytes // memory_budget.FLOAT_BYTES, logits


def forward_graph_bytes(shape: NetShape, call: Call, tp: int = 1, device: str = "cpu") -> int:
    """Bytes a compiled forward graph of `call` keeps over its decoder layers (`GRAPH_MEMORY`): a log-prob call, a
    prefill (`rows` 0) or a decode step (a prefill of one position a row)."""
    cost = GRAPH_MEMORY[device]
    attention_width = (2 * shape.heads // tp + 2 * shape.local_kv_heads(tp)) * shape.head_dim
    per_layer = cost.fixed + cost.per_attention_element * call.tokens * attention_width
    return int(shape.layers * per_layer)


def train_graph_bytes(shape: NetShape, call: Call, tp: int = 1, pp: int = 1, stage: int = 0,
                      recompute: Recompute = Recompute(), device: str = "cpu") -> int:
    """Bytes a compiled train graph of `call` keeps over its stage's layers (`GRAPH_MEMORY`)."""
    cost = GRAPH_MEMORY[device]
    kept, _ = train_activation_bytes(shape, call, tp, pp, stage)
    return int(cost.train_share * kept) + cost.per_recomputed_layer * recompute.full


TERMS = ("weights", "gradients", "moments", "activations", "kv_cache", "logits", "runtime")


@dataclass
class PhaseMemory:
    """Bytes on device in one phase of one rank, by term (`TERMS`), and the bytes swapped out to host."""

    phase: str
    terms: dict[str, int] = field(default_factory=dict)
    host: int = 0

    @property
    def peak(self) -> int:
        return sum(self.terms.values())

    def largest(self) -> str:
        """The term holding the most bytes (what to shrink first)."""
        return max(self.terms, key=lambda t: self.terms[t])


@dataclass
class RankMemory:
    """Every phase of one group of ranks with the same figures."""

    ranks: tuple[int, ...]
    phases: list[PhaseMemory]

    def peak_phase(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.peak)


def verdict(plans: list[RankMemory], device_gib: float) -> str:
    """'fits' or 'does not fit: rank r needs X GiB in phase P ...' (the largest term named, and what to try)."""
    if device_gib <= 0:
        raise ValueError(f"--device_memory_gib must be > 0, got {device_gib}")
    worst = max(plans, key=lambda r: r.peak_phase().peak)
    phase = worst.peak_phase()
    need = phase.peak / GIB
    if need <= device_gib:
        return (f"fits: the largest rank needs {need:.2f} GiB (rank {worst.ranks[0]}, phase {phase.phase}) of "
                f"{device_gib:g} GiB per device")
    term = phase.largest()
    return (f"does not fit: rank {worst.ranks[0]} needs {need:.2f} GiB in phase {phase.phase} (> {device_gib:g} GiB "
            f"per device; largest: {term} {phase.terms[term] / GIB:.2f} GiB); try {_hint(term)}")


# what to try when a term is the largest of a peak that does not fit
HINTS = {
    "moments": "parallel_config.optimizer_shard: true (ZeRO-1 over the train data_parallel), more model_parallel "
               "or pipeline_stage",
    "activations": "recompute_config (recompute: true), smaller train calls (parallel_config.micro_batch_num with "
                   "pipeline stages, else schedule.micro_batch_size_per_device or activation_memory_gib) or more "
                   "model_parallel",
    "kv_cache": "fewer prompts per inference rank (schedule.batch_size, or more inference data_parallel) or a "
                "shorter generation.max_new_tokens / prompt bucket",
    "logits": "smaller calls (micro-batch sizes) or more model_parallel (the vocabulary is split over it)",
}
DEFAULT_HINT = "param_init_type: bfloat16, more model_parallel or more pipeline_stage"


def _hint(term: str) -> str:
    return HINTS.get(term, DEFAULT_HINT)
