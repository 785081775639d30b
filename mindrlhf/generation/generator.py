"""`Generator`: batched sampling of `num_generations` responses per prompt with the static KV cache.

The network runs in graphs with static shapes: prompts are left-padded to a bucket, so the prefill graph
compiles once per (batch size, bucket) and the decode graph once per batch size (the cache length is fixed
by the config). Token selection (temperature, top-k, top-p, the draw) runs on the device too, in a small graph
called on the logits each step leaves there (:class:`~mindrlhf.generation.selection.TokenSelection`, whose rule is
the numpy reference of :mod:`mindrlhf.generation.sampling`): the host receives a token and its log-prob a row, and
draws the uniforms from its seeded stream.
"""
from __future__ import annotations

import collections
import copy
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from tqdm import tqdm

from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.data.reader import pad_rows
from mindrlhf.generation.selection import TokenSelection, float32_uniforms
from mindrlhf.generation.stopping import StopStrings
from mindrlhf.models.qwen2.modeling import KVCache, Qwen2ForCausalLM, positions_and_bias

logger = logging.getLogger(__name__)

GRAPHS = ("prefill", "decode", "forward", "move")


@dataclass
class GenerationOutput:
    """Rollout of B = num_prompts * num_generations rows; sample i of prompt j is row j * num_generations + i.

    Masks are int32 (1 = token). `response_mask` is 1 up to and including the first EOS; after it
    `response_ids` hold pad_token_id and `log_probs` 0.
    """

    prompt_ids: np.ndarray  # [B, P] int32, left-padded to the prompt bucket P
    prompt_mask: np.ndarray  # [B, P] int32
    response_ids: np.ndarray  # [B, max_new_tokens] int32
    response_mask: np.ndarray  # [B, max_new_tokens] int32
    response_lengths: np.ndarray  # [B] int32, tokens per response including the EOS
    log_probs: np.ndarray | None = None  # [B, max_new_tokens] float32, see Generator.generate

    @property
    def batch_size(self) -> int:
        return self.response_ids.shape[0]

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """[prompt | response] ids and attention mask, [B, P + max_new_tokens] int32 (for the log-prob passes)."""
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


class _CompiledGraphs:
    """What a Generator compiles, kept apart so that generators of one model can share it: the KV caches by
    (batch size, cache length) with their prefill and decode cells, the uncached forward cell, the token selection
    cells by their settings, the input-shape signatures sent to each graph and the time of each one's first call."""

    def __init__(self):
        self.caches: dict[tuple[int, int], KVCache] = {}
        self.forward_cell: _LastLogitsCell | None = None
        self.selections: dict[tuple, TokenSelection] = {}
        self.signatures: dict[str, set[tuple]] = {name: set() for name in GRAPHS}
        self.first_call_seconds: dict[tuple, float] = {}


