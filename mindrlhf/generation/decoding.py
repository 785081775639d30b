"""The decoding strategies of a `Generator` call: the fixed batch (with the KV cache or without) and continuous
batching over decode slots. They fill the response buffers; the Generator runs, counts and times the graphs for them
(`GraphCalls`) and keeps the random stream."""
from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn
from tqdm import tqdm

from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.generation.stopping import StopStrings
from mindrlhf.models.qwen2.modeling import KVCache


@dataclass(frozen=True)
class GraphCalls:
    """What the strategies ask of the Generator: `run` a graph cell and the token selection on its logits (graph,
    key, cell, *inputs, uniforms=, with_log_probs=) -> tokens and log-probs or None; the stream's next `uniforms`
    (rows); the KV `cache` of a row count; `move` rows of one cache into rows 0, 1, ... of another."""

    run: Callable[..., tuple[np.ndarray, np.ndarray | None]]
    uniforms: Callable[[int], np.ndarray]
    cache: Callable[[int], KVCache]
    move: Callable[[KVCache, KVCache, np.ndarray], None]


class _Decoding:
    """One generate call's settings, graph calls and progress bar; the response buffers, the end of a response (an
    EOS or a stop string) and the step down to fewer cache rows, shared by the strategies."""

    def __init__(self, config: GenerationConfig, calls: GraphCalls, stop: StopStrings | None, with_log_probs: bool,
                 bar: tqdm):
        self.config, self.calls, self.stop, self.with_log_probs, self.bar = config, calls, stop, with_log_probs, bar

    def buffers(self, batch: int):
        """The response ids, mask, log-probs (or None) of `batch` samples and whether each has finished."""
        cfg = self.config
        response = np.full((batch, cfg.max_new_tokens), cfg.pad_token_id, np.int32)
        resp_mask = np.zeros((batch, cfg.max_new_tokens), np.int32)
        log_probs = np.zeros((batch, cfg.max_new_tokens), np.float32) if self.with_log_probs else None
        return response, resp_mask, log_probs, np.zeros(batch, bool)

    def ended(self, tokens: np.ndarray, response: np.ndarray, samples: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Whether each of `samples` ended with its newest token `tokens` (at index `last` of its `response` row): an
        EOS, or the completion of a stop string."""
        ended = np.isin(tokens, self.config.eos_token_ids)
        if self.stop is not None:
            check = np.flatnonzero(~ended)
            ended[check] = self.stop.completed(response, samples[check], last[check])
        return ended

    def step_down(self, cache: KVCache, counts: list[int], running: np.ndarray) -> tuple[KVCache, np.ndarray | None]:
        """When the cache rows `running` fit a smaller row count of `counts` than `cache` has, moves them into rows
        0, 1, ... of the smallest such count's cache; returns that cache and, for each of its rows, the row of
        `cache` it came from (-1: none). Else `cache` and None."""
        target = min(c for c in counts if c >= running.size)
        if target >= cache.batch_size:
            return cache, None
        source = np.full(target, -1)
        source[:running.size] = running
        small = self.calls.cache(target)
        self.calls.move(cache, small, np.maximum(source, 0))
        return small, source


class FixedBatch(_Decoding):
    """Every sample keeps a row of the batch to the end of the call: with the KV cache (`cached`: prefill, then
    decode steps that step down to fewer rows as samples end) or without it (`uncached`: a full forward a token).
    Each returns the response buffers, the steps and the rows the decode calls computed."""

    def cached(self, prompts, prompts_mask, prompt_lengths, prefill_prompts: int):
        """Prefill reads each prompt once and fills the cache rows of its `num_generations` samples; each decode
        step runs every sample still running, in the smallest row count of `decode_row_counts` they fit."""
        cfg, run = self.config, self.calls.run
        n = cfg.num_generations
        bucket = prompts.shape[1]
        batch = len(prompts) * n
        cache = self.calls.cache(batch)
        response, resp_mask, log_probs, finished = self.buffers(batch)
        valid = np.zeros((batch, cache.length), np.float32)
        valid[:, :bucket] = np.repeat(prompts_mask, n, 0)
        chosen = self._prefill(cache, (batch, cache.length), prompts, prompts_mask, prefill_prompts)
        sample_of = np.arange(batch)  # the sample each cache row decodes, -1: none
        counts = cfg.decode_row_counts(batch)
        steps, computed = cfg.max_new_tokens, 0
        for t in range(cfg.max_new_tokens):
            tokens = self._step(t, *chosen, finished, response, resp_mask, log_probs)
            self.bar.update()
            if finished.all() or t == cfg.max_new_tokens - 1:
                steps = t + 1
                break
            slot = bucket + t
            valid[:, slot] = 1.0
            running = np.flatnonzero((sample_of >= 0) & ~finished[np.maximum(sample_of, 0)])
            cache, source = self.step_down(cache, counts, running)
            if source is not None:
                sample_of = np.where(source >= 0, sample_of[np.maximum(source, 0)], -1)
            rows = np.maximum(sample_of, 0)  # a row without a sample repeats sample 0's inputs, its output unused
            uniforms = self.calls.uniforms(batch)[rows] * (sample_of >= 0)
            positions = (prompt_lengths[rows] + t).astype(np.int32)[:, None]
            decoded = run("decode", (cache.batch_size, cache.length), cache.decode, Tensor(tokens[rows][:, None]),
                          Tensor(positions), Tensor(np.full(cache.batch_size, slot, np.int32)), Tensor(valid[rows]),
                          uniforms=uniforms, with_log_probs=self.with_log_probs)
            computed += cache.batch_size
            chosen = _by_sample(decoded, sample_of, batch)
        return response, resp_mask, log_probs, steps, computed

    def _prefill(self, cache: KVCache, key: tuple, prompts: np.ndarray, prompts_mask: np.ndarray,
                 prefill_prompts: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Fills the cache rows of every prompt's n samples (prompt j: rows j n .. j n + n - 1), `prefill_prompts`
        prompts a call (all of them when it does not divide their number), fewer to fit `max_num_batched_tokens`;
        returns the first tokens of the U n rows and their log-probs (each sample's own draw from its prompt's
        logits)."""
        count, n = len(prompts), self.config.num_generations
        chunk = prefill_prompts if prefill_prompts and count % prefill_prompts == 0 else count
        chunk = self.config.prefill_prompts(chunk, prompts.shape[1])  # a divisor of chunk: within the token budget
        uniforms = self.calls.uniforms(count * n)
        chosen = [self.calls.run("prefill", key, cache.prefill, Tensor(prompts[start:start + chunk]),
                                 Tensor(prompts_mask[start:start + chunk]), *cache.rows_of(start, chunk, n),
                                 uniforms=uniforms[start * n:(start + chunk) * n], with_log_probs=self.with_log_probs)
                  for start in range(0, count, chunk)]
        tokens = np.concatenate([c[0] for c in chosen])
        return tokens, np.concatenate([c[1] for c in chosen]) if self.with_log_probs else None

    def uncached(self, ids, mask, forward: nn.Cell):
        """A full forward of `forward` over the [prompt | response so far] buffer for each token, every row a call."""
        cfg = self.config
        batch, bucket = ids.shape
        width = bucket + cfg.max_new_tokens
        buf = np.full((batch, width), cfg.pad_token_id, np.int32)
        buf_mask = np.zeros((batch, width), np.int32)
        buf[:, :bucket], buf_mask[:, :bucket] = ids, mask
        response, resp_mask, log_probs, finished = self.buffers(batch)
        steps = cfg.max_new_tokens
        for t in range(cfg.max_new_tokens):
            chosen = self.calls.run("forward", (), forward, Tensor(buf), Tensor(buf_mask),
                                    Tensor(bucket + t - 1, ms.int32), uniforms=self.calls.uniforms(batch),
                                    with_log_probs=self.with_log_probs)
            tokens = self._step(t, *chosen, finished, response, resp_mask, log_probs)
            self.bar.update()
            if finished.all():
                steps = t + 1
                break
            buf[:, bucket + t], buf_mask[:, bucket + t] = tokens, 1
        return response, resp_mask, log_probs, steps, batch * (steps - 1)

    def _step(self, t, tokens, token_lp, finished, response, resp_mask, log_probs) -> np.ndarray:
        """Records step t's chosen tokens and log-probs; returns the tokens fed to the next step."""
        alive = ~finished
        if log_probs is not None:
            log_probs[:, t] = np.where(alive, token_lp, 0.0)
        tokens = np.where(alive, tokens, self.config.pad_token_id).astype(np.int32)
        response[:, t] = tokens
        resp_mask[:, t] = alive
        running = np.flatnonzero(alive)
        finished[running] = self.ended(tokens[running], response, running, np.full(running.size, t))
        return tokens


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


class ContinuousBatch(_Decoding):
    """Continuous batching over `max_num_seqs` slots (KV-cache rows): a slot whose response ended takes the next
    waiting sample (samples in order: prompt j's are j n .. j n + n - 1); a prompt is prefilled once into all the
    free slots its waiting samples take; then every occupied slot decodes one token a call, each at its own
    position. Once no sample waits, the running ones step down to fewer slots."""

    def run(self, prompts, prompts_mask, prompt_lengths):
        """Returns the fixed batch's buffers, the number of decode calls and the rows they computed."""
        cfg = self.config
        bucket = prompts.shape[1]
        state = _Slots(self, cfg.max_num_seqs, len(prompts) * cfg.num_generations)
        cache = self.calls.cache(cfg.max_num_seqs)
        valid = np.zeros((cache.batch_size, cache.length), np.float32)
        counts = cfg.decode_row_counts(cfg.max_num_seqs)
        calls = computed = 0
        while True:
            self._fill(state, cache, (cache.batch_size, cache.length), prompts, prompts_mask, valid)
            occupied = np.flatnonzero(state.sample_of >= 0)
            if not occupied.size:
                return state.response, state.resp_mask, state.log_probs, calls, computed
            if not state.waiting:
                cache, source = self.step_down(cache, counts, occupied)
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
            chosen = self.calls.run("decode", (slots, cache.length), cache.decode, Tensor(tokens[:, None]),
                                    Tensor(positions[:, None]), Tensor(write_at), Tensor(valid),
                                    uniforms=state.uniforms(occupied), with_log_probs=self.with_log_probs)
            calls += 1
            computed += slots
            self.bar.update()
            state.record(occupied, chosen)

    def _fill(self, state: _Slots, cache: KVCache, key: tuple, prompts, prompts_mask, valid) -> None:
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
            chosen = self.calls.run("prefill", key, cache.prefill, Tensor(prompts[prompt:prompt + 1]),
                                    Tensor(prompts_mask[prompt:prompt + 1]), Tensor(np.zeros(slots, np.int32)),
                                    Tensor(written), uniforms=state.uniforms(rows), with_log_probs=self.with_log_probs)
            state.record(rows, chosen)


class _Slots:
    """The decode slots of one continuous-batching call (`ContinuousBatch`): the sample each slot holds (-1: empty)
    and the index of the token it produces next, the samples waiting for a slot, and the whole batch's response
    buffers. Sample s's token t is drawn at uniform [t, s] of the generator's stream, row t drawn (for every
    sample, in one call) the first time a sample reaches token t, as the fixed batch draws it: the samples do not
    depend on the slots."""

    def __init__(self, decoding: ContinuousBatch, slots: int, batch: int):
        self.decoding, self.batch = decoding, batch
        self.response, self.resp_mask, self.log_probs, _ = decoding.buffers(batch)
        self.sample_of = np.full(slots, -1)
        self.next_token = np.zeros(slots, np.int64)
        self.waiting = collections.deque(range(batch))
        self.uniform_rows = np.zeros((decoding.config.max_new_tokens, batch), np.float32)  # row t: drawn or 0
        self.rows_drawn = 0

    def uniforms(self, rows: np.ndarray) -> np.ndarray:
        """A uniform a slot: [t, s] for the slots `rows` (sample s, producing its token t), 0 elsewhere."""
        t = self.next_token[rows]
        while self.rows_drawn <= int(t.max()):
            self.uniform_rows[self.rows_drawn] = self.decoding.calls.uniforms(self.batch)
            self.rows_drawn += 1
        drawn = np.zeros(self.sample_of.size, np.float32)
        drawn[rows] = self.uniform_rows[t, self.sample_of[rows]]
        return drawn

    def keep_slots(self, source: np.ndarray) -> None:
        """Fewer slots: slot i now holds what slot source[i] held (-1: empty), as `step_down` moved them."""
        held = source >= 0
        self.sample_of = np.where(held, self.sample_of[np.maximum(source, 0)], -1)
        self.next_token = np.where(held, self.next_token[np.maximum(source, 0)], 0)

    def record(self, rows: np.ndarray, chosen) -> None:
        """Writes the tokens chosen for slots `rows` into their samples' responses; a slot whose sample ended (an
        EOS, a stop string, or its last token) is emptied."""
        tokens, token_lp = chosen
        samples, t = self.sample_of[rows], self.next_token[rows]
        self.response[samples, t] = tokens[rows]
        self.resp_mask[samples, t] = 1
        if self.log_probs is not None:
            self.log_probs[samples, t] = token_lp[rows]
        ended = self.decoding.ended(tokens[rows], self.response, samples, t)
        ended |= t == self.decoding.config.max_new_tokens - 1
        self.sample_of[rows[ended]] = -1
        self.next_token[rows[~ended]] += 1
