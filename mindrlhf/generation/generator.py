"""`Generator`: batched sampling of `num_generations` responses per prompt with the static KV cache.

The network runs in graphs with static shapes: prompts are left-padded to a bucket, so the prefill graph
compiles once per (batch size, bucket) and the decode graph once per batch size (the cache length is fixed
by the config). Token selection (temperature, top-k, top-p, the draw) runs on the device too, in a small graph
called on the logits each step leaves there (:class:`~mindrlhf.generation.selection.TokenSelection`, whose rule is
the numpy reference of :mod:`mindrlhf.generation.sampling`): the host receives a token and its log-prob a row, and
draws the uniforms from its seeded stream.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from mindspore import Tensor, nn, ops
from tqdm import tqdm

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.data.reader import pad_rows
from mindrlhf.generation.decoding import CachedRollout, FixedBatch, GraphCalls
from mindrlhf.generation.selection import TokenSelection, float32_uniforms
from mindrlhf.generation.stopping import StopStrings
from mindrlhf.generation.trajectories import ToolTurnHandler
from mindrlhf.models.qwen2.modeling import KVCache, Qwen2ForCausalLM, positions_and_bias

logger = logging.getLogger(__name__)

GRAPHS = ("prefill", "decode", "extend", "forward", "move")


@dataclass
class GenerationOutput:
    """Rollout of B = num_prompts * num_generations rows; sample i of prompt j is row j * num_generations + i.

    Masks are int32 (1 = token). `response_mask` is 1 up to and including the first EOS (the last turn's, with
    tools); after it `response_ids` hold pad_token_id and `log_probs` 0.
    """

    prompt_ids: np.ndarray  # [B, P] int32, left-padded to the prompt bucket P
    prompt_mask: np.ndarray  # [B, P] int32
    response_ids: np.ndarray  # [B, response_width] int32 (max_new_tokens without tools)
    response_mask: np.ndarray  # [B, response_width] int32
    response_lengths: np.ndarray  # [B] int32, tokens per response including the EOS
    log_probs: np.ndarray | None = None  # [B, response_width] float32, see Generator.generate
    # with tools (generation.max_tool_calling_iterations): the rows are response_width wide, tool_mask [B, width]
    # int32 marks the tool turns' tokens (their log_probs are 0) and tool_calls holds each sample's calls
    tool_mask: np.ndarray | None = None
    tool_calls: list[list[dict]] | None = None
    # the call's work: batch_size, rows, prompt_bucket, steps, seconds, response_tokens, computed_rows (the rows the
    # decode calls computed), idle_rows (those that made no token) and idle_row_share
    stats: dict = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    @property
    def model_mask(self) -> np.ndarray:
        """[B, response_width] int32: the tokens the model chose (`response_mask` without the tool turns)."""
        if self.tool_mask is None:
            return self.response_mask
        return (self.response_mask * (1 - self.tool_mask)).astype(np.int32)

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """[prompt | response] ids and attention mask, [B, P + response_width] int32 (for the log-prob passes)."""
        ids = np.concatenate([self.prompt_ids, self.response_ids], axis=1)
        mask = np.concatenate([self.prompt_mask, self.response_mask], axis=1)
        return ids, mask


class _LastLogitsCell(nn.Cell):
    """Full forward over a padded buffer [B, W]; returns the logits [B, V] at column `index` (int32 scalar)."""

    def __init__(self, model: Qwen2ForCausalLM):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, attention_mask, index):
        position_ids, attn_bias = positions_and_bias(input_ids, attention_mask)
        h = self.model.model(input_ids, position_ids, attn_bias)
        h = ops.gather(h, index.reshape(1), 1)
        return self.model.logits(h[:, 0, :])


class CompiledGraphs:
    """What a Generator compiles for `model`, kept apart so that generators of one model can share it: the KV caches
    by (batch size, cache length) with their prefill and decode cells, the uncached forward cell, the token selection
    cells by their settings, the input-shape signatures sent to each graph and the time of each one's first call."""

    def __init__(self, model: Qwen2ForCausalLM):
        self.model = model
        self.caches: dict[tuple[int, int], KVCache] = {}
        self.forward_cell: _LastLogitsCell | None = None
        self.selections: dict[tuple, TokenSelection] = {}
        self.signatures: dict[str, set[tuple]] = {name: set() for name in GRAPHS}
        self.first_call_seconds: dict[tuple, float] = {}
        self._cache_watchers: list[Callable[[KVCache], None]] = []

    def watch_caches(self, callback: Callable[[KVCache], None]) -> None:
        """Calls `callback` with every KV cache, those made so far and each one made later (e.g. to put them in a
        swap group)."""
        self._cache_watchers.append(callback)
        for cache in self.caches.values():
            callback(cache)

    def add_cache(self, key: tuple[int, int], cache: KVCache) -> None:
        """Keeps `cache` for (batch size, cache length) `key` and tells the watchers."""
        self.caches[key] = cache
        for callback in self._cache_watchers:
            callback(cache)


