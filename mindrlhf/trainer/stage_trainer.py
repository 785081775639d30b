"""`StageTrainer`: a stage before RL (`mindrlhf.trainer.stages`: SFT, reward model, DPO) on the train YAML's net and
layout (dp, tp, pp, sequence parallel, recompute, ZeRO-1), on the RL job's training engine, optimizer, checkpoints
and metrics: one optimizer update a step on `schedule.batch_size` records, epochs over a training split, a held-out
score before, every `eval.eval_interval` steps and after."""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from mindrlhf.checkpoint.coordinator import CheckpointCoordinator
from mindrlhf.checkpoint.step import find_resume_checkpoint
from mindrlhf.checkpoint.weights import load_adapters
from mindrlhf.configs.base import ConfigError
from mindrlhf.data.stage_data import StageDataset
from mindrlhf.engine.batches import RankRows
from mindrlhf.engine.forward import ForwardEngine
from mindrlhf.engine.sizing import MicroBatchSizer
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.engine.train import TrainEngine
from mindrlhf.models.qwen2 import Qwen2Config
from mindrlhf.parallel.array_collectives import ArrayCollectives
from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.strategy import net_layouts
from mindrlhf.trainer.metrics import MetricsWriter, memory_metrics
from mindrlhf.trainer.phases import peak_rss_gib
from mindrlhf.trainer.plan import (
    check_job_inputs,
    check_lora_adapter,
    check_pipeline,
    check_tensor_parallel,
    with_lora,
)
from mindrlhf.trainer.plot import ProgressPanels, plot_progress
from mindrlhf.trainer.roles import adamw, update_policy
from mindrlhf.trainer.specs import NetSpec
from mindrlhf.trainer.stages import Stage, StageRole, stage_of
from mindrlhf.utils.agreement import agreed

logger = logging.getLogger("mindrlhf.trainer")


