"""The decoding strategies of a `Generator` call: on the KV cache the fixed batch or continuous batching over decode
slots (`CachedRollout`, with the tail's step-down and the tool turns' extend calls), and the uncached fixed batch.
They feed the samples' `Trajectories`; the Generator runs, counts and times the graphs for them (`GraphCalls`) and
keeps the random stream."""
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
from mindrlhf.generation.trajectories import ToolTurnHandler, Trajectories, Uniforms
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
    """One generate call's settings, graph calls, progress bar and tool-turn handler (None: single-turn), shared by
    the strategies."""

    def __init__(self, config: GenerationConfig, calls: GraphCalls, stop: StopStrings | None, with_log_probs: bool,
                 bar: tqdm, tools: ToolTurnHandler | None = None):
        self.config, self.calls, self.stop, self.with_log_probs, self.bar = config, calls, stop, with_log_probs, bar
        self.tools = tools

    def trajectories(self, batch: int) -> Trajectories:
        """The response rows of `batch` samples, their tokens drawn from the call's stream."""
        uniforms = Uniforms(self.calls.uniforms, self.config.max_new_tokens, batch)
        return Trajectories(self.config, batch, self.with_log_probs, self.stop, uniforms, self.tools)


class FixedBatch(_Decoding):
    """Every sample keeps a row of the batch to the end of the call, without the KV cache: a full forward over the
    [prompt | response so far] buffer for each token. Returns the trajectories, the steps and the rows computed."""

    def uncached(self, ids, mask, forward: nn.Cell):
        """A full forward of `forward` over the [prompt | response so far] buffer for each token, every row a call."""
        cfg = self.config
        batch, bucket = ids.shape
        width = bucket + cfg.max_new_tokens
        buf = np.full((batch, width), cfg.pad_token_id, np.int32)
        buf_mask = np.zeros((batch, width), np.int32)
        buf[:, :bucket], buf_mask[:, :bucket] = ids, mask
        traj = self.trajectories(batch)
        samples = np.arange(batch)
        steps = cfg.max_new_tokens
        for t in range(cfg.max_new_tokens):
            running = samples[~traj.finished]
            uniforms = np.zeros(batch, np.float32)
            uniforms[running] = traj.draws(running)
            tokens, token_lp = self.calls.run("forward", (), forward, Tensor(buf), Tensor(buf_mask),
                                              Tensor(bucket + t - 1, ms.int32), uniforms=uniforms,
                                              with_log_probs=self.with_log_probs)
            traj.record(running, tokens[running], None if token_lp is None else token_lp[running])
            self.bar.update()
            if traj.finished.all():
                steps = t + 1
                break
            buf[:, bucket + t], buf_mask[:, bucket + t] = np.where(traj.finished, cfg.pad_token_id, tokens), 1
        return traj, steps, batch * (steps - 1), int(traj.produced.sum()) - batch