class Generator:
    """Samples responses from `model` according to a `GenerationConfig`.

    KV caches are allocated once per (batch size, cache length) and reused across calls;
    `config` (a frozen, validated `GenerationConfig`, kept as it is) may be replaced between calls (it is checked
    against the model, `GenerationConfig.check_model`, and the random stream restarts from its seed);
    the compiled graphs are reused as long as batch size, bucket and cache length are unchanged.

    Compilation accounting (`compile_counts`): the Generator counts the distinct (graph, input shapes)
    signatures it has sent to each graph cell, and times the first call of each (compile + one run) in
    `first_call_seconds`. `graph_compile_counts` reads MindSpore's own record, each Cell's `compile_cache`
    (the set of phases MindSpore compiled for that cell instance); in GRAPH_MODE the two agree unless
    MindSpore recompiles for a reason other than shapes. In PyNative mode nothing is compiled and the
    second count is 0. The token selection graph run on each graph's logits (small, one per sampling setting and
    row count) is not counted; its compilation is part of the first call's time.

    `graphs`: the KV caches and compiled graphs of another Generator of the same model (its `graphs`), which this
    one uses too, as the held-out evaluation does the rollout's: a compiled graph keeps memory per layer while it
    lives, so a second set of graphs of the same shapes would cost as much as the first. Shapes one of them compiled are
    not compiled (nor counted) again; the two must not generate at the same time.

    Prefill reads each prompt once for all of its `num_generations` samples. `prefill_prompts` (0 = all) prefills
    that many prompts a call: the evaluation (one sample a prompt, as many prompts as the rollout has rows) passes
    the rollout's prompts per call, so that both run one compiled prefill graph.

    The decoding strategies (fixed batch, continuous batching) are :mod:`mindrlhf.generation.decoding`'s; the
    Generator runs, counts and times their graph calls and draws their uniforms.
    """

    def __init__(self, model: Qwen2ForCausalLM, config: GenerationConfig, graphs: CompiledGraphs | None = None,
                 prefill_prompts: int = 0, detokenize: Callable[[Sequence[int]], str] | None = None,
                 tools: ToolTurnHandler | None = None):
        if graphs is not None and graphs.model is not model:
            raise ValueError("graphs: the compiled graphs of another model cannot be shared")
        self.model = model
        self.tools = tools
        self.detokenize = detokenize
        self.prefill_prompts = prefill_prompts
        self._graphs = CompiledGraphs(model) if graphs is None else graphs
        self.config = config

    # ------------------------------------------------------------ config / RNG
    @property
    def config(self) -> GenerationConfig:
        return self._config

    @config.setter
    def config(self, config: GenerationConfig) -> None:
        # a GenerationConfig is frozen and validated as it is made: kept by reference, only checked against the model
        config.check_model(self.model.config.vocab_size, self.model.config.seq_length)
        if config.max_tool_calling_iterations and self.tools is None:
            raise ConfigError("generation.max_tool_calling_iterations: the generator needs the tools' turns "
                              "(tools) to call them")
        self._config = config
        if config.stop_strings and self.detokenize is None:
            raise ConfigError("generation.stop_strings: the generator needs the tokenizer's text of the responses "
                              "(detokenize) to find them")
        self._stop = StopStrings(config.stop_strings, self.detokenize) if config.stop_strings else None
        self.reseed()

    def reseed(self, seed: int | Sequence[int] | None = None) -> None:
        """Restarts the sampling stream from `seed` (default: config.seed; a sequence such as [seed, dp rank] gives
        each rank a stream of its own)."""
        self._rng = np.random.default_rng(self._config.seed if seed is None else seed)

    def rng_state(self) -> dict:
        """The sampling stream's position (JSON-able), for a checkpoint."""
        return self._rng.bit_generator.state

    def load_rng_state(self, state: dict) -> None:
        """Puts the sampling stream back where `rng_state` was taken."""
        self._rng.bit_generator.state = state

    @property
    def graphs(self) -> CompiledGraphs:
        """The caches and compiled graphs, for another Generator of the same model to share."""
        return self._graphs

    # --------------------------------------------------------------- counters
    @property
    def first_call_seconds(self) -> dict[tuple, float]:
        """(graph, key, input shapes) signature -> seconds of its first call (compile + one run)."""
        return self._graphs.first_call_seconds

    def compile_counts(self) -> dict[str, int]:
        """Distinct (graph, input shapes) signatures sent so far: what had to be compiled, per graph."""
        return {name: len(sigs) for name, sigs in self._graphs.signatures.items()}

    def graph_compile_counts(self) -> dict[str, int]:
        """Graphs MindSpore compiled for this Generator's live cells (each Cell's `compile_cache`), per graph."""
        counts = {name: 0 for name in GRAPHS}
        for cache in self._graphs.caches.values():
            counts["prefill"] += len(getattr(cache.prefill, "compile_cache", ()) or ())
            counts["decode"] += len(getattr(cache.decode, "compile_cache", ()) or ())
            counts["extend"] += len(getattr(cache.extend, "compile_cache", ()) or ())
            counts["move"] += sum(len(getattr(cell, "compile_cache", ()) or ()) for cell in cache.moves.values())
        if self._graphs.forward_cell is not None:
            counts["forward"] += len(getattr(self._graphs.forward_cell, "compile_cache", ()) or ())
        return counts

    # ------------------------------------------------------------- generation
    def generate(self, prompt_ids: Sequence[Sequence[int]] | np.ndarray, attention_mask: np.ndarray | None = None,
                 return_log_probs: bool = False, progress: bool = False,
                 min_prompt_width: int = 0) -> GenerationOutput:
        """Samples `config.num_generations` responses for each prompt (token selection on the device, see the
        module's docstring).

        `prompt_ids` is a list of token-id lists, or a 2-D array whose real tokens are where
        `attention_mask` is 1 (any padding side; without a mask every entry is a token).

        `log_probs` (if asked) convention: log softmax(logits / T) at the chosen token, with T =
        config.temperature when sampling and 1 when greedy, before top-k/top-p filtering. This is the
        convention of TRL and verl, whose trainers divide the policy's logits by the same temperature when
        they recompute log-probs, so the importance ratio of the first update is exactly 1; a trainer that
        does not must sample with temperature 1. Top-k/top-p truncation is not reflected in the log-probs.

        Sampling draws B uniforms from the Generator's stream per step: the stream advances across calls
        (call `reseed` or assign `config` to restart it). `progress` shows a bar over the decode steps when
        stderr is a terminal (never in msrun log files). `min_prompt_width` makes the prompt bucket at least
        that wide: data-parallel ranks pass the width of the global batch so that all produce the same shapes.
        """
        cfg = self.config
        rows = prompt_rows(prompt_ids, attention_mask, self.model.config.vocab_size)
        n = cfg.num_generations
        lengths = np.repeat(np.array([len(r) for r in rows], np.int64), n)
        bucket = cfg.bucket_for(max(int(lengths.max()), min_prompt_width))
        batch = len(rows) * n
        prompts, prompts_mask = pad_rows(rows, bucket, cfg.pad_token_id)
        ids, mask = np.repeat(prompts, n, 0), np.repeat(prompts_mask, n, 0)

        start = time.perf_counter()
        bar = tqdm(total=cfg.max_new_tokens, desc="generate", unit="tok", leave=False,
                   disable=not (progress and sys.stderr.isatty()))
        calls = GraphCalls(run=self._run, uniforms=self._uniforms, cache=self.cache, move=self._move_rows)
        tools = self.tools if cfg.max_tool_calling_iterations else None
        context = (cfg, calls, self._stop, return_log_probs, bar, tools)
        with bar:
            if not cfg.use_kv_cache:
                decoded = FixedBatch(*context).uncached(ids, mask, self._forward_cell())
            else:
                slots = cfg.max_num_seqs if cfg.decode_rows(batch) < batch else 0
                decoded = CachedRollout(*context).run(prompts, prompts_mask, lengths, slots, self.prefill_prompts)
        traj, steps, computed, made = decoded
        elapsed = time.perf_counter() - start
        tokens = int(traj.produced.sum())
        idle = computed - made  # the rows the decode calls computed that made no token
        stats = {"batch_size": batch, "rows": cfg.decode_rows(batch) if cfg.use_kv_cache else batch,
                 "prompt_bucket": bucket, "steps": steps, "seconds": elapsed, "response_tokens": tokens,
                 "computed_rows": computed, "idle_rows": idle, "idle_row_share": idle / computed if computed else 0.0}
        if tools is not None:
            stats.update(tool_turns=int(traj.tool_turns.sum()), tool_seconds=traj.tool_seconds,
                         tool_tokens=int(traj.tool_mask.sum()))
        logger.debug("generated %s", stats)
        return GenerationOutput(prompt_ids=ids, prompt_mask=mask, response_ids=traj.response, response_mask=traj.mask,
                                response_lengths=traj.mask.sum(axis=1).astype(np.int32),
                                log_probs=traj.log_probs if return_log_probs else None, stats=stats,
                                tool_mask=traj.tool_mask if tools is not None else None,
                                tool_calls=traj.calls if tools is not None else None)

    def _run(self, graph: str, key: tuple, cell: nn.Cell, *args: Tensor, uniforms: np.ndarray,
             with_log_probs: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Calls a graph cell and the token selection on the logits it returns, which stay on the device: the tokens
        [B] and (if asked) their log-probs [B] for `uniforms` [B] (B a multiple of the logits' rows: after prefill a
        prompt's row serves its samples). Records the graph's input-shape signature and the time of its first call
        (compile + one run, the selection's included)."""
        signature = (graph, *key, *(tuple(a.shape) for a in args))
        first = signature not in self._graphs.signatures[graph]
        start = time.perf_counter()
        logits = cell(*args)
        if logits.shape[0] != len(uniforms):
            # one op outside the graphs, so that prefill and decode share the selection graph of B rows
            logits = ops.repeat_interleave(logits, len(uniforms) // logits.shape[0], 0)
        tokens, log_probs = self._selection(with_log_probs)(logits, Tensor(uniforms))
        tokens, log_probs = tokens.asnumpy(), None if log_probs is None else log_probs.asnumpy()
        if first:
            self._record_first_call(signature, start, f"input shapes {signature[len(key) + 1:]}")
        return tokens, log_probs

    def _record_first_call(self, signature: tuple, start: float, what: str) -> None:
        """Counts the (graph, ...) `signature` as compiled and keeps the seconds of its first call, begun at `start`."""
        self._graphs.signatures[signature[0]].add(signature)
        self.first_call_seconds[signature] = time.perf_counter() - start
        logger.info("compiled %s for %s in %.2f s", signature[0], what, self.first_call_seconds[signature])

    def _selection(self, with_log_probs: bool) -> TokenSelection:
        """The token selection cell of the config's sampling settings (built on first use, shared like the caches)."""
        cfg = self.config
        settings = (1.0, 0, 1.0, 0.0) if cfg.greedy else (cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
        key = (cfg.greedy, *settings, with_log_probs)
        if key not in self._graphs.selections:
            temperature, top_k, top_p, min_p = settings
            self._graphs.selections[key] = TokenSelection(self.model.config.vocab_size, temperature, top_k, top_p,
                                                          cfg.greedy, with_log_probs, min_p)
        return self._graphs.selections[key]

    def _uniforms(self, rows: int) -> np.ndarray:
        """The next `rows` uniforms of the sampling stream, one a row (greedy draws none: zeros)."""
        if self.config.greedy:
            return np.zeros(rows, np.float32)
        return float32_uniforms(self._rng.random(rows))

    def _move_rows(self, cache: KVCache, small: KVCache, rows: np.ndarray) -> None:
        """Moves `rows` of `cache` into rows 0, 1, ... of `small`, counting and timing the move's first call."""
        signature = ("move", cache.batch_size, small.batch_size, cache.length)
        first = signature not in self._graphs.signatures["move"]
        start = time.perf_counter()
        cache.move_rows(small, rows)
        if first:
            self._record_first_call(signature, start, f"KV rows {cache.batch_size} -> {small.batch_size}")

    def _forward_cell(self) -> _LastLogitsCell:
        """The uncached path's full-forward cell (built on first use, shared like the caches)."""
        if self._graphs.forward_cell is None:
            self._graphs.forward_cell = _LastLogitsCell(self.model)
        return self._graphs.forward_cell

    def cache(self, batch: int) -> KVCache:
        """The KV cache (with its prefill and decode cells, compiled on first use) for `batch` rows, allocated the
        first time a batch of that size comes."""
        key = (batch, self.config.cache_length)
        caches = self._graphs.caches
        if key not in caches:
            self._graphs.add_cache(key, KVCache(self.model, batch, self.config.cache_length))
            logger.info("allocated KV cache batch=%d length=%d (%.1f MB)", batch, key[1], caches[key].nbytes() / 2**20)
        return caches[key]


def prompt_rows(prompt_ids, attention_mask, vocab: int) -> list[np.ndarray]:
    """The prompts' token ids, a row each (int32), checked against the vocabulary size `vocab`."""
    if isinstance(prompt_ids, np.ndarray) or attention_mask is not None:
        ids = np.asarray(prompt_ids)
        if ids.ndim != 2:
            raise ValueError(f"prompt_ids array must be 2-D [num_prompts, length], got shape {ids.shape}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) != 0
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} differs from prompt_ids shape {ids.shape}")
        rows = [ids[i][mask[i]] for i in range(ids.shape[0])]
    else:
        rows = [np.asarray(p) for p in prompt_ids]
    if not rows:
        raise ValueError("no prompts given")
    for i, row in enumerate(rows):
        if row.ndim != 1 or row.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got shape {row.shape}")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompt {i}: token ids must be integers, got dtype {row.dtype}")
        if row.min() < 0 or row.max() >= vocab:
            raise ValueError(f"prompt {i}: token ids must be in [0, {vocab}), got range "
                             f"[{row.min()}, {row.max()}]")
    return [r.astype(np.int32) for r in rows]