def open_stage_data(stage: Stage, config, job, tokenizer, seq_length: int) -> tuple[StageDataset, int]:
    """The stage's data, checked against the model's `seq_length` and the batch size, and the run's steps
    (`sft.epochs` over it unless `schedule.steps` was given)."""
    sched = config.schedule
    dataset = stage.open_dataset(job.mind_dataset_dir, tokenizer.pad_token_id, sched.seed, config.sft.eval_fraction,
                                 job.eval_dataset_file)
    width = dataset.prompt_width + dataset.response_width
    if width > seq_length:
        raise ConfigError(f"{job.mind_dataset_dir}: rows of {width} tokens (prompt {dataset.prompt_width} + response "
                          f"{dataset.response_width}) do not fit {job.sft_path_train} model_config.seq_length="
                          f"{seq_length}")
    if dataset.steps_per_epoch(sched.batch_size) == 0:
        raise ConfigError(f"schedule.batch_size={sched.batch_size} is larger than the {len(dataset.train)} training "
                          f"records of {job.mind_dataset_dir}")
    steps = sched.steps
    if not config.source_of("schedule", "steps"):
        steps = config.sft.epochs * dataset.steps_per_epoch(sched.batch_size)
    return dataset, steps


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A stage's job, checked before any net is built: the stage, the train net, the data, the run's length and
    its shape (`group_size` rows a record)."""

    stage: Stage
    net: NetSpec
    dataset: StageDataset | None  # None with --check_flags (the data is not written yet)
    steps: int
    shape: StepShape
    world_size: int
    rank: int

    @classmethod
    def build(cls, config, job, tokenizer, world_size: int, rank: int) -> StagePlan:
        """Checks the flags, the train YAML and its layout, the batch split and (but with --check_flags) the data."""
        check_job_inputs(job)
        for flag in ("plan", "only_save_strategy"):
            if getattr(job, flag):
                raise ConfigError(f"--{flag} applies to the RL job only, not to --stage {job.stage}")
        stage = stage_of(job.stage, config)
        cfg = with_lora(Qwen2Config.from_yaml(job.sft_path_train), config.lora)
        check_lora_adapter(config, job)
        layout = Layout.from_config(cfg.parallel_config, world_size, rank, f"{job.sft_path_train}: parallel_config")
        sched = config.schedule
        if sched.batch_size % layout.dp:
            raise ConfigError(f"schedule.batch_size={sched.batch_size} must split evenly over the data_parallel="
                              f"{layout.dp} of {job.sft_path_train}")
        if stage.group_size > 1 and sched.micro_batch_size_per_device % stage.group_size:
            raise ConfigError(f"schedule.micro_batch_size_per_device={sched.micro_batch_size_per_device} must be a "
                              f"multiple of {stage.group_size}: a pair's two answers are scored in one call")
        if config.sft.packing and job.stage != "sft":
            raise ConfigError(f"sft.packing applies to --stage sft only, not to --stage {job.stage}")
        if config.sft.packing and layout.pp > 1:
            raise ConfigError(f"{job.sft_path_train}: sft.packing needs pipeline_stage: 1 (packed rows do not run "
                              "through pipeline stages)")
        if stage.role_name == "critic" and layout.pp > 1:
            raise ConfigError(f"{job.sft_path_train}: a reward model trains without pipeline stages here "
                              "(pipeline_stage: 1)")
        dataset, steps = (None, sched.steps) if job.check_flags else open_stage_data(stage, config, job, tokenizer,
                                                                                     cfg.seq_length)
        one_update = dataclasses.replace(sched, steps=steps, mini_batch_size=0, num_iterations=1)
        shape = StepShape.of(one_update, stage.group_size, layout.dp, layout.dp)
        check_pipeline(cfg, layout, one_update, shape.train_update_rows_per_rank, job.sft_path_train)
        check_tensor_parallel(cfg, layout.tp, job.sft_path_train)
        return cls(stage, NetSpec(cfg, layout, job.sft_path_train, job.load_sft_checkpoint_train), dataset, steps,
                   shape, world_size, rank)

    def for_rank(self, rank: int) -> StagePlan:
        return dataclasses.replace(self, net=self.net.for_rank(self.world_size, rank), rank=rank)

    def layouts(self) -> list[Layout]:
        return [self.net.layout]

    trained_layouts = layouts


class StageTrainer:
    """Builds the net, engines and checkpoints of a planned stage and runs its steps; the loss is normalised over
    each update's records whatever the layout."""

    def __init__(self, plan: StagePlan, config, job, host_sums: dict | None = None):
        self.plan, self.config, self.job, self.stage = plan, config, job, plan.stage
        self.world_size, self.rank, self.dataset = plan.world_size, plan.rank, plan.dataset
        self.layout = plan.net.layout
        cfg, layout, sched, stage = plan.net.model, plan.net.layout, config.schedule, plan.stage
        self.net = stage.build_net(cfg, layout)
        stage.load(self.net, layout, plan.net.checkpoint, job.init_seed)
        if job.load_lora_adapter:
            load_adapters(self.net, layout, job.load_lora_adapter, stage.prefix)
        self.comm = ArrayCollectives(self.world_size, self.rank)
        opt = config.optimizer
        policy = dataclasses.replace(
            update_policy(opt, dataclasses.replace(sched, steps=plan.steps), plan.shape, stage.aggregation,
                          opt.learning_rate, opt.warmup_steps, opt.max_grad_norm), token_mask=stage.token_mask)
        self.engine = TrainEngine(
            stage.name, self.net, stage.loss_net(self.net, config), adamw(opt, plan.net, self.net.trainable_params()),
            layout, cfg, MicroBatchSizer.for_pass("train", sched, cfg, layout, stage.group_size, training=True,
                                                  call_unit=stage.group_size),
            plan.shape, self.comm, policy, net_layouts(self.net, layout),
            stage_shared=self.net.stage_shared_params, dp_sums=(host_sums or {}).get(layout.dp_group))
        self.scorer = ForwardEngine(stage.scorer(self.net), MicroBatchSizer.for_pass(
            "score", sched, cfg, layout, stage.group_size, training=False, call_unit=stage.group_size),
            self.net, layout, cfg)
        self.role = StageRole(stage.role_name, self.engine, stage.role_files)
        self.checkpoints = CheckpointCoordinator([self.role], job.checkpoint_dir, self.rank, self.world_size,
                                                 self.comm.failed_ranks, {"train": str(layout)}, config.to_dict())
        self.step, self.eval_before = 0, None
        resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir) if job.resume else None
        if resume_dir:
            meta = self.checkpoints.restore(resume_dir)
            self.dataset.load_state_dict(meta["data"])
            stage.load_loop_state(self.dataset, meta.get("stage", {}))
            self.step, self.eval_before = int(meta["step"]), meta.get("eval_before")
            logger.info("resumed from %s (step %d)", resume_dir, self.step)
        with agreed(self.comm.failed_ranks, "opening the metrics"):
            self.metrics_writer = MetricsWriter(job.output_dir, job.tensorboard_dir or None, enabled=self.rank == 0,
                                                resume_step=self.step)
        logger.info("%s of %s (layout %s, %.2fM parameters): %d training and %d held-out records, %d steps of %d",
                    stage.name, job.sft_path_train, layout, cfg.num_parameters() / 1e6, len(self.dataset.train),
                    len(self.dataset.held_out), plan.steps, sched.batch_size)
        if cfg.lora.enabled:
            logger.info("%s: %s", stage.name, cfg.lora.describe(sum(p.size for p in self.net.trainable_params())))
        note = stage.data_note(self.dataset)
        if note:
            logger.info("%s", note)

    def train_one_step(self) -> dict:
        """One optimizer update on the next batch; returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        self.step += 1
        batch = self.dataset.next_batch(self.config.schedule.batch_size)
        share = RankRows.of_batch(batch, self.layout.dp, self.layout.dp_rank, batch.num_rows,
                                  token_mask=self.stage.token_mask)
        metrics = self.stage.metric_names(self.engine.update(share))
        elapsed = time.perf_counter() - start
        tokens = int(sum(batch[mask].sum() for mask in ("prompt_mask", "response_mask") if mask in batch))
        metrics.update({f"{self.stage.name}/trained_tokens": int(batch[self.stage.token_mask].sum()),
                        "timing/step": round(elapsed, 4), "e2e_tps": round(tokens / self.world_size / elapsed, 2)})
        metrics.update(memory_metrics(self.comm.all_gather(np.array([peak_rss_gib()], np.float32))))
        return metrics

    def _my_rows(self, rows) -> np.ndarray:
        """This dp rank's share of the rows of `rows`, in whole records (a pair's two answers together)."""
        unit = self.stage.group_size
        records = np.array_split(np.arange(rows.num_rows // unit), self.layout.dp)[self.layout.dp_rank]
        return (records[:, None] * unit + np.arange(unit)).reshape(-1)

    def score_rows(self, rows, per_row) -> np.ndarray:
        """`per_row(scorer outputs, rows)` of every row of `rows`, each dp rank scoring its share."""
        mine = self._my_rows(rows)
        values = np.zeros(rows.num_rows, np.float32)
        if len(mine):
            part = rows.rows(mine)
            values[mine] = per_row(self.scorer.run(part), part)
        return self.comm.group_sum(values, self.layout.dp_group)  # the other dp ranks' rows are 0 here

    def held_out_score(self) -> float:
        """The stage's held-out score (`Stage.score`), summed over the dp ranks' shares."""
        rows = self.dataset.split_rows("held_out")
        mine = rows.rows(self._my_rows(rows))
        sums = self.stage.score(self.scorer.run(mine), mine) if mine.num_rows else np.zeros(2)
        total = self.comm.group_sum(np.asarray(sums, np.float64), self.layout.dp_group)
        return float(total[0] / total[1])

    def save_checkpoint(self) -> str:
        loop = {"data": self.dataset.state_dict(), "eval_before": self.eval_before,
                "stage": self.stage.loop_state(self.dataset)}
        return self.checkpoints.save(self.step, loop, self.config.checkpoint.keep_last)

    def _evaluate_now(self) -> bool:
        interval = self.config.eval.eval_interval
        return bool(self.dataset.held_out) and (self.step == self.plan.steps or
                                                bool(interval and self.step % interval == 0))

    def _shown(self, value: float) -> str:
        return f"{100 * value:.1f}%" if self.stage.percent else f"{value:.4f}"

    def fit(self) -> list[dict]:
        """Runs the remaining steps (checkpoints every save_interval and at the end); with a held-out split, its score
        before the first step, every eval_interval steps and after the last, and a last line `<summary>: before=X
        after=Y`."""
        ckpt, history, key = self.config.checkpoint, [], self.stage.eval_key
        with agreed(self.comm.failed_ranks, f"preparing the {self.stage.name} stage"):
            self.stage.prepare(self)
        if self.dataset.held_out and self.step == 0:
            with agreed(self.comm.failed_ranks, "the held-out score"):
                self.eval_before = self.held_out_score()
                self.metrics_writer.record(0, {key: self.eval_before})
            logger.info("%s before training: %s (%d records)", self.stage.summary, self._shown(self.eval_before),
                        len(self.dataset.held_out))
        while self.step < self.plan.steps:
            metrics = self.train_one_step()
            if self._evaluate_now():
                metrics[key] = self.held_out_score()
            history.append(metrics)
            with agreed(self.comm.failed_ranks, "writing the step's metrics"):
                self.metrics_writer.write(self.step, self.plan.steps, metrics)
            if self.step == self.plan.steps or (ckpt.save_interval and self.step % ckpt.save_interval == 0):
                self.save_checkpoint()
        self.metrics_writer.close()
        if self.metrics_writer.enabled and self.metrics_writer.jsonl_path:
            png = os.path.join(os.path.dirname(self.metrics_writer.jsonl_path), "progress.png")
            plot_progress(self.metrics_writer.jsonl_path, png, self._panels())
        if history and key in history[-1] and self.eval_before is not None:
            logger.info("%s: before=%s after=%s", self.stage.summary, self._shown(self.eval_before),
                        self._shown(history[-1][key]))
        return history

    def _panels(self) -> ProgressPanels:
        return ProgressPanels((f"{self.stage.name}/loss",), f"training loss ({self.stage.name})",
                              f"{self.stage.summary} ({self.stage.eval_key})", self.stage.percent,
                              f"{self.stage.name} step")
