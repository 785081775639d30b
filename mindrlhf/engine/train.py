"""The training engine: one net that learns, and the one update loop every trained net (the actor's policy, the
PPO critic) runs."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from mindrlhf.algorithms import aggregation_weights
from mindrlhf.algorithms.policy_cells import ResponseHidden, response_hidden_shape
from mindrlhf.engine.batches import RankRows
from mindrlhf.engine.forward import check_response_cell
from mindrlhf.engine.sizing import MicroBatchSizer
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.optim import learning_rate_at
from mindrlhf.parallel.layers import to_ms_dtype
from mindrlhf.parallel.pipeline import PipelineTrainStep, gather_stage_layouts
from mindrlhf.parallel.spmd import MicroBatchedTrainStep

logger = logging.getLogger("mindrlhf.trainer")

TOKEN_WEIGHTS = "token_weights"  # the loss's weight of each token, made per update (`algorithms.aggregation`)


class NonFiniteUpdates(RuntimeError):
    """Too many optimizer updates in a row had a NaN/inf loss or gradient (`optimizer.max_consecutive_skips`)."""


def total_updates(shape: StepShape, steps: int) -> int:
    """Optimizer updates of the whole run of `steps` steps (the length of a learning-rate schedule): every step's
    passes over its mini-batches (`StepShape.updates_per_step`)."""
    return steps * shape.updates_per_step


@dataclasses.dataclass(frozen=True)
class LearningRateSchedule:
    """The learning rate of each update (`mindrlhf.optim.learning_rate_at`)."""

    peak: float
    warmup_steps: int
    total_updates: int
    kind: str = "constant"
    min_ratio: float = 0.0

    def at(self, update: int) -> float:
        return learning_rate_at(update, self.peak, self.warmup_steps, self.total_updates, self.kind, self.min_ratio)


@dataclasses.dataclass(frozen=True)
class UpdatePolicy:
    """How an engine's updates are made: the gradient clip, the learning-rate schedule, the loss's token weighting
    (`loss.aggregation`) and how many non-finite updates in a row stop the job (0: never)."""

    lr: LearningRateSchedule
    max_grad_norm: float
    aggregation: str
    max_consecutive_skips: int
    token_mask: str = "response_mask"  # the tokens the loss counts (SFT: "loss_mask", the assistant's)


class TrainEngine:
    """A net that learns: `net` in `layout` (this rank's pipeline stage when `layout.pp > 1`), `loss_net` on it (a
    cell that declares the experience columns it reads, `INPUTS`, and the statistics it returns, `OUTPUTS`, the
    first being the loss), `optimizer`, the SPMD train step (micro-batched gradient accumulation) or the 1F1B
    pipeline train step, and `sizer`'s micro-batches; `shape` is the step's geometry (`StepShape`: its updates and
    passes).

    `update` runs the loop on a data-parallel rank's own rows: passes over mini-batches of whole prompt groups
    (each rank holds its share of each), each an optimizer update with its learning rate, the loss normalised over
    the whole mini-batch,
    the statistics summed over the data-parallel group and averaged over the updates as `<name>/<output>`
    metrics. An update whose gradient norm is not finite is skipped (by the step, on every rank) and counted;
    `policy.max_consecutive_skips` in a row raise `NonFiniteUpdates`.

    `comm` sums the statistics over the data-parallel group (`group_sum`); `dp_sums` is the group's shared-memory
    gradient sum (None: MindSpore's AllReduce); `stage_shared` names parameters the first and last pipeline stages
    both hold (a tied embedding)."""

    def __init__(self, name: str, net, loss_net, optimizer, layout, model_config, sizer: MicroBatchSizer,
                 shape: StepShape, comm, policy: UpdatePolicy, strategy: dict, stage_shared=(), dp_sums=None):
        check_response_cell(loss_net)
        self.name, self.net, self.loss_net, self.optimizer = name, net, loss_net, optimizer
        self.layout, self.sizer, self.shape, self.comm, self.policy = layout, sizer, shape, comm, policy
        self.strategy = strategy  # this rank's (stage's) parameter layouts
        self.stages = None  # with pipeline stages: every stage's layouts (`gather_stage_layouts`)
        self.updates = 0  # optimizer updates so far: the learning-rate schedule's position
        self.consecutive_skips = 0
        if layout.pp > 1:
            self.step = self._pipeline_step(model_config, stage_shared, dp_sums)
        else:
            self.step = MicroBatchedTrainStep(loss_net, optimizer, layout, grad_reduction="sum",
                                              max_grad_norm=policy.max_grad_norm, dp_sums=dp_sums)

    def state_dict(self) -> dict:
        """The counters a resume restores (the weights and moments are `weights()` + `optimizer_state()`, saved in
        the rank's file): the learning-rate schedule's position and the current run of skipped updates."""
        return {"updates": self.updates, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.consecutive_skips = int(state["updates"]), int(state["consecutive_skips"])

    def _pipeline_step(self, model_config, stage_shared, dp_sums):
        layout = self.layout
        self.stages = gather_stage_layouts(self.strategy, {p.name: p.dtype for p in self.net.get_parameters()},
                                           layout)
        stage_net = self.loss_net if layout.stage == layout.pp - 1 else ResponseHidden(self.net)
        return PipelineTrainStep(stage_net, self.optimizer, layout, response_hidden_shape(model_config.hidden_size),
                                 to_ms_dtype(model_config.compute_dtype), num_inputs=len(self.loss_net.INPUTS),
                                 forward_inputs=len(ResponseHidden.INPUTS), num_outputs=len(self.loss_net.OUTPUTS),
                                 grad_reduction="sum", max_grad_norm=self.policy.max_grad_norm,
                                 stage_shared=stage_shared, dp_sums=dp_sums)

    # ------------------------------------------------------------------ state
    def weights(self) -> list:
        """Every weight of the net, the frozen ones too (a LoRA net's base: swapped and saved like the adapters)."""
        return list(self.net.get_parameters())

    def optimizer_state(self) -> list:
        """The optimizer's moments and step counter (what swaps and checkpoints handle besides the weights)."""
        weights = {id(p) for p in self.net.get_parameters()}
        return [p for p in self.optimizer.get_parameters() if id(p) not in weights]

    def strategy_file(self, file_name: str) -> dict[str, tuple[dict, dict | None]]:
        """The checkpoint's strategy file of this net: its layouts, or with pipeline stages every stage's layouts
        and the stage of each parameter."""
        if self.stages:
            layouts, stage_of, _ = self.stages
            return {file_name: (layouts, stage_of)}
        return {file_name: (self.strategy, None)}

    # ------------------------------------------------------------------ the update loop
    def update(self, share: RankRows) -> dict:
        """The shape's `num_iterations` passes over this data-parallel rank's rows of the step's batch (`share`),
        one optimizer update per mini-batch of `prompts_per_update` prompts of `group_size` responses (each rank's
        share of it, the next run of its rows: `StepShape.update_slices`); returns the `<name>/*` metrics."""
        prefix = f"{self.name}/"
        sums: dict[str, float] = {}
        count = skipped = 0
        lr = None
        slices = self.shape.update_slices(share.rows.num_rows, self.layout.dp)
        for _ in range(self.shape.num_iterations):
            for rows in slices:
                lr = self.policy.lr.at(self.updates)
                stats, grad_norm = self._update_once(share, rows, lr)
                if stats is None:
                    skipped += 1
                    continue
                for name, value in zip(self.loss_net.OUTPUTS, stats):
                    sums[prefix + name] = sums.get(prefix + name, 0.0) + float(value)
                sums[prefix + "grad_norm"] = sums.get(prefix + "grad_norm", 0.0) + grad_norm
                count += 1
        if lr is None:
            return {prefix + "updates": 0}
        metrics = {name: value / count for name, value in sums.items()}
        metrics.update({prefix + "lr": lr, prefix + "updates": count, prefix + "skipped_updates": skipped})
        return metrics

    def _update_once(self, share: RankRows, rows: slice, lr: float) -> tuple[np.ndarray | None, float]:
        """One optimizer update on this rank's `rows` of `share` and every other rank's rows of the same update:
        (its statistics summed over the data-parallel group, or None when it was skipped; the gradient norm)."""
        self.optimizer.set_learning_rate(lr)
        part = share.rows.rows(rows)
        update_tokens = share.row_tokens[:, rows]  # every rank's rows of this update
        # the loss is normalised over the whole update, and every dp rank reads its widest response, so that no
        # rank waits for another
        counts = (float(update_tokens.sum()), float((update_tokens > 0).sum()))
        weights = aggregation_weights(part[self.policy.token_mask], self.policy.aggregation, counts).astype(np.float32)
        columns = part.with_columns(**{TOKEN_WEIGHTS: weights})
        width = self.sizer.width(part.response_mask, longest=int(share.lengths[:, rows].max()))
        # a name may come twice in INPUTS (no reference: the old log-probs in its place)
        rank_statistics, grad_norm = self.step(self.sizer.split(columns, width, int(share.batch_rows[rows.start]),
                                                                self.loss_net.INPUTS))
        self.updates += 1
        if not np.isfinite(grad_norm):  # the step skipped it, on every rank (the norm is global)
            self._count_skip(grad_norm)
            return None, grad_norm
        self.consecutive_skips = 0
        return self.comm.group_sum(rank_statistics.astype(np.float32), self.layout.dp_group), grad_norm

    def _count_skip(self, grad_norm: float) -> None:
        self.consecutive_skips += 1
        limit = self.policy.max_consecutive_skips
        logger.warning("%s update %d skipped: the gradient norm is %s (%d in a row)", self.name, self.updates,
                       grad_norm, self.consecutive_skips)
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteUpdates(f"{self.consecutive_skips} {self.name} updates in a row had a non-finite loss or "
                                   f"gradient (optimizer.max_consecutive_skips={limit}); the job stops with its last "
                                   "checkpoint intact: lower the learning rate or check the rewards and data")