class Generator:
    """Samples responses from `model` according to a `GenerationConfig`.

    KV caches are allocated once per (batch size, cache length) and reused across calls;
    `config` may be replaced between calls (it is validated, and the random stream restarts from its seed);
    the compiled graphs are reused as long as batch size, bucket and cache length are unchanged.

    Compilation accounting (`compile_counts`): the Generator counts the distinct (graph, input shapes)
    signatures it has sent to each graph cell, and times the first call of each (compile + one run) in
    `first_call_seconds`. `graph_compile_counts` reads MindSpore's own record, each Cell's `compile_cache`
    (the set of phases MindSpore compiled for that cell instance); in GRAPH_MODE the two agree unless
    MindSpore recompiles for a reason other than shapes. In PyNative mode nothing is compiled and the
    second count is 0. The token selection graph run on each graph's logits (small, one per sampling setting and
    row count) is not counted; its compilation is part of the first call's time.

    `share_graphs_with`: another Generator of the same model whose KV caches and compiled graphs this one uses
    too, as the held-out evaluation does the rollout's: a compiled graph keeps memory per layer while it lives, so
    a second set of graphs of the same shapes would cost as much as the first. Shapes one of them compiled are
    not compiled (nor counted) again; the two must not generate at the same time.

    Prefill reads each prompt once for all of its `num_generations` samples. `prefill_prompts` (0 = all) prefills
    that many prompts a call: the evaluation (one sample a prompt, as many prompts as the rollout has rows) passes
    the rollout's prompts per call, so that both run one compiled prefill graph.
    """

    def __init__(self, model: Qwen2ForCausalLM, config: GenerationConfig, share_graphs_with: Generator | None = None,
                 prefill_prompts: int = 0, detokenize: Callable[[Sequence[int]], str] | None = None):
        if share_graphs_with is not None and share_graphs_with.model is not model:
            raise ValueError("share_graphs_with: a Generator of another model cannot share its graphs")
        self.model = model
        self.detokenize = detokenize
        self.prefill_prompts = prefill_prompts
        self._graphs = _CompiledGraphs() if share_graphs_with is None else share_graphs_with._graphs
        self.last_stats: dict = {}
        self.config = config

    # ------------------------------------------------------------ config / RNG
    @property
    def config(self) -> GenerationConfig:
        return self._config

    @config.setter
    def config(self, config: GenerationConfig) -> None:
        config.validate()
        config.check_model(self.model.config.vocab_size, self.model.config.seq_length)
        self._config = copy.deepcopy(config)  # later edits of the caller's object do not leak in
        if config.stop_strings and self.detokenize is None:
            raise ConfigError("generation.stop_strings: the generator needs the tokenizer's text of the responses "
                              "(detokenize) to find them")
        self._stop = StopStrings(config.stop_strings, self.detokenize) if config.stop_strings else None
        self.reseed()

    def reseed(self, seed: int | None = None) -> None:
        """Restarts the sampling stream from `seed` (default: config.seed)."""
        self.rng = np.random.default_rng(self._config.seed if seed is None else seed)

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
        rows = self._prompt_rows(prompt_ids, attention_mask)
        n = cfg.num_generations
        lengths = np.repeat(np.array([len(r) for r in rows], np.int64), n)
        bucket = cfg.bucket_for(max(int(lengths.max()), min_prompt_width))
        batch = len(rows) * n
        prompts, prompts_mask = pad_rows(rows, bucket, cfg.pad_token_id)
        ids, mask = np.repeat(prompts, n, 0), np.repeat(prompts_mask, n, 0)

        start = time.perf_counter()
        steps = cfg.max_new_tokens
        bar = tqdm(total=cfg.max_new_tokens, desc="generate", unit="tok", leave=False,
                   disable=not (progress and sys.stderr.isatty()))
        with bar:
            if cfg.use_kv_cache and cfg.decode_rows(batch) < batch:
                response, resp_mask, log_probs, steps, computed = self._run_slots(prompts, prompts_mask, lengths,
                                                                                  return_log_probs, bar)
            elif cfg.use_kv_cache:
                response, resp_mask, log_probs, steps, computed = self._run_cached(prompts, prompts_mask, lengths,
                                                                                   return_log_probs, bar)
            else:
                response, resp_mask, log_probs, steps = self._run_uncached(ids, mask, return_log_probs, bar)
                computed = batch * (steps - 1)
        elapsed = time.perf_counter() - start
        tokens = int(resp_mask.sum())
        # `computed`: the rows the decode calls computed; the first token of every sample came from a prefill call,
        # so the decode rows that made a token were tokens - batch, and the others were idle
        idle = computed - (tokens - batch)
        self.last_stats = {"batch_size": batch, "rows": cfg.decode_rows(batch) if cfg.use_kv_cache else batch,
                           "prompt_bucket": bucket, "steps": steps, "seconds": elapsed, "response_tokens": tokens,
                           "computed_rows": computed, "idle_rows": idle,
                           "idle_row_share": idle / computed if computed else 0.0}
        logger.debug("generated %s", self.last_stats)
        return GenerationOutput(prompt_ids=ids, prompt_mask=mask, response_ids=response, response_mask=resp_mask,
                                response_lengths=resp_mask.sum(axis=1).astype(np.int32),
                                log_probs=log_probs if return_log_probs else None)

    def _prompt_rows(self, prompt_ids, attention_mask) -> list[np.ndarray]:
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
        vocab = self.model.config.vocab_size
        for i, row in enumerate(rows):
            if row.ndim != 1 or row.size == 0:
                raise ValueError(f"prompt {i} must be a non-empty list of token ids, got shape {row.shape}")
            if not np.issubdtype(row.dtype, np.integer):
                raise ValueError(f"prompt {i}: token ids must be integers, got dtype {row.dtype}")
            if row.min() < 0 or row.max() >= vocab:
                raise ValueError(f"prompt {i}: token ids must be in [0, {vocab}), got range "
                                 f"[{row.min()}, {row.max()}]")
        return [r.astype(np.int32) for r in rows]

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
        return float32_uniforms(self.rng.random(rows))

    def _step(self, t, tokens, token_lp, finished, response, resp_mask, log_probs) -> np.ndarray:
        """Records step t's chosen tokens and log-probs; returns the tokens fed to the next step."""
        cfg = self.config
        alive = ~finished
        if log_probs is not None:
            log_probs[:, t] = np.where(alive, token_lp, 0.0)
        tokens = np.where(alive, tokens, cfg.pad_token_id).astype(np.int32)
        response[:, t] = tokens
        resp_mask[:, t] = alive
        running = np.flatnonzero(alive)
        finished[running] = self._ended(tokens[running], response, running, np.full(running.size, t))
        return tokens

    def _ended(self, tokens: np.ndarray, response: np.ndarray, samples: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Whether each of `samples` ended with its newest token `tokens` (at index `last` of its `response` row): an
        EOS, or the completion of a stop string."""
        ended = np.isin(tokens, self.config.eos_token_ids)
        if self._stop is not None:
            check = np.flatnonzero(~ended)
            ended[check] = self._stop.completed(response, samples[check], last[check])
        return ended

    def _buffers(self, batch: int, return_log_probs: bool):
        cfg = self.config
        response = np.full((batch, cfg.max_new_tokens), cfg.pad_token_id, np.int32)
        resp_mask = np.zeros((batch, cfg.max_new_tokens), np.int32)
        log_probs = np.zeros((batch, cfg.max_new_tokens), np.float32) if return_log_probs else None
        return response, resp_mask, log_probs, np.zeros(batch, bool)

    def cache(self, batch: int) -> KVCache:
        """The KV cache (with its prefill and decode cells, compiled on first use) for `batch` rows, allocated the
        first time a batch of that size comes."""
        key = (batch, self.config.cache_length)
        caches = self._graphs.caches
        if key not in caches:
            caches[key] = KVCache(self.model, batch, self.config.cache_length)
            logger.info("allocated KV cache batch=%d length=%d (%.1f MB)", batch, key[1], caches[key].nbytes() / 2**20)
        return caches[key]

    def _run_cached(self, prompts, prompts_mask, prompt_lengths, return_log_probs, bar):
        """Prefill reads each prompt once and fills the cache rows of its `num_generations` samples; each decode
        step runs every sample still running, in the smallest row count of `decode_row_counts` they fit
        (`_step_down`). Returns the buffers, the steps and the rows the decode calls computed."""
        cfg = self.config
        n = cfg.num_generations
        bucket = prompts.shape[1]
        batch = len(prompts) * n
        cache = self.cache(batch)
        response, resp_mask, log_probs, finished = self._buffers(batch, return_log_probs)
        valid = np.zeros((batch, cache.length), np.float32)
        valid[:, :bucket] = np.repeat(prompts_mask, n, 0)
        chosen = self._prefill(cache, (batch, cache.length), prompts, prompts_mask, n, return_log_probs)
        sample_of = np.arange(batch)  # the sample each cache row decodes, -1: none
        counts = cfg.decode_row_counts(batch)
        steps, computed = cfg.max_new_tokens, 0
        for t in range(cfg.max_new_tokens):
            tokens = self._step(t, *chosen, finished, response, resp_mask, log_probs)
            bar.update()
            if finished.all() or t == cfg.max_new_tokens - 1:
                steps = t + 1
                break
            slot = bucket + t
            valid[:, slot] = 1.0
            running = np.flatnonzero((sample_of >= 0) & ~finished[np.maximum(sample_of, 0)])
            cache, source = self._step_down(cache, counts, running)
            if source is not None:
                sample_of = np.where(source >= 0, sample_of[np.maximum(source, 0)], -1)
            rows = np.maximum(sample_of, 0)  # a row without a sample repeats sample 0's inputs, its output unused
            uniforms = self._uniforms(batch)[rows] * (sample_of >= 0)
            positions = (prompt_lengths[rows] + t).astype(np.int32)[:, None]
            decoded = self._run("decode", (cache.batch_size, cache.length), cache.decode, Tensor(tokens[rows][:, None]),
                                Tensor(positions), Tensor(np.full(cache.batch_size, slot, np.int32)),
                                Tensor(valid[rows]), uniforms=uniforms, with_log_probs=return_log_probs)
            computed += cache.batch_size
            chosen = _by_sample(decoded, sample_of, batch)
        return response, resp_mask, log_probs, steps, computed

    def _step_down(self, cache: KVCache, counts: list[int], running: np.ndarray) -> tuple[KVCache, np.ndarray | None]:
        """When the cache rows `running` fit a smaller row count of `counts` than `cache` has, moves them into rows
        0, 1, ... of the smallest such count's cache; returns that cache and, for each of its rows, the row of
        `cache` it came from (-1: none). Else `cache` and None."""
        target = min(c for c in counts if c >= running.size)
        if target >= cache.batch_size:
            return cache, None
        source = np.full(target, -1)
        source[:running.size] = running
        small = self.cache(target)
        signature = ("move", cache.batch_size, target, cache.length)
        first = signature not in self._graphs.signatures["move"]
        start = time.perf_counter()
        cache.move_rows(small, np.maximum(source, 0))
        if first:
            self._record_first_call(signature, start, f"KV rows {cache.batch_size} -> {target}")
        return small, source

    def _run_slots(self, prompts, prompts_mask, prompt_lengths, return_log_probs, bar):
        """Continuous batching over `max_num_seqs` slots (KV-cache rows): a slot whose response ended takes the next
        waiting sample (samples in order: prompt j's are j n .. j n + n - 1); a prompt is prefilled once into all
        the free slots its waiting samples take; then every occupied slot decodes one token a call, each at its own
        position. Once no sample waits, the running ones step down to fewer slots (`_step_down`). Returns the fixed
        batch's buffers, the number of decode calls and the rows they computed."""
        cfg = self.config
        bucket = prompts.shape[1]
        state = _Slots(self, cfg.max_num_seqs, len(prompts) * cfg.num_generations, return_log_probs)
        cache = self.cache(cfg.max_num_seqs)
        valid = np.zeros((cache.batch_size, cache.length), np.float32)
        counts = cfg.decode_row_counts(cfg.max_num_seqs)
        calls = computed = 0
        while True:
            self._fill_slots(state, cache, (cache.batch_size, cache.length), prompts, prompts_mask, valid)
            occupied = np.flatnonzero(state.sample_of >= 0)
            if not occupied.size:
                return state.response, state.resp_mask, state.log_probs, calls, computed
            if not state.waiting:
                cache, source = self._step_down(cache, counts, occupied)
                if source is not None:
                    state.keep_slots(source)
                    valid = np.where(source[:, None] >= 0, valid[np.maximum(source, 0)], 0.0).astype(np.float32)
                    occupied = np.flatnonzero(state.sample_of >= 0)
            slots = cache.batch_size
            samples, t = state.sample_of[occupied], state.next_token[occupied]
            tokens = np.full(slots, cfg.pad_token_id, np.int32)
            tokens[occupied] = state.response[samples, t - 1]
            write_at = np.full(slots, bucket, np.int32)  # an empty slot writes where its next sample starts
            write_at[occupied] = bucket + t - 1
            positions = np.zeros(slots, np.int32)
            positions[occupied] = prompt_lengths[samples] + t - 1
            valid[occupied, write_at[occupied]] = 1.0
            chosen = self._run("decode", (slots, cache.length), cache.decode, Tensor(tokens[:, None]),
                               Tensor(positions[:, None]), Tensor(write_at), Tensor(valid),
                               uniforms=state.uniforms(occupied), with_log_probs=return_log_probs)
            calls += 1
            computed += slots
            bar.update()
            state.record(occupied, chosen)

    def _fill_slots(self, state: _Slots, cache: KVCache, key: tuple, prompts, prompts_mask, valid) -> None:
        """Gives the free slots the next waiting samples, a prompt at a time: the prompt is prefilled once into the
        slots its samples take, which then hold their first token (a sample that ends there frees its slot again)."""
        n, slots, bucket = self.config.num_generations, state.sample_of.size, prompts.shape[1]
        while state.waiting and (state.sample_of < 0).any():
            free = np.flatnonzero(state.sample_of < 0)
            prompt = state.waiting[0] // n
            taken = [state.waiting.popleft() for _ in range(min(len(free), n - state.waiting[0] % n))]
            rows = free[:len(taken)]
            state.sample_of[rows], state.next_token[rows] = taken, 0
            valid[rows] = 0.0
            valid[rows, :bucket] = prompts_mask[prompt]
            written = np.zeros(slots, np.float32)
            written[rows] = 1.0
            chosen = self._run("prefill", key, cache.prefill, Tensor(prompts[prompt:prompt + 1]),
                               Tensor(prompts_mask[prompt:prompt + 1]), Tensor(np.zeros(slots, np.int32)),
                               Tensor(written), uniforms=state.uniforms(rows),
                               with_log_probs=state.log_probs is not None)
            state.record(rows, chosen)

    def _prefill(self, cache: KVCache, key: tuple, prompts: np.ndarray, prompts_mask: np.ndarray, n: int,
                 with_log_probs: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Fills the cache rows of every prompt's `n` samples (prompt j: rows j n .. j n + n - 1), `prefill_prompts`
        prompts a call (all of them when it does not divide their number), fewer to fit `max_num_batched_tokens`;
        returns the first tokens of the U n rows and their log-probs (each sample's own draw from its prompt's
        logits)."""
        count = len(prompts)
        chunk = self.prefill_prompts if self.prefill_prompts and count % self.prefill_prompts == 0 else count
        chunk = self.config.prefill_prompts(chunk, prompts.shape[1])  # a divisor of chunk: within the token budget
        uniforms = self._uniforms(count * n)
        chosen = [self._run("prefill", key, cache.prefill, Tensor(prompts[start:start + chunk]),
                            Tensor(prompts_mask[start:start + chunk]), *cache.rows_of(start, chunk, n),
                            uniforms=uniforms[start * n:(start + chunk) * n], with_log_probs=with_log_probs)
                  for start in range(0, count, chunk)]
        tokens = np.concatenate([c[0] for c in chosen])
        return tokens, np.concatenate([c[1] for c in chosen]) if with_log_probs else None

    def _run_uncached(self, ids, mask, return_log_probs, bar):
        cfg = self.config
        batch, bucket = ids.shape
        if self._graphs.forward_cell is None:
            self._graphs.forward_cell = _LastLogitsCell(self.model)
        width = bucket + cfg.max_new_tokens
        buf = np.full((batch, width), cfg.pad_token_id, np.int32)
        buf_mask = np.zeros((batch, width), np.int32)
        buf[:, :bucket], buf_mask[:, :bucket] = ids, mask
        response, resp_mask, log_probs, finished = self._buffers(batch, return_log_probs)
        steps = cfg.max_new_tokens
        for t in range(cfg.max_new_tokens):
            chosen = self._run("forward", (), self._graphs.forward_cell, Tensor(buf), Tensor(buf_mask),
                               Tensor(bucket + t - 1, ms.int32), uniforms=self._uniforms(batch),
                               with_log_probs=return_log_probs)
            tokens = self._step(t, *chosen, finished, response, resp_mask, log_probs)
            bar.update()
            if finished.all():
                steps = t + 1
                break
            buf[:, bucket + t], buf_mask[:, bucket + t] = tokens, 1
        return response, resp_mask, log_probs, steps


def _by_sample(chosen: tuple, sample_of: np.ndarray, batch: int) -> tuple:
    """A decode call's (tokens, log-probs or None) of cache rows, at their samples' places in arrays of `batch` (0
    for a sample no row decoded: one that has ended)."""
    held = sample_of >= 0
    spread = []
    for values in chosen:
        if values is not None:
            full = np.zeros(batch, values.dtype)
            full[sample_of[held]] = values[held]
            values = full
        spread.append(values)
    return tuple(spread)


class _Slots:
    """The decode slots of one continuous-batching call (`Generator._run_slots`): the sample each slot holds (-1:
    empty) and the index of the token it produces next, the samples waiting for a slot, and the whole batch's
    response buffers. Sample s's token t is drawn at uniform [t, s] of the generator's stream, row t drawn (for
    every sample, in one call) the first time a sample reaches token t, as the fixed batch draws it: the samples
    do not depend on the slots."""

    def __init__(self, generator: Generator, slots: int, batch: int, return_log_probs: bool):
        self.generator, self.batch = generator, batch
        self.response, self.resp_mask, self.log_probs, _ = generator._buffers(batch, return_log_probs)
        self.sample_of = np.full(slots, -1)
        self.next_token = np.zeros(slots, np.int64)
        self.waiting = collections.deque(range(batch))
        self.uniform_rows = np.zeros((generator.config.max_new_tokens, batch), np.float32)  # row t: drawn or 0
        self.rows_drawn = 0

    def uniforms(self, rows: np.ndarray) -> np.ndarray:
        """A uniform a slot: [t, s] for the slots `rows` (sample s, producing its token t), 0 elsewhere."""
        t = self.next_token[rows]
        while self.rows_drawn <= int(t.max()):
            self.uniform_rows[self.rows_drawn] = self.generator._uniforms(self.batch)
            self.rows_drawn += 1
        drawn = np.zeros(self.sample_of.size, np.float32)
        drawn[rows] = self.uniform_rows[t, self.sample_of[rows]]
        return drawn

    def keep_slots(self, source: np.ndarray) -> None:
        """Fewer slots: slot i now holds what slot source[i] held (-1: empty), as `Generator._step_down` moved them."""
        held = source >= 0
        self.sample_of = np.where(held, self.sample_of[np.maximum(source, 0)], -1)
        self.next_token = np.where(held, self.next_token[np.maximum(source, 0)], 0)

    def record(self, rows: np.ndarray, chosen) -> None:
        """Writes the tokens chosen for slots `rows` into their samples' responses; a slot whose sample ended (an
        EOS, a stop string, or its last token) is emptied."""
        cfg = self.generator.config
        tokens, token_lp = chosen
        samples, t = self.sample_of[rows], self.next_token[rows]
        self.response[samples, t] = tokens[rows]
        self.resp_mask[samples, t] = 1
        if self.log_probs is not None:
            self.log_probs[samples, t] = token_lp[rows]
        ended = self.generator._ended(tokens[rows], self.response, samples, t) | (t == cfg.max_new_tokens - 1)
        self.sample_of[rows[ended]] = -1
        self.next_token[rows[~ended]] += 1