class CachedRollout(_Decoding):
    """Prefill, decode and (with tools) extend on the static KV cache. The fixed batch (`slots` 0): every sample has a
    cache row from the start, all prompts prefilled first (`prefill_prompts` a call). Continuous batching (`slots` =
    max_num_seqs): a slot whose sample finished takes the next waiting one, its prompt prefilled once into the free
    slots its waiting samples take. Every occupied row decodes a token a call at its own position; once no sample
    waits, the running ones step down to fewer rows (`decode_row_counts`). A sample whose turn calls a tool gets the
    tool's turn appended to its cache rows by an extend call and decodes on."""

    def run(self, prompts, prompts_mask, prompt_lengths, slots: int = 0, prefill_prompts: int = 0):
        """Returns the trajectories, the steps (decode calls, + 1 for the fixed batch's prefill), the rows the decode
        calls computed and the tokens they made."""
        cfg = self.config
        batch = len(prompts) * cfg.num_generations
        self.prompts, self.prompts_mask, self.prompt_lengths = prompts, prompts_mask, prompt_lengths
        self.bucket = prompts.shape[1]
        traj = self.trajectories(batch)
        cache = self.calls.cache(slots or batch)
        self.valid = np.zeros((cache.batch_size, cache.length), np.float32)
        self.sample_of = np.full(cache.batch_size, -1)  # the sample each cache row holds, -1: none
        waiting = collections.deque(range(batch) if slots else ())
        if not slots:
            self._prefill_all(traj, cache, prefill_prompts)
        counts = cfg.decode_row_counts(cache.batch_size)
        calls = computed = decoded = 0
        while True:
            self._fill(traj, cache, waiting)
            occupied = np.flatnonzero(self.sample_of >= 0)
            if not occupied.size:
                return traj, calls + (0 if slots else 1), computed, decoded
            if not waiting:
                cache, source = self.step_down(cache, counts, occupied)
                if source is not None:
                    self.sample_of = np.where(source >= 0, self.sample_of[np.maximum(source, 0)], -1)
                    self.valid = np.where(source[:, None] >= 0, self.valid[np.maximum(source, 0)], 0.0).astype(
                        np.float32)
                    occupied = np.flatnonzero(self.sample_of >= 0)
            rows = cache.batch_size
            samples = self.sample_of[occupied]
            tokens = np.full(rows, cfg.pad_token_id, np.int32)
            tokens[occupied] = traj.last_token(samples)
            write_at = np.full(rows, self.bucket, np.int32)  # an empty row writes where its next sample starts
            write_at[occupied] = self.bucket + traj.length[samples] - 1
            positions = np.zeros(rows, np.int32)
            positions[occupied] = self.prompt_lengths[samples] + traj.length[samples] - 1
            self.valid[occupied, write_at[occupied]] = 1.0
            chosen = self.calls.run("decode", (rows, cache.length), cache.decode, Tensor(tokens[:, None]),
                                    Tensor(positions[:, None]), Tensor(write_at), Tensor(self.valid),
                                    uniforms=self._draws(traj, occupied, rows), with_log_probs=self.with_log_probs)
            calls += 1
            computed += rows
            decoded += occupied.size
            self.bar.update()
            self._settle(traj, cache, occupied, chosen)

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

    def _draws(self, traj: Trajectories, rows: np.ndarray, count: int) -> np.ndarray:
        """A uniform a cache row: the next model token's of the sample each of `rows` holds, 0 elsewhere."""
        drawn = np.zeros(count, np.float32)
        drawn[rows] = traj.draws(self.sample_of[rows])
        return drawn

    def _settle(self, traj: Trajectories, cache: KVCache, rows: np.ndarray, chosen) -> None:
        """Records the tokens `chosen` for the cache rows `rows`; a row whose sample finished is emptied, and the
        samples whose turn called a tool get the tool's turn through extend calls until none does."""
        while True:
            tokens, token_lp = chosen
            samples = self.sample_of[rows]
            fed = traj.record(samples, tokens[rows], None if token_lp is None else token_lp[rows])
            self.sample_of[rows[traj.finished[samples]]] = -1
            if not fed:  # no tool turn (every step of a job without tools)
                return
            rows = np.array([row for row in rows if self.sample_of[row] in fed], np.int64)
            chosen = self._extend(traj, cache, rows, [fed[self.sample_of[row]] for row in rows])

    def _extend(self, traj: Trajectories, cache: KVCache, rows: np.ndarray, fed: list[list[int]]):
        """One extend call: the tokens `fed` (a sample's newest model token, then its tool turn) into cache rows
        `rows` at their samples' next slots; the tokens chosen after them."""
        count, length = cache.batch_size, cache.length
        width = min(next(w for w in self.config.extend_widths if w >= max(map(len, fed))), length)
        tokens = np.zeros((count, width), np.int32)
        positions = np.zeros((count, width), np.int32)
        written = np.zeros((count, width), np.float32)
        window_start = np.zeros(count, np.int32)
        last = np.zeros(count, np.int32)
        for row, ids in zip(rows, fed):
            sample = self.sample_of[row]
            first = self.bucket + int(traj.length[sample]) - len(ids)  # the slot of the newest model token
            window_start[row] = min(first, length - width)
            offset = first - window_start[row]
            tokens[row, offset:offset + len(ids)] = ids
            written[row, offset:offset + len(ids)] = 1.0
            slot_positions = self.prompt_lengths[sample] - self.bucket + window_start[row] + np.arange(width)
            positions[row] = np.maximum(slot_positions, 0)  # a column left of the prompt is not written
            self.valid[row, first:first + len(ids)] = 1.0
            last[row] = offset + len(ids) - 1
        return self.calls.run("extend", (count, length), cache.extend, Tensor(tokens), Tensor(positions),
                              Tensor(window_start), Tensor(written), Tensor(self.valid), Tensor(last),
                              uniforms=self._draws(traj, rows, count), with_log_probs=self.with_log_probs)

    def _prefill_all(self, traj: Trajectories, cache: KVCache, prefill_prompts: int) -> None:
        """Fills the cache rows of every prompt's n samples (prompt j: rows j n .. j n + n - 1), `prefill_prompts`
        prompts a call (all of them when it does not divide their number), fewer to fit `max_num_batched_tokens`;
        records each sample's first token (its own draw from its prompt's logits)."""
        count, n = len(self.prompts), self.config.num_generations
        chunk = prefill_prompts if prefill_prompts and count % prefill_prompts == 0 else count
        chunk = self.config.prefill_prompts(chunk, self.bucket)  # a divisor of chunk: within the token budget
        self.sample_of[:] = np.arange(count * n)
        self.valid[:, :self.bucket] = np.repeat(self.prompts_mask, n, 0)
        uniforms = traj.draws(np.arange(count * n))
        key = (cache.batch_size, cache.length)
        chosen = [self.calls.run("prefill", key, cache.prefill, Tensor(self.prompts[start:start + chunk]),
                                 Tensor(self.prompts_mask[start:start + chunk]), *cache.rows_of(start, chunk, n),
                                 uniforms=uniforms[start * n:(start + chunk) * n], with_log_probs=self.with_log_probs)
                  for start in range(0, count, chunk)]
        tokens = np.concatenate([c[0] for c in chosen])
        token_lp = np.concatenate([c[1] for c in chosen]) if self.with_log_probs else None
        self._settle(traj, cache, np.arange(count * n), (tokens, token_lp))

    def _fill(self, traj: Trajectories, cache: KVCache, waiting: collections.deque) -> None:
        """Gives the free rows the next waiting samples, a prompt at a time: the prompt is prefilled once into the
        rows its samples take, which then hold their first token (a sample that ends there frees its row again)."""
        n, rows = self.config.num_generations, cache.batch_size
        while waiting and (self.sample_of < 0).any():
            free = np.flatnonzero(self.sample_of < 0)
            prompt = waiting[0] // n
            taken = [waiting.popleft() for _ in range(min(len(free), n - waiting[0] % n))]
            new = free[:len(taken)]
            self.sample_of[new] = taken
            self.valid[new] = 0.0
            self.valid[new, :self.bucket] = self.prompts_mask[prompt]
            written = np.zeros(rows, np.float32)
            written[new] = 1.0
            chosen = self.calls.run("prefill", (rows, cache.length), cache.prefill,
                                    Tensor(self.prompts[prompt:prompt + 1]),
                                    Tensor(self.prompts_mask[prompt:prompt + 1]), Tensor(np.zeros(rows, np.int32)),
                                    Tensor(written), uniforms=self._draws(traj, new, rows),
                                    with_log_probs=self.with_log_probs)
            self._settle(traj, cache, new, chosen)
