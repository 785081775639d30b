"""Qwen2 / Qwen2.5 / Llama decoder on MindSpore, built from the tensor-parallel layers.

Runs in GRAPH_MODE. Matmuls in `compute_dtype`; RMSNorm, rotary, softmax and log-probs in float32.
Parameter names follow :mod:`mindrlhf.models.qwen2.names`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from mindrlhf.configs.lora import LoraConfig, is_adapter
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.optim import update_groups
from mindrlhf.parallel.comm import CopyToTensorParallel, GatherFromTensorParallel
from mindrlhf.parallel.layers import (
    INIT_STD,
    ColumnParallelLinear,
    ParallelLayer,
    RMSNorm,
    RowParallelLinear,
    SequenceParallel,
    VocabParallelEmbedding,
    VocabParallelLogProbs,
    expand_as,
    scaled_by_temperature,
    shard_size,
    to_ms_dtype,
)
from mindrlhf.parallel.layout import Layout, LayoutError, kv_head_shards

MASK_VALUE = -1e9  # additive attention bias of masked positions (float32)


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [length, head_dim] in float32, laid out as Hugging Face's rotate_half convention."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    freqs = np.outer(np.arange(length, dtype=np.float32), inv_freq.astype(np.float32))
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R == concat(-x[..., half:], x[..., :half]) (HF's rotate_half), exactly: one +-1 per column.

    One small matmul instead of two strided slices, a negation and a concat, which cost more on CPU."""
    half = head_dim // 2
    matrix = np.zeros((head_dim, head_dim), np.float32)
    matrix[np.arange(half) + half, np.arange(half)] = -1.0
    matrix[np.arange(half), np.arange(half) + half] = 1.0
    return matrix


def apply_rotary(x, cos, sin, rotate_half):
    """Rotates [B, S, heads, hd] by cos/sin [B, S, 1, hd] in float32 (`rotate_half`: `rotate_half_matrix`);
    returns x's dtype."""
    x32 = x.astype(ms.float32)
    rotated = ops.matmul(x32.reshape(-1, x.shape[-1]), rotate_half).reshape(x.shape)
    return (x32 * expand_as(cos, x32) + rotated * expand_as(sin, x32)).astype(x.dtype)


