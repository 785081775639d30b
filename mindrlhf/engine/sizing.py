"""How one pass over a rank's rows splits into graph calls (micro-batches)."""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np

from mindrlhf.engine import memory_budget
from mindrlhf.engine.batches import (
    prompt_micro_batches,
    prompt_run,
    response_widths,
    trim_responses,
    trimmed_width,
)
from mindrlhf.engine.memory_plan import Call, NetShape, forward_graph_bytes, memory_model

logger = logging.getLogger("mindrlhf.trainer")

# the columns every response cell reads first, in this order (`mindrlhf.algorithms.policy_cells`)
RESPONSE_COLUMNS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


class MicroBatchSizer:
    """How one pass splits a rank's rows into graph calls: `plan` gives the responses per call (the configured size,
    `micro_batches` equal micro-batches for a train net in pipeline stages (its `micro_batch_num`), or (0) the most
    responses whose estimated activations fit `schedule.activation_memory_gib`, `mindrlhf.engine.memory_budget`,
    with what a forward call's compiled graph keeps on a `device` whose graphs keep memory: `memory_plan.GRAPH_MEMORY`),
    how many of them share each prompt read (up to `share_limit`, a prompt's responses, when
    `schedule.share_prompts`; 1 reads the prompt again for every response: rows j share_limit .. j share_limit +
    share_limit - 1 are the responses to one prompt, `batches.prompt_run`) and the response width the calls read
    (the narrowest of `schedule.response_buckets` widths that holds the longest response); the choice is logged once
    per shape."""

    def __init__(self, kind: str, configured: int, model_config, tp: int, budget_gib: float, micro_batches: int = 0,
                 share_limit: int = 1, response_buckets: int = 1, call_unit: int = 1, device: str = "cpu"):
        self.kind, self.configured, self.model_config, self.tp = kind, configured, model_config, tp
        self.device = device  # the memory model (`memory_plan.memory_model`)
        self.budget_gib, self.micro_batches, self.share_limit = budget_gib, micro_batches, share_limit
        self.response_buckets = response_buckets
        self.call_unit = call_unit  # rows a call keeps together (a preference pair's two answers: 2)
        self._logged: set[tuple] = set()

    @classmethod
    def for_pass(cls, kind: str, schedule, model_config, layout, group_size: int, *, training: bool,
                 call_unit: int = 1, device: str | None = None) -> MicroBatchSizer:
        """The sizer of a net in `layout` whose rows come in groups of `group_size` responses to one prompt: for
        training its `micro_batch_num` micro-batches with pipeline stages, else
        `schedule.micro_batch_size_per_device`; for a forward pass `schedule.log_prob_micro_batch_size_per_device`
        (0: from the memory budget). `device`: the memory model (default: this process's device target's for the
        net's compute dtype)."""
        stages_split = model_config.parallel_config.micro_batch_num if training and layout.pp > 1 else 0
        configured = schedule.micro_batch_size_per_device if training else schedule.log_prob_micro_batch_size_per_device
        if device is None:
            import mindspore as ms

            device = memory_model(ms.get_context("device_target"), [model_config.compute_dtype])
        return cls(kind, configured, model_config, layout.tp, schedule.activation_memory_gib, stages_split,
                   group_size if schedule.share_prompts else 1, schedule.response_buckets, call_unit, device)

    def _call_bytes(self, prompts: int, rows: int, prompt_width: int, response_width: int) -> int:
        cfg = self.model_config
        shape = dict(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                     vocab=cfg.vocab_size, tp=self.tp)
        if self.kind.endswith("train"):
            stages = cfg.parallel_config.pipeline_stage
            layers = cfg.num_layers // stages  # a stage keeps its own layers' activations (the first stage's here)
            full, selective = cfg.recompute.layers_of_stage(0, stages, layers)
            return memory_budget.train_bytes(prompts, rows, prompt_width, response_width, layers=layers,
                                             recomputed_layers=full, selective_layers=selective, **shape)
        # on CPU a forward graph keeps memory that grows with its call while it lives, about as much as its
        # activations at SmolLM2's shape (`GRAPH_MEMORY`)
        kept = forward_graph_bytes(NetShape.of(cfg), Call(prompts, rows, prompt_width, response_width), self.tp,
                                   self.device)
        return memory_budget.log_prob_bytes(prompts, rows, prompt_width, response_width, **shape) + kept

    def width(self, response_mask: np.ndarray, longest: int | None = None) -> int:
        """The response width calls over the rows of `response_mask` read (`batches.trimmed_width`): enough for
        its longest response, or for `longest` tokens when other ranks' rows must be read as wide."""
        if longest is None:
            longest = int(response_mask.sum(axis=1).max()) if response_mask.size else 0
        return trimmed_width(longest, response_widths(response_mask.shape[1], self.response_buckets))

    def plan(self, columns: Mapping[str, np.ndarray], width: int | None = None,
             first_row: int = 0) -> tuple[int, int, int]:
        """(responses per call, responses per prompt read, response width) for `columns` (name -> rows, at least
        `RESPONSE_COLUMNS`, or packed rows' response columns: one row per response), rows `first_row`.. of an
        experience whose prompts come in groups of `share_limit` responses; `width` (default: `self.width` of these
        rows) lets a caller read as many positions on every data-parallel rank."""
        rows = len(columns["response_ids"])
        prompt_width = columns["prompt_ids"].shape[1] if "prompt_ids" in columns else 0  # packed rows: no prompt
        width = width or self.width(columns["response_mask"])
        run = prompt_run(self.share_limit, first_row, rows) if prompt_width else 1
        if self.micro_batches:
            size = math.ceil(rows / self.micro_batches)
        elif self.configured:
            size = self.configured
        else:
            size = memory_budget.rows_per_call(
                rows, lambda d: self._call_bytes(d // math.gcd(d, run), d, prompt_width, width),
                int(self.budget_gib * 2**30), self.call_unit)
        if size % self.call_unit:
            raise ValueError(f"{self.kind}: calls of {size} rows would split the {self.call_unit} rows that must stay "
                             "together (a preference pair): make the micro-batch size a multiple of it")
        share = math.gcd(size, run)
        self._log_once(rows, prompt_width, width, size, share, columns["response_ids"].shape[1])
        return size, share, width

    def _log_once(self, rows: int, prompt_width: int, width: int, size: int, share: int, full_width: int) -> None:
        if (rows, prompt_width, width, size, share) in self._logged:
            return
        self._logged.add((rows, prompt_width, width, size, share))
        estimate = self._call_bytes(size // share, size, prompt_width, width) / 2**20
        how = "set" if self.micro_batches or self.configured else \
            f"auto, schedule.activation_memory_gib={self.budget_gib:g}"
        counted = "activations" if self.kind.endswith("train") or self.device != "cpu" else \
            "activations and graph memory"
        logger.info("%s micro-batches: %d of %d responses per call, %d per prompt read (%d + %d of %d tokens; "
                    "~%.0f MiB of %s a call; %s)", self.kind, size, rows, share, prompt_width, width,
                    full_width, estimate, counted, how)

    def split(self, columns: Mapping[str, np.ndarray], width: int | None = None, first_row: int = 0,
              names: Sequence[str] | None = None) -> list[list]:
        """The graph calls' inputs for the rows of `columns` (`batches.prompt_micro_batches` of `plan`: the columns
        `names` in a cell's order, default all; the per-token columns cut to its width). With `names`, only those
        columns are read (each once, though a cell may take one twice)."""
        if names is not None:
            columns = {name: columns[name] for name in dict.fromkeys(names)}
        size, share, width = self.plan(columns, width, first_row)
        return prompt_micro_batches(trim_responses(columns, width), size, share, names)