class Qwen2Attention(nn.Cell):
    """Grouped-query attention; q/k/v column-parallel by heads, o row-parallel. With tp above the kv heads each
    rank holds the one kv head its query heads use (`kv_head_shards`).

    `attn_bias` is an additive bias [B, 1, S, L] (one sequence per row), or, for prompts shared by several
    responses (:func:`response_sequences`), the pair (prompt bias [Bg, 1, P, P], response bias
    [Bg, 1, K, 1, W, P + W]): each row then holds a prompt and K responses of width W that read it."""

    def __init__(self, config: Qwen2Config, layout: Layout):
        super().__init__()
        hd = config.get_head_dim()
        tp = layout.tp
        param_dtype, self.compute_dtype = to_ms_dtype(config.param_init_type), to_ms_dtype(config.compute_dtype)
        self.head_dim = hd
        self.heads_local = shard_size(config.num_heads, tp, "num_heads")
        kv_shards = kv_head_shards(config.n_kv_heads, tp)
        self.kv_heads_local = config.n_kv_heads // kv_shards
        self.kv_repeat = self.heads_local // self.kv_heads_local  # local query heads per local kv head
        self.scale = 1.0 / math.sqrt(hd)
        self.scores_matmul = ops.BatchMatMul(transpose_b=True)
        self.write_rows = ops.ScatterUpdate()
        self.rotate_half = Tensor(rotate_half_matrix(hd))
        kw = dict(layout=layout, param_dtype=param_dtype, compute_dtype=self.compute_dtype)
        bias = config.qkv_has_bias
        self.wq = ColumnParallelLinear(config.hidden_size, config.num_heads * hd, bias, name="wq", **kw)
        self.wk = ColumnParallelLinear(config.hidden_size, config.n_kv_heads * hd, bias, name="wk", shards=kv_shards,
                                       **kw)
        self.wv = ColumnParallelLinear(config.hidden_size, config.n_kv_heads * hd, bias, name="wv", shards=kv_shards,
                                       **kw)
        self.wo = RowParallelLinear(config.num_heads * hd, config.hidden_size, False, name="wo", **kw)
        add_adapters({"q_proj": self.wq, "k_proj": self.wk, "v_proj": self.wv, "o_proj": self.wo}, config.lora)

    def _by_kv_head(self, x, batch, seq):
        """[B, heads, S, X] -> [B, kv_heads, group * S, X]: each kv head with the query heads that share it
        (query head h uses kv head h // group), so attention needs no repeated copy of k and v."""
        return x.reshape(batch, self.kv_heads_local, self.kv_repeat * seq, x.shape[-1])

    def _probs(self, scores, bias):
        """softmax(scores * scale + bias) over the keys, in float32; returns the compute dtype."""
        scores = scores.astype(ms.float32) * self.scale
        return ops.softmax(scores + expand_as(bias, scores), -1).astype(self.compute_dtype)

    def construct(self, x, cos, sin, attn_bias, key_cache=None, value_cache=None, slot_index=None, prefill_rows=None):
        batch, seq, _ = x.shape
        hd = self.head_dim
        q = apply_rotary(self.wq(x).reshape(batch, seq, self.heads_local, hd), cos, sin, self.rotate_half)
        k = apply_rotary(self.wk(x).reshape(batch, seq, self.kv_heads_local, hd), cos, sin, self.rotate_half)
        v = self.wv(x).reshape(batch, seq, self.kv_heads_local, hd)
        if isinstance(attn_bias, tuple):
            return self.wo(self._shared_prompt_attention(q, k, v, attn_bias[0], attn_bias[1]))
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        if key_cache is not None:
            if slot_index is None:
                # prefill: slots [0, seq) of the cache rows `prefill_rows` marks are filled from the prompt each
                # reads (several rows from one prompt: its samples; rows not marked keep what they hold)
                self._fill_prompt_slots(key_cache, k, prefill_rows)
                self._fill_prompt_slots(value_cache, v, prefill_rows)
            elif isinstance(slot_index, tuple):
                k, v = self._extend_rows(key_cache, k, slot_index), self._extend_rows(value_cache, v, slot_index)
            else:
                # decode: the new position's key and value go in place into the cache's rows `slot_index`
                # [B, kv_heads] (KVCache: one row of head_dim values a sample, head and position); a ScatterUpdate
                # moves B x kv_heads x head_dim values, where a ScatterNdUpdate on the 4-D cache copied all of it
                new_shape = (batch, self.kv_heads_local, hd)  # seq is 1: a reshape, not a slice
                cache_shape = (batch, self.kv_heads_local, key_cache.shape[0] // (batch * self.kv_heads_local), hd)
                k = self.write_rows(key_cache, slot_index, k.reshape(new_shape).astype(key_cache.dtype))
                v = self.write_rows(value_cache, slot_index, v.reshape(new_shape).astype(value_cache.dtype))
                k = k.reshape(cache_shape).astype(self.compute_dtype)
                v = v.reshape(cache_shape).astype(self.compute_dtype)
        length = k.shape[2]
        scores = self.scores_matmul(self._by_kv_head(q, batch, seq), k)  # q k^T without a transposed copy of k
        probs = self._probs(scores.reshape(batch, self.heads_local, seq, length), attn_bias)
        out = ops.matmul(self._by_kv_head(probs, batch, seq), v)
        out = out.reshape(batch, self.heads_local, seq, hd).transpose(0, 2, 1, 3)
        return self.wo(out.reshape(batch, seq, self.heads_local * hd))

    def _extend_rows(self, cache, x, extension):
        """Writes the columns of keys or values x [B, kv_heads, W, hd] that `extension` = (rows [B, kv_heads, W] int32,
        written [B, 1, W, 1] 0/1) marks into those cache rows (a column not marked keeps what its row holds); returns
        the whole cache as [B, kv_heads, L, hd] in the compute dtype."""
        rows, written = extension
        batch, heads, width, hd = x.shape
        kept = ops.gather(cache, rows, 0)
        new = ops.select(ops.broadcast_to(written > 0, kept.shape), x.astype(cache.dtype), kept)
        updated = self.write_rows(cache, rows, new)
        return updated.reshape(batch, heads, cache.shape[0] // (batch * heads), hd).astype(self.compute_dtype)

    @staticmethod
    def _fill_prompt_slots(cache, x, prefill_rows):
        """cache[b, :, :S] = x[source[b]] where written[b] (`prefill_rows` = (source [B] int32, written [B] 0/1)), for
        prompts' keys or values x [B', heads, S, hd] and the cache's rows seen as [B, heads, L, hd]; the rest of the
        cache is unchanged."""
        source, written = prefill_rows
        batch, heads, seq, hd = source.shape[0], x.shape[1], x.shape[2], x.shape[3]
        length = cache.shape[0] // (batch * heads)
        full = cache.reshape(batch, heads, length, hd)
        rows = ops.gather(x.astype(cache.dtype), source, 0)
        head = full[:, :, :seq] if seq < length else full
        keep = ops.broadcast_to(written.reshape(-1, 1, 1, 1) > 0, rows.shape)
        head = ops.select(keep, rows, head)
        filled = ops.concat((head, full[:, :, seq:]), 2) if seq < length else head
        ops.assign(cache, filled.reshape(cache.shape))

    def _shared_prompt_attention(self, q, k, v, prompt_bias, response_bias):
        """Attention over rows [prompt (P) | K responses (W each)], q [Bg, P + K W, heads, hd], k/v [.., kv_heads,
        hd] (rotated): the prompt attends to itself (causal), each response to the prompt and causally to itself,
        never to the other responses. Equal to K separate [prompt | response] sequences, with the prompt's
        projections, keys and values computed once; returns [Bg, P + K W, heads x hd]."""
        bg = q.shape[0]
        p, count, width = prompt_bias.shape[-1], response_bias.shape[2], response_bias.shape[4]
        kvh, group, hd = self.kv_heads_local, self.kv_repeat, self.head_dim
        # the prompt: [Bg, kv_heads, group x P, hd] queries against its own P keys
        q_p = q[:, :p].reshape(bg, p, kvh, group, hd).transpose(0, 2, 3, 1, 4).reshape(bg, kvh, group * p, hd)
        k_p = k[:, :p].transpose(0, 2, 1, 3)
        v_p = v[:, :p].transpose(0, 2, 1, 3)
        probs_p = self._probs(self.scores_matmul(q_p, k_p).reshape(bg, self.heads_local, p, p), prompt_bias)
        out_p = ops.matmul(probs_p.reshape(bg, kvh, group * p, p), v_p)
        out_p = out_p.reshape(bg, kvh, group, p, hd).transpose(0, 3, 1, 2, 4).reshape(bg, p, self.heads_local * hd)
        # the responses: queries [Bg, kv_heads, K, group x W, hd] against the prompt's keys and their own
        q_r = q[:, p:].reshape(bg, count, width, kvh, group, hd).transpose(0, 3, 1, 4, 2, 5)
        k_r = k[:, p:].reshape(bg, count, width, kvh, hd).transpose(0, 3, 1, 2, 4)
        v_r = v[:, p:].reshape(bg, count, width, kvh, hd).transpose(0, 3, 1, 2, 4)
        to_prompt = self.scores_matmul(q_r.reshape(bg, kvh, count * group * width, hd), k_p)
        to_self = self.scores_matmul(q_r.reshape(bg, kvh, count, group * width, hd), k_r)
        scores = ops.concat((to_prompt.reshape(bg, kvh, count, group * width, p), to_self), -1)
        probs_r = self._probs(scores.reshape(bg, kvh, count, group, width, p + width), response_bias)
        probs_r = probs_r.reshape(bg, kvh, count, group * width, p + width)
        out_r = ops.matmul(probs_r[..., :p].reshape(bg, kvh, count * group * width, p), v_p)
        out_r = out_r.reshape(bg, kvh, count, group * width, hd) + ops.matmul(probs_r[..., p:], v_r)
        out_r = out_r.reshape(bg, kvh, count, group, width, hd).transpose(0, 2, 4, 1, 3, 5)
        return ops.concat((out_p, out_r.reshape(bg, count * width, self.heads_local * hd)), 1)


class Qwen2MLP(nn.Cell):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1/w3 column-parallel, w2 row-parallel."""

    def __init__(self, config: Qwen2Config, layout: Layout):
        super().__init__()
        kw = dict(layout=layout, param_dtype=to_ms_dtype(config.param_init_type),
                  compute_dtype=to_ms_dtype(config.compute_dtype))
        self.w1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, name="w1", **kw)
        self.w3 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, name="w3", **kw)
        self.w2 = RowParallelLinear(config.intermediate_size, config.hidden_size, name="w2", **kw)
        add_adapters({"gate_proj": self.w1, "up_proj": self.w3, "down_proj": self.w2}, config.lora)

    def construct(self, x):
        return self.w2(ops.silu(self.w1(x)) * self.w3(x))


def add_adapters(layers: dict, lora: LoraConfig) -> None:
    """LoRA adapters on those of `layers` (Hugging Face module name -> linear layer) that `lora` targets."""
    if lora.enabled:
        for module in lora.modules():
            if module in layers:
                layers[module].add_lora(lora.lora_rank, lora.lora_alpha, lora.lora_dropout)


def freeze_all_but_adapters(net: nn.Cell) -> None:
    """With adapters, only they train: every other parameter gets no gradient (and no optimizer state)."""
    for param in net.get_parameters():
        if not is_adapter(param.name):
            param.requires_grad = False


def _params_at_the_same_places(net: nn.Cell, source: nn.Cell) -> list[tuple[nn.Cell, str, Parameter, Parameter]]:
    """(cell of `net`, attribute, its parameter, the parameter `source` holds at the same cell path and attribute)
    for each parameter of `net`."""
    cells = dict(source.cells_and_names())
    return [(cell, attr, param, getattr(cells[path], attr)) for path, cell in net.cells_and_names()
            # MindSpore keeps a cell's own parameters (not its children's) in `_params`
            for attr, param in cell._params.items() if param is not None]


def share_weights(net: nn.Cell, source: nn.Cell, keep: Iterable[Parameter] = ()) -> None:
    """Makes each parameter of `net` but those in `keep` the parameter `source` holds at the same place (cell path and
    attribute): both nets then compute with one copy of those weights. `source` may hold more (a net with
    adapters)."""
    own = {id(param) for param in keep}
    for cell, attr, param, shared in _params_at_the_same_places(net, source):
        if id(param) not in own:
            cell.insert_param_to_cell(attr, shared)


def copy_weights(net: nn.Cell, source: nn.Cell) -> None:
    """Copies into each parameter of `net`, in place, the parameter `source` holds at the same place (cell path and
    attribute), which must have its shape and dtype: a local copy between two nets of one layout. `source` may hold
    more (a net with adapters)."""
    for _, _, param, value in _params_at_the_same_places(net, source):
        if value.shape != param.shape or value.dtype != param.dtype:
            raise ValueError(f"copy_weights: {param.name} is {param.dtype}{param.shape}, its source "
                             f"{value.name} {value.dtype}{value.shape}")
        param.copy_(value)  # in place: no new buffer (set_data of a copy took ~40x as long)


_merge_adapter = ops.MultitypeFuncGraph("merge_adapter")


@_merge_adapter.register("Number", "Tensor", "Tensor", "Tensor", "Tensor", "Tensor")
def _write_merged(scaling, done, target, weight, lora_a, lora_b):
    """`target` = `weight` + `scaling` B A, computed in float32, after `done`."""
    delta = ops.matmul(ops.depend(lora_b, done).astype(ms.float32), lora_a.astype(ms.float32))
    return ops.assign(target, (weight.astype(ms.float32) + delta * scaling).astype(target.dtype))


class MergedAdapters(nn.Cell):
    """Makes `net` (the model of `source` without adapters, in its layout) compute what `source` computes with its
    adapters: every parameter of `net` becomes `source`'s at the same place (`share_weights`) but the weights of the
    layers `source` adapts, which stay `net`'s own and which a call sets to W + (alpha / r) B A from `source`'s
    layer (`add_lora`'s forward, merged). A call is the rollout's refresh after an update; it writes a group of
    weights after the other (`optim.update_groups`), so that at most a group's products exist at once."""

    def __init__(self, net: nn.Cell, source: nn.Cell):
        super().__init__(auto_prefix=False)
        cells = dict(source.cells_and_names())
        adapted = [(cell, cells[path]) for path, cell in net.cells_and_names()
                   if getattr(cells.get(path), "has_lora", False)]
        if not adapted:
            raise ValueError("MergedAdapters: the source net has no adapters")
        share_weights(net, source, keep=[cell.weight for cell, _ in adapted])
        self.scaling = adapted[0][1].lora_scaling  # one alpha / r for the whole net (`LoraConfig`)
        for cell, _ in adapted:
            cell.weight.requires_grad = False  # made from the source's, never trained
        self.targets = ParameterTuple(cell.weight for cell, _ in adapted)
        self.weights = ParameterTuple(layer.weight for _, layer in adapted)
        self.lora_a = ParameterTuple(layer.lora_a for _, layer in adapted)
        self.lora_b = ParameterTuple(layer.lora_b for _, layer in adapted)
        self.groups = update_groups([int(np.prod(p.shape, dtype=np.int64)) for p in self.targets])

    def construct(self):
        done = ops.zeros((), ms.float32)
        for start, end in self.groups:
            written = ops.HyperMap()(ops.partial(_merge_adapter, self.scaling, done), self.targets[start:end],
                                     self.weights[start:end], self.lora_a[start:end], self.lora_b[start:end])
            done = ops.depend(done, written)
        return done


def uses_sequence_parallel(config: Qwen2Config, layout: Layout) -> bool:
    """Whether a net runs sequence parallel: `parallel_config.use_seq_parallel` with tp > 1."""
    return config.parallel_config.use_seq_parallel and layout.tp > 1


def sequence_parallel(config: Qwen2Config, layout: Layout) -> SequenceParallel | None:
    """The sequence-parallel cell of a net (`uses_sequence_parallel`), or None."""
    return SequenceParallel(layout) if uses_sequence_parallel(config, layout) else None


RECOMPUTE_MODES = ("none", "full", "attention")


class Qwen2DecoderLayer(nn.Cell):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)). With sequence parallel (`sequence`) and no
    KV cache, `x` is this rank's part of the sequence (:class:`SequenceParallel`). `recompute` (RECOMPUTE_MODES):
    what a backward pass recomputes instead of keeping (the whole layer, or its attention)."""

    def __init__(self, config: Qwen2Config, layout: Layout, recompute: str = "none"):
        super().__init__()
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.sequence = sequence_parallel(config, layout)
        norm_kw = dict(eps=config.rms_norm_eps, param_dtype=to_ms_dtype(config.param_init_type),
                       compute_dtype=to_ms_dtype(config.compute_dtype),
                       sequence_parallel=layout if self.sequence is not None else None)
        self.attention_norm = RMSNorm(config.hidden_size, **norm_kw)
        self.attention = Qwen2Attention(config, layout)
        self.ffn_norm = RMSNorm(config.hidden_size, **norm_kw)
        self.feed_forward = Qwen2MLP(config, layout)
        if recompute == "full":
            self.recompute()
        elif recompute == "attention":
            self.attention.recompute()

    def construct(self, x, cos, sin, attn_bias, key_cache=None, value_cache=None, slot_index=None, prefill_rows=None):
        if self.sequence is not None and key_cache is None:
            return self._sequence_parallel(x, cos, sin, attn_bias)
        h = x + self.attention(self.attention_norm(x), cos, sin, attn_bias, key_cache, value_cache, slot_index,
                               prefill_rows)
        return h + self.feed_forward(self.ffn_norm(h))

    def _sequence_parallel(self, x, cos, sin, attn_bias):
        length = cos.shape[1]
        attended = self.attention(self.sequence.gather(self.attention_norm(x), length), cos, sin, attn_bias)
        h = x + self.sequence.split(attended)
        return h + self.sequence.split(self.feed_forward(self.sequence.gather(self.ffn_norm(h), length)))


class InlinedDecoderLayer(Qwen2DecoderLayer):
    """A decoder layer compiled once and inlined (`lazy_inline`, "front"): a graph over L such layers parses, infers
    and differentiates one layer instead of L, which halves the compile time of a many-layer graph and gives the same
    graph. Layers built with equal arguments share that compiled layer, so everything that makes one layer's graph
    differ from another's (the recompute mode) is an argument of `__init__`."""

    @ms.lazy_inline(policy="front")
    def __init__(self, config: Qwen2Config, layout: Layout, recompute: str = "none"):
        super().__init__(config, layout, recompute)


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers pipeline stage `stage` of `stages` owns: an equal, contiguous share."""
    if num_layers % stages:
        raise LayoutError(f"num_layers={num_layers} is not divisible by the pipeline stages {stages}")
    per_stage = num_layers // stages
    return range(stage * per_stage, (stage + 1) * per_stage)


class Qwen2Model(nn.Cell):
    """Embedding, decoder layers and final norm; returns hidden states [B, S, D].

    With pipeline stages (`layout.pp > 1`) it is the part of `layout.stage`: the embedding on the first stage,
    its share of the layers (parameters named by their global index, `layers.<i>`), the final norm on the last;
    a later stage starts from `hidden_in`, the previous stage's output, and a stage before the last returns its
    layers' output without the norm. With tied embeddings the last stage holds a copy of the embedding, under
    the same name, for the head (:attr:`Qwen2ForCausalLM.stage_shared_params`)."""

    def __init__(self, config: Qwen2Config, layout: Layout):
        super().__init__()
        compute_dtype = to_ms_dtype(config.compute_dtype)
        owned = stage_layers(config.num_layers, layout.pp, layout.stage)
        self.first_stage, self.last_stage = layout.stage == 0, layout.stage == layout.pp - 1
        self.owned_layers = tuple(owned)
        holds_embedding = self.first_stage or (self.last_stage and config.tie_word_embeddings)
        self.tok_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, layout,
                                                     to_ms_dtype(config.param_init_type),
                                                     compute_dtype) if holds_embedding else None
        # other stages' layers are empty placeholders, so that a layer's parameters are named by its global index;
        # a forward-only graph is unaffected by recompute, which acts in backward passes
        full, selective = config.recompute.layers_of_stage(layout.stage, layout.pp, len(owned))
        modes = ["full"] * full + ["attention"] * selective + ["none"] * (len(owned) - full - selective)
        self.layers = nn.CellList([InlinedDecoderLayer(config, layout, modes[i - owned.start]) if i in owned
                                   else nn.Cell() for i in range(config.num_layers)])
        self.sequence = sequence_parallel(config, layout)
        self.norm_out = RMSNorm(config.hidden_size, config.rms_norm_eps, to_ms_dtype(config.param_init_type),
                                compute_dtype, layout if self.sequence is not None else None) \
            if self.last_stage else None
        cos, sin = rotary_tables(config.get_head_dim(), config.seq_length, config.theta)
        self.cos_table = Tensor(cos)
        self.sin_table = Tensor(sin)

    def construct(self, input_ids, position_ids, attn_bias, key_caches=None, value_caches=None, slot_index=None,
                  hidden_in=None, prefill_rows=None):
        h = self.tok_embeddings(input_ids) if self.first_stage else hidden_in
        cos = ops.expand_dims(ops.gather(self.cos_table, position_ids, 0), 2)
        sin = ops.expand_dims(ops.gather(self.sin_table, position_ids, 0), 2)
        if key_caches is None and self.sequence is not None:
            return self._sequence_parallel(h, cos, sin, attn_bias)
        if key_caches is None:
            for i in self.owned_layers:
                h = self.layers[i](h, cos, sin, attn_bias)
        else:
            for i in self.owned_layers:
                h = self.layers[i](h, cos, sin, attn_bias, key_caches[i], value_caches[i], slot_index, prefill_rows)
        return self.norm_out(h) if self.last_stage else h

    def _sequence_parallel(self, h, cos, sin, attn_bias):
        """The layers (and the final norm) on this rank's part of the sequence; returns the whole [B, L, D]."""
        length = h.shape[1]
        h = self.sequence.split(h)
        for i in self.owned_layers:
            h = self.layers[i](h, cos, sin, attn_bias)
        if self.last_stage:
            h = self.norm_out(h)
        return self.sequence.gather(h, length)

    def read_responses(self, prompt_ids, prompt_mask, response_ids, response_mask, next_token=True, hidden_in=None):
        """This pipeline stage's output over the rows of :func:`response_sequences` (prompts [Bg, P], each read once
        for its K = response rows / Bg responses [Bg K, R]): [Bg, P + K W, D], W = R - 1 with `next_token` (the
        positions that predict each response token: the last response token is not read) else R. The first
        stage embeds the tokens, a later one starts from `hidden_in`; the last one applies the final norm. Call
        inside a Cell's construct; :func:`response_states` picks each response's positions."""
        width = response_ids.shape[1] - 1 if next_token else response_ids.shape[1]
        ids, position_ids, attn_bias = response_sequences(prompt_ids, prompt_mask, response_ids[:, :width],
                                                          response_mask[:, :width])
        return self.construct(ids, position_ids, attn_bias, hidden_in=hidden_in)


class VocabParallelHead(ParallelLayer):
    """lm_head: hidden [.., D] -> logits over this rank's vocabulary shard, in float32.

    Holds its own weight (`lm_head.weight`) unless tied, in which case the embedding is passed in.
    """

    def __init__(self, config: Qwen2Config, layout: Layout):
        super().__init__(layout)
        self.vocab_local = shard_size(config.vocab_size, self.tp_size, "vocab_size")
        self.compute_dtype = to_ms_dtype(config.compute_dtype)
        if config.tie_word_embeddings:
            self.weight = None
        else:
            self.weight = Parameter(ms.common.initializer.initializer(
                ms.common.initializer.Normal(INIT_STD), (self.vocab_local, config.hidden_size),
                to_ms_dtype(config.param_init_type)), name="weight")
            self.split_axes = {"weight": 0}
        self.matmul = ops.MatMul(transpose_b=True)
        self.copy_in = CopyToTensorParallel(self.layout.tp_group) if self.tp_size > 1 else None
        self.gather_out = (GatherFromTensorParallel(self.layout.tp_group, self.tp_size, self.tp_rank)
                           if self.tp_size > 1 else None)

    def construct(self, h, tied_weight=None, gather=False):
        weight = self.weight if tied_weight is None else tied_weight
        if self.copy_in is not None:
            h = self.copy_in(h)
        lead = h.shape[:-1]
        logits = self.matmul(h.reshape(-1, h.shape[-1]).astype(self.compute_dtype), weight.astype(self.compute_dtype))
        logits = logits.astype(ms.float32).reshape(lead + (self.vocab_local,))
        if gather and self.gather_out is not None:
            logits = self.gather_out(logits)
        return logits


def positions_and_bias(input_ids, attention_mask=None):
    """Position ids and the additive causal (+ padding) attention bias [B, 1, S, S] in float32.

    With a (left-)padding `attention_mask` [B, S] (1 = token), positions count real tokens only.
    """
    batch, seq = input_ids.shape
    causal = ops.tril(ops.ones((seq, seq), ms.float32))
    if attention_mask is None:
        position_ids = ops.broadcast_to(ops.arange(0, seq, dtype=ms.int32).reshape(1, seq), (batch, seq))
        allowed = causal.reshape(1, 1, seq, seq)
    else:
        mask = attention_mask.astype(ms.int32)
        position_ids = ops.maximum(ops.cumsum(mask, 1) - 1, 0).astype(ms.int32)
        allowed = causal.reshape(1, 1, seq, seq) * mask.astype(ms.float32).reshape(batch, 1, 1, seq)
    return position_ids, (1.0 - allowed) * MASK_VALUE


def packed_attention_bias(segment_ids):
    """The additive attention bias [B, 1, S, S] in float32 of packed rows (`segment_ids` [B, S]: 1, 2, .. for the
    samples of a row, 0 for padding): causal within each sample, nothing across samples or to padding."""
    batch, seq = segment_ids.shape
    causal = ops.tril(ops.ones((seq, seq), ms.float32)).reshape(1, 1, seq, seq)
    segments = segment_ids.astype(ms.int32)
    same = ops.equal(segments.reshape(batch, 1, seq, 1), segments.reshape(batch, 1, 1, seq)).astype(ms.float32)
    real = (segments > 0).astype(ms.float32).reshape(batch, 1, 1, seq)
    return (1.0 - causal * same * real) * MASK_VALUE


def response_sequences(prompt_ids, prompt_mask, response_ids, response_mask):
    """Token ids, position ids and attention bias of prompts followed by their responses.

    `prompt_ids`/`prompt_mask` [Bg, P] (left-padded), `response_ids`/`response_mask` [Bg K, W] (right-padded):
    responses j K .. j K + K - 1 follow prompt j. With K = 1 each row is one [prompt | response] sequence with the
    causal bias of :func:`positions_and_bias`. With K > 1 each row is [prompt | K responses], [Bg, P + K W]: the
    prompt is read once for all of its responses (prefix sharing); each response's positions continue from its
    prompt's length, and the bias is the pair `Qwen2Attention` takes (the prompt's own causal bias [Bg, 1, P, P];
    for the response tokens [Bg, 1, K, 1, W, P + W]: the prompt's tokens, then causally their own response's).
    The outputs at real tokens equal those of the K separate sequences."""
    groups, prompt_width = prompt_ids.shape
    rows, width = response_ids.shape
    count = rows // groups
    prompt_mask = prompt_mask.astype(ms.int32)
    if width == 0:
        position_ids, attn_bias = positions_and_bias(prompt_ids, prompt_mask)
        return prompt_ids, position_ids, attn_bias
    if count == 1:
        ids = ops.concat((prompt_ids, response_ids), 1)
        position_ids, attn_bias = positions_and_bias(ids, ops.concat((prompt_mask, response_mask.astype(ms.int32)), 1))
        return ids, position_ids, attn_bias
    ids = ops.concat((prompt_ids, response_ids.reshape(groups, count * width)), 1)
    prompt_positions, prompt_bias = positions_and_bias(prompt_ids, prompt_mask)
    steps = ops.arange(0, width, dtype=ms.int32).reshape(1, 1, width)
    response_positions = prompt_mask.sum(1).reshape(groups, 1, 1) + steps  # [Bg, 1, W]
    response_positions = ops.broadcast_to(response_positions, (groups, count, width)).reshape(groups, count * width)
    causal = ops.tril(ops.ones((width, width), ms.float32)).reshape(1, 1, 1, 1, width, width)
    own = causal * response_mask.astype(ms.float32).reshape(groups, 1, count, 1, 1, width)
    prompt_keys = ops.broadcast_to(prompt_mask.astype(ms.float32).reshape(groups, 1, 1, 1, 1, prompt_width),
                                   (groups, 1, count, 1, width, prompt_width))
    response_bias = (1.0 - ops.concat((prompt_keys, own), -1)) * MASK_VALUE
    return ids, ops.concat((prompt_positions, response_positions), 1), (prompt_bias, response_bias)


def response_states(hidden, prompt_width: int, rows: int, next_token: bool = True):
    """Each response's positions [rows, R, D] from the output [Bg, P + K W, D] of
    :meth:`Qwen2Model.read_responses` over prompts of width `prompt_width` and `rows` = Bg K responses: with
    `next_token` the positions that predict response tokens 0 .. R - 1 (the prompt's last one, then the first
    W = R - 1 response tokens), else the response tokens' own W = R positions."""
    groups, length, dim = hidden.shape
    count = rows // groups
    width = (length - prompt_width) // count
    if count == 1:
        return hidden[:, prompt_width - 1:] if next_token else hidden[:, prompt_width:]
    if width == 0:
        last = hidden[:, prompt_width - 1:]
        return ops.broadcast_to(last.reshape(groups, 1, 1, dim), (groups, count, 1, dim)).reshape(rows, 1, dim)
    own = hidden[:, prompt_width:].reshape(rows, width, dim)
    if not next_token:
        return own
    last = hidden[:, prompt_width - 1:prompt_width].reshape(groups, 1, 1, dim)
    last = ops.broadcast_to(last, (groups, count, 1, dim)).reshape(rows, 1, dim)
    return ops.concat((last, own), 1)


class Qwen2ForCausalLM(nn.Cell):
    """Qwen2 causal LM. `model(input_ids[, attention_mask])` -> logits [B, S, vocab] (float32).

    `layout` places the net on the job's ranks (default: one device). Also offers `log_probs`
    (per-token log-probabilities of given labels, never gathering the vocabulary across tp).
    """

    def __init__(self, config: Qwen2Config, layout: Layout | None = None):
        super().__init__()
        self.config = config
        self.layout = layout or Layout()
        self.tie_word_embeddings = config.tie_word_embeddings
        self.model = Qwen2Model(config, self.layout)
        last = self.model.last_stage
        self.lm_head = VocabParallelHead(config, self.layout) if last else None
        self.log_prob_of_labels = VocabParallelLogProbs(config.vocab_size, self.layout) if last else None
        if config.lora.enabled:
            freeze_all_but_adapters(self)

    @property
    def stage_shared_params(self) -> tuple[str, ...]:
        """Names of the parameters that both the first and the last pipeline stage hold (the tied embedding):
        their gradients are summed over those two stages, so the copies stay equal (none on a stage between)."""
        if self.layout.pp > 1 and self.tie_word_embeddings and self.model.tok_embeddings is not None:
            return (self.model.tok_embeddings.embedding_weight.name,)
        return ()

    def logits(self, hidden, gather=True):
        """lm_head on hidden states [.., D]: float32 logits over the whole vocabulary (`gather`) or over
        this rank's vocabulary shard. Call inside a Cell's construct."""
        tied = self.model.tok_embeddings.embedding_weight if self.tie_word_embeddings else None
        return self.lm_head(hidden, tied, gather)

    def construct(self, input_ids, attention_mask=None):
        position_ids, attn_bias = positions_and_bias(input_ids, attention_mask)
        return self.logits(self.model(input_ids, position_ids, attn_bias))

    def log_probs(self, input_ids, labels, attention_mask=None, temperature=1.0, with_entropy=False):
        """log softmax(logits / temperature)[labels] in float32 [B, S]: position s scores labels[b, s] given
        input_ids[b, :s+1]. With `with_entropy` returns `(log_probs, entropy)`, the entropy of that distribution per
        position (no gradient). Call inside a Cell's construct."""
        position_ids, attn_bias = positions_and_bias(input_ids, attention_mask)
        hidden = self.model(input_ids, position_ids, attn_bias)
        return self.label_log_probs(hidden, labels, temperature, with_entropy)

    def response_log_probs(self, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0,
                           with_entropy=False, hidden_in=None):
        """log p(response token t | prompt, response[:t]) [Bg K, R] (and the entropy per position with
        `with_entropy`) of K = response rows / prompt rows responses of each prompt, the prompt read once for all of
        them (:func:`response_sequences`). Only the response positions reach the head, so the [tokens, vocab]
        logits (and their gradient) exist for the scored positions only (TRL's `logits_to_keep`). Use the sampling
        temperature, so that the policy whose log-probs are trained is the one the samples came from. On the last of
        several pipeline stages the layers start from `hidden_in`, the previous stage's output. Call inside a Cell's
        construct."""
        hidden = self.model.read_responses(prompt_ids, prompt_mask, response_ids, response_mask, True, hidden_in)
        states = response_states(hidden, prompt_ids.shape[1], response_ids.shape[0])
        return self.label_log_probs(states, response_ids, temperature, with_entropy)

    def packed_log_probs(self, input_ids, position_ids, segment_ids, temperature=1.0):
        """log p(token t | the tokens of its sample before it) [B, S] of packed rows (several samples a row, their
        positions restarting at 0: `packed_attention_bias`); position 0 is 0, and a sample's first position scores
        it after the previous sample (mask it). Call inside a Cell's construct."""
        hidden = self.model(input_ids, position_ids, packed_attention_bias(segment_ids))
        logp = self.label_log_probs(hidden[:, :-1], input_ids[:, 1:], temperature)
        return ops.concat((ops.zeros((input_ids.shape[0], 1), ms.float32), logp), 1)

    def label_log_probs(self, hidden, labels, temperature=1.0, with_entropy=False):
        """The head on final hidden states [B, S, D] and log softmax(logits / temperature) at `labels` [B, S]."""
        local_logits = scaled_by_temperature(self.logits(hidden, gather=False), temperature)
        return self.log_prob_of_labels(local_logits, labels, with_entropy)


class Qwen2ForValue(nn.Cell):
    """Qwen2 backbone + a scalar head (`score.weight` [1, hidden], no bias: HF's `*ForSequenceClassification`
    head with one label, OpenRLHF's value head; with `value_head_bias` also `score.bias` [1], HF's
    `*ForTokenClassification`, verl's critic): the PPO critic, or a reward model scoring at the last token.

    The backbone's parameter names are the causal LM's, so a policy checkpoint's backbone loads as is. The head
    reads the final norm's output, which every tensor-parallel rank holds whole: it is replicated (like the
    norms), its gradient needs no collective. In pipeline stages the head is on the last stage.
    """

    stage_shared_params = ()  # the head is not tied to the embedding: no parameter on two stages

    def __init__(self, config: Qwen2Config, layout: Layout | None = None):
        super().__init__()
        self.config = config
        self.layout = layout or Layout()
        self.model = Qwen2Model(config, self.layout)
        self.score = nn.Dense(config.hidden_size, 1, has_bias=config.value_head_bias, weight_init="zeros",
                              bias_init="zeros", dtype=to_ms_dtype(config.param_init_type)) \
            if self.model.last_stage else None
        self.head_bias = config.value_head_bias
        self.compute_dtype = to_ms_dtype(config.compute_dtype)
        if config.lora.enabled:  # the adapters and the head train (the head is PEFT's modules_to_save of SEQ_CLS)
            freeze_all_but_adapters(self)
            for param in self.score.get_parameters() if self.score is not None else ():
                param.requires_grad = True

    def values(self, input_ids, attention_mask=None):
        """The head's output at every position, float32 [B, S]: the value of the state after reading token s. Call
        inside a Cell's construct."""
        position_ids, attn_bias = positions_and_bias(input_ids, attention_mask)
        return self.head(self.model(input_ids, position_ids, attn_bias))

    def response_values(self, prompt_ids, prompt_mask, response_ids, response_mask, next_token=True,
                        hidden_in=None):
        """The head's output [Bg K, R] for K = response rows / prompt rows responses of each prompt, the prompt
        read once for all of them: with `next_token` at the positions before each response token (the critic's
        values), else at the response tokens themselves (a reward model's). Call inside a Cell's construct."""
        hidden = self.model.read_responses(prompt_ids, prompt_mask, response_ids, response_mask, next_token,
                                           hidden_in)
        return self.head(response_states(hidden, prompt_ids.shape[1], response_ids.shape[0], next_token))

    def head(self, hidden):
        """The scalar head on final hidden states [B, S, D]: float32 [B, S]."""
        weight = self.score.weight.astype(self.compute_dtype)
        values = ops.matmul(hidden.astype(self.compute_dtype), weight.T).astype(ms.float32)[..., 0]
        if self.head_bias:
            values = values + self.score.bias.astype(ms.float32)
        return values

    def construct(self, input_ids, attention_mask=None):
        return self.values(input_ids, attention_mask)


class _CachedCell(nn.Cell):
    """A graph over `model` that reads and writes the KV cache Parameters (names unchanged) of `shape`
    (batch, kv_heads, length, head_dim), each stored as its rows [batch x kv_heads x length, head_dim]."""

    def __init__(self, model: Qwen2ForCausalLM, key_caches, value_caches, shape: tuple[int, int, int, int]):
        super().__init__(auto_prefix=False)
        self.model = model
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.cache_length = shape[2]


class _PrefillCell(_CachedCell):
    def construct(self, input_ids, attention_mask, source, written):
        position_ids, attn_bias = positions_and_bias(input_ids, attention_mask)
        h = self.model.model(input_ids, position_ids, attn_bias, self.key_caches, self.value_caches,
                             prefill_rows=(source, written))
        return self.model.logits(h[:, -1, :])


class _DecodeCell(_CachedCell):
    def __init__(self, model: Qwen2ForCausalLM, key_caches, value_caches, shape: tuple[int, int, int, int]):
        super().__init__(model, key_caches, value_caches, shape)
        batch, kv_heads, length, _ = shape
        # [B, kv_heads]: the row of position 0 of sample b, head h
        self.first_rows = Tensor((np.arange(batch * kv_heads, dtype=np.int32) * length).reshape(batch, kv_heads))

    def construct(self, token_ids, position_ids, slots, valid_slots):
        batch = token_ids.shape[0]
        slot_index = self.first_rows + slots.reshape(batch, 1)
        attn_bias = ((1.0 - valid_slots.astype(ms.float32)) * MASK_VALUE).reshape(batch, 1, 1, self.cache_length)
        h = self.model.model(token_ids, position_ids, attn_bias, self.key_caches, self.value_caches, slot_index)
        # one position per row: a reshape (a strided slice of [B, 1, D] costs as much as a small matmul here)
        return self.model.logits(h.reshape(batch, h.shape[-1]))


class _ExtendCell(_CachedCell):
    """Appends up to W tokens a row to the cache (a tool's answer after a turn): row b's tokens sit in a window of W
    slots from `window_start[b]`, the columns `written[b]` marks (1) are new and go into the cache, the others keep
    the slots' contents; each column attends causally to the slots `valid_slots` [B, L] marks (the new ones
    included). Returns the logits at column `last[b]` of each row [B, vocab]."""

    def __init__(self, model: Qwen2ForCausalLM, key_caches, value_caches, shape: tuple[int, int, int, int]):
        super().__init__(model, key_caches, value_caches, shape)
        batch, kv_heads, length, _ = shape
        self.first_rows = Tensor((np.arange(batch * kv_heads, dtype=np.int32) * length).reshape(batch, kv_heads, 1))
        self.key_slots = Tensor(np.arange(length, dtype=np.int32).reshape(1, 1, length))

    def construct(self, token_ids, position_ids, window_start, written, valid_slots, last):
        batch, width = token_ids.shape
        slots = window_start.reshape(batch, 1) + ops.arange(0, width, dtype=ms.int32).reshape(1, width)  # [B, W]
        rows = self.first_rows + slots.reshape(batch, 1, width)
        allowed = (self.key_slots <= slots.reshape(batch, width, 1)).astype(ms.float32) * \
            valid_slots.astype(ms.float32).reshape(batch, 1, self.cache_length)
        attn_bias = ((1.0 - allowed) * MASK_VALUE).reshape(batch, 1, width, self.cache_length)
        extension = (rows, written.reshape(batch, 1, width, 1))
        h = self.model.model(token_ids, position_ids, attn_bias, self.key_caches, self.value_caches, extension)
        picked = ops.arange(0, batch, dtype=ms.int32) * width + last
        return self.model.logits(ops.gather(h.reshape(batch * width, h.shape[-1]), picked, 0))


class KVCache:
    """Static key/value cache for `batch_size` sequences of up to `length` positions, with two graphs.

    `prefill(input_ids, attention_mask, source, written)` runs (left-padded) prompts [B', S], fills slots [0, S) of
    the cache rows b with `written[b]` (float32 [B], 1 or 0) from prompt `source[b]` (int32 [B]; a prompt is read once
    for all of its samples' rows, and prompts may come a few at a time) and returns each prompt's last-position
    logits [B', vocab]; `decode(token_ids, position_ids, slots, valid_slots)` runs one
    new token per sequence, writes row b's at cache position `slots[b]` (int32 [B]: rows may be at different points
    of their responses) and attends to the positions where `valid_slots` [B, L] is 1; `extend(token_ids, position_ids,
    window_start, written, valid_slots, last)` appends several tokens a row ([B, W], bucketed widths: `_ExtendCell`).
    Each graph compiles once per input shape. The cache Parameters are not part of the model's
    checkpoint (they live here, named `kv_cache.<batch size>.*`).
    """

    def __init__(self, model: Qwen2ForCausalLM, batch_size: int, length: int | None = None):
        config = model.config
        self.length = length or config.seq_length
        # the class's own bound, for any caller (a Generator's config was checked against seq_length already,
        # GenerationConfig.check_cache_length): positions past seq_length have no rows in the rotary tables
        if self.length > config.seq_length:
            raise ValueError(f"KV cache length {self.length} exceeds model_config.seq_length={config.seq_length}")
        self.batch_size = batch_size
        kv_local = config.n_kv_heads // kv_head_shards(config.n_kv_heads, model.layout.tp)
        self.shape = (batch_size, kv_local, self.length, config.get_head_dim())
        # stored as rows of head_dim values, one a (sample, head, position): a decode step writes its rows in place
        rows = (batch_size * kv_local * self.length, self.shape[3])
        dtype = to_ms_dtype(config.compute_dtype)
        # named by batch size: a graph that moves rows between two caches holds both
        layer_caches = lambda part: ParameterTuple(
            [Parameter(Tensor(np.zeros(rows, np.float32), dtype), name=f"kv_cache.{batch_size}.{part}.{i}",
                       requires_grad=False) for i in range(config.num_layers)])
        self.key_caches, self.value_caches = layer_caches("key"), layer_caches("value")
        self.prefill = _PrefillCell(model, self.key_caches, self.value_caches, self.shape)
        self.decode = _DecodeCell(model, self.key_caches, self.value_caches, self.shape)
        self.extend = _ExtendCell(model, self.key_caches, self.value_caches, self.shape)
        self.moves: dict[int, _MoveRowsCell] = {}  # by the batch size of the cache they write

    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.key_caches) * 2

    def parameters(self) -> list[Parameter]:
        """The cache's buffers (every layer's keys, then values), e.g. for a swap group."""
        return list(self.key_caches) + list(self.value_caches)

    def rows_of(self, first_prompt: int, prompts: int, samples: int = 1) -> tuple[Tensor, Tensor]:
        """`prefill`'s (source, written) for prompts `first_prompt` .. `first_prompt + prompts - 1` of a batch whose
        prompt j fills cache rows j samples .. j samples + samples - 1 (every row: first_prompt 0 and as many prompts
        as the batch has)."""
        if (first_prompt + prompts) * samples > self.batch_size:
            raise ValueError(f"prompts {first_prompt}..{first_prompt + prompts - 1} x {samples} samples do not fit "
                             f"the cache's {self.batch_size} rows")
        source = np.zeros(self.batch_size, np.int32)
        written = np.zeros(self.batch_size, np.float32)
        rows = slice(first_prompt * samples, (first_prompt + prompts) * samples)
        source[rows] = np.arange(prompts * samples) // samples
        written[rows] = 1.0
        return Tensor(source), Tensor(written)

    def move_rows(self, target: KVCache, source: np.ndarray) -> None:
        """Copies this cache's sample rows `source` (int [target.batch_size]) into `target`'s rows 0, 1, ..., every
        layer's keys and values (a graph compiled once per pair of batch sizes): a rollout's tail moves its running
        samples into a smaller cache."""
        if target.length != self.length or target.shape[1:] != self.shape[1:]:
            raise ValueError(f"cannot move KV rows from a cache of shape {self.shape} to one of {target.shape}")
        if target.batch_size not in self.moves:
            self.moves[target.batch_size] = _MoveRowsCell(self, target)
        self.moves[target.batch_size](Tensor(np.asarray(source, np.int32)))


class _MoveRowsCell(nn.Cell):
    """target's cache rows [b] = source's cache rows [index[b]], for every layer (`KVCache.move_rows`)."""

    def __init__(self, source: KVCache, target: KVCache):
        super().__init__(auto_prefix=False)
        self.source_keys, self.source_values = source.key_caches, source.value_caches
        self.target_keys, self.target_values = target.key_caches, target.value_caches
        self.sample_shape = (source.batch_size, -1)  # one sample's rows (all heads and positions) a row
        self.target_rows = target.key_caches[0].shape
        self.layers = len(source.key_caches)

    def construct(self, index):
        for layer in range(self.layers):
            keys = ops.gather(self.source_keys[layer].reshape(self.sample_shape), index, 0)
            ops.assign(self.target_keys[layer], keys.reshape(self.target_rows))
            values = ops.gather(self.source_values[layer].reshape(self.sample_shape), index, 0)
            ops.assign(self.target_values[layer], values.reshape(self.target_rows))
        return index
