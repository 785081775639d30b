"""`GRPOTrainer`: the GRPO loop over a train net and an inference/reference pair in two layouts on the same ranks.

One step (each block is a phase, see :mod:`mindrlhf.trainer.phases`)::

    generate  infer net (infer layout): num_generations samples for this dp rank's prompts
    reward    rule rewards, group-normalised advantages (groups never cross ranks)
    ref       reference net (infer layout): log-probs of the sampled tokens
    old       infer net: old-policy log-probs (only when num_iterations > 1)
    train     experience gathered to every rank; num_iterations passes of mini-batch updates on the train
              net (train layout), loss normalised over each global mini-batch
    reshard   train -> infer every step, train -> ref every ref_model_sync_steps
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mindrlhf.configs.base import ConfigError, help_field
from mindrlhf.configs.grpo_configs import GRPOConfig
from mindrlhf.trainer.checkpoint import (
    INFER_STRATEGY,
    RANK_STATE,
    REF_CKPT,
    TRAIN_CKPT,
    TRAIN_STRATEGY,
    CheckpointWriter,
    check_resumable,
    find_resume_checkpoint,
    rank_dir,
    read_meta,
    read_policy_weights,
    save_parameters,
)
from mindrlhf.trainer.experience import Experience, concat_experiences, group_unit, rows_of_rank, update_chunks
from mindrlhf.trainer.phases import Phases, peak_rss_gib

logger = logging.getLogger("mindrlhf.trainer")

INFER_PREFIX = "infer."
REF_PREFIX = "ref."


@dataclass
class JobOptions:
    """Where a run reads and writes (the MindRLHF flag names), separate from the GRPO hyper-parameters."""

    sft_path_train: str = help_field("", "Model YAML of the train net; its parallel_config is the train layout.")
    sft_path_infer: str = help_field("", "Model YAML of the inference (and reference) net: the infer layout.")
    mind_dataset_dir: str = help_field("", "Prompt MindRecord written by rlhf_data.py.")
    eval_dataset_dir: str = help_field("", "Held-out prompt MindRecord: greedy accuracy before, during and after.")
    output_dir: str = help_field("output/grpo", "Logs, metrics.jsonl, strategy files.")
    save_ckpt_dir: str = help_field("", "Checkpoint folder (default: <output_dir>/checkpoints).")
    load_sft_checkpoint_train: str = help_field(
        "", "Starting policy: a full .ckpt (split onto the train layout at load time) or a trainer step folder.")
    load_sft_checkpoint_infer: str = help_field(
        "", "Inference weights; default: resharded from the train net (the usual case).")
    load_ref_checkpoint: str = help_field("", "Reference weights; default: a copy of the starting policy.")
    save_data_file: str = help_field("", "Write each step's experience as MindRecord <path>.step_<N>.mindrecord.")
    tensorboard_dir: str = help_field("", "Write TensorBoard event files here.")
    resume: str = help_field("", "'auto' (newest complete checkpoint in save_ckpt_dir, if any) or a step folder.")
    init_seed: int = help_field(0, "Seed of random weights when no checkpoint is given (tests, smoke runs).")
    only_save_strategy: bool = help_field(False, "Build the nets, write their strategy files and stop.")
    enable_compile_cache: bool = help_field(False, "MindSpore's compile cache under <output_dir>/compile_cache.")

    @property
    def checkpoint_dir(self) -> str:
        return self.save_ckpt_dir or os.path.join(self.output_dir, "checkpoints")


def _model_signature(cfg) -> dict:
    """Fields that must agree between the train and the infer nets (everything but dtypes and layout)."""
    skip = {"parallel_config", "compute_dtype", "param_init_type", "softmax_compute_type", "rotary_dtype",
            "layernorm_compute_type"}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def check_model_configs(train_cfg, infer_cfg, train_path: str, infer_path: str) -> None:
    """The train and infer YAMLs must describe the same network."""
    train_sig, infer_sig = _model_signature(train_cfg), _model_signature(infer_cfg)
    differing = [f"{k}: {train_sig[k]!r} vs {infer_sig[k]!r}" for k in train_sig if train_sig[k] != infer_sig[k]]
    if differing:
        raise ConfigError(f"{train_path} and {infer_path} describe different models ({'; '.join(differing)}); "
                          "only dtypes and parallel_config may differ")


def check_tensor_parallel(cfg, tp: int, path: str) -> None:
    for name in ("num_heads", "n_kv_heads", "vocab_size", "intermediate_size"):
        value = getattr(cfg, name)
        if value % tp:
            raise ConfigError(f"{path}: model_config.{name}={value} is not divisible by parallel_config."
                              f"model_parallel={tp}")


def _check_micro_batch_size(sched, field: str, rows: int, whose: str) -> None:
    """`schedule.<field>` (0 = auto) must divide the `rows` it splits ("responses <whose>")."""
    size = getattr(sched, field)
    if size and rows % size:
        raise ConfigError(f"schedule.{field}={size} must divide the {rows} responses {whose}")


def load_weights(net, layout, path: str, prefix: str = "") -> None:
    """Loads a full `.ckpt` (split to this rank's shards) or a trainer step folder into `net`.

    Names in the file are the plain model names (as `tools/convert_weight.py` writes them); the net's own
    names may carry `prefix`. Optimizer entries in the file are ignored. Errors name the file.
    """
    from mindrlhf.parallel.layers import load_full_state

    state = read_policy_weights(path)
    plain = {}
    for name, value in state.items():
        for known in (INFER_PREFIX, REF_PREFIX):
            if name.startswith(known):
                name = name[len(known):]
        plain[prefix + name] = value
    try:
        load_full_state(net, plain, layout)
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None


class GRPOTrainer:
    """Builds the nets, data, optimizer, reshard and swap for one job and runs GRPO steps.

    `callbacks` are called as `callback(trainer, step, metrics)` after each step (tests use them to check
    weights and the swap plan on every rank).
    """

    def __init__(self, config: GRPOConfig, job: JobOptions, tokenizer, world_size: int = 1, rank: int = 0,
                 callbacks: list[Callable] | None = None):
        import mindspore as ms

        from mindrlhf.algorithms import GRPOLossCell, get_advantage_estimator
        from mindrlhf.algorithms.policy_cells import GRPOLossNet, ResponseLogProbs
        from mindrlhf.data import PromptDataset
        from mindrlhf.generation import Generator
        from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
        from mindrlhf.parallel import INFER_WEIGHTS, OPTIMIZER_MOMENTS, REF_WEIGHTS, TRAIN_WEIGHTS, Layout
        from mindrlhf.parallel.host import HostCollectives
        from mindrlhf.parallel.layers import init_random_weights
        from mindrlhf.parallel.reshard import Resharder
        from mindrlhf.parallel.spmd import MicroBatchedTrainStep
        from mindrlhf.parallel.strategy import net_layouts
        from mindrlhf.parallel.swap import SwapManager
        from mindrlhf.reward import build_reward_fn
        from mindrlhf.trainer.optimizer import AdamW

        config.validate()
        self.config, self.job, self.tokenizer = config, job, tokenizer
        self.world_size, self.rank = world_size, rank
        self.callbacks = list(callbacks or [])
        sched, gen = config.schedule, config.generation
        G = gen.num_generations

        # ---- configs and layouts, all checked before anything is built or written
        train_cfg = Qwen2Config.from_yaml(job.sft_path_train)
        infer_cfg = Qwen2Config.from_yaml(job.sft_path_infer)
        check_model_configs(train_cfg, infer_cfg, job.sft_path_train, job.sft_path_infer)
        self.train_layout = Layout.from_config(train_cfg.parallel_config, world_size, rank,
                                               f"{job.sft_path_train}: parallel_config")
        self.infer_layout = Layout.from_config(infer_cfg.parallel_config, world_size, rank,
                                               f"{job.sft_path_infer}: parallel_config")
        check_tensor_parallel(train_cfg, self.train_layout.tp, job.sft_path_train)
        check_tensor_parallel(infer_cfg, self.infer_layout.tp, job.sft_path_infer)
        if sched.batch_size % self.infer_layout.dp:
            raise ConfigError(f"schedule.batch_size={sched.batch_size} is not divisible by the inference "
                              f"data_parallel={self.infer_layout.dp} ({job.sft_path_infer})")
        unit = group_unit(G, self.train_layout.dp)
        if sched.prompts_per_update % unit:
            raise ConfigError(f"schedule.mini_batch_size: {sched.prompts_per_update} prompts x {G} generations "
                              f"per update do not split evenly over the train data_parallel="
                              f"{self.train_layout.dp} ({job.sft_path_train})")
        _check_micro_batch_size(sched, "micro_batch_size_per_device",
                                sched.prompts_per_update * G // self.train_layout.dp,
                                f"each train rank gets per update ({sched.prompts_per_update} prompts x {G} "
                                f"generations / train data_parallel={self.train_layout.dp})")
        _check_micro_batch_size(sched, "log_prob_micro_batch_size_per_device",
                                sched.batch_size // self.infer_layout.dp * G,
                                f"each inference rank generates per round ({sched.batch_size} prompts / "
                                f"inference data_parallel={self.infer_layout.dp} x {G} generations)")
        if len(tokenizer) > train_cfg.vocab_size:
            raise ConfigError(f"{tokenizer.source}: the tokenizer has {len(tokenizer)} "
                              f"ids but {job.sft_path_train} model_config.vocab_size is {train_cfg.vocab_size}: "
                              "tokenizer and model do not belong together")
        gen = dataclasses.replace(gen, eos_token_ids=list(tokenizer.stop_token_ids),
                                  pad_token_id=int(tokenizer.pad_token_id))
        try:
            gen.check_model(infer_cfg.vocab_size, infer_cfg.seq_length)
            gen.check_model(train_cfg.vocab_size, train_cfg.seq_length)
        except ConfigError as err:
            raise ConfigError(f"{job.sft_path_infer}: {err}") from None
        self.reward_fn = build_reward_fn(config.reward.reward_funcs, config.reward.reward_weights)
        self.advantage_fn = get_advantage_estimator(config.loss.advantage_estimator)
        self.dataset = PromptDataset(job.mind_dataset_dir, sched.batch_size // self.infer_layout.dp,
                                     gen.pad_token_id, dp_rank=self.infer_layout.dp_rank,
                                     dp_size=self.infer_layout.dp, seed=sched.seed,
                                     length_buckets=gen.prompt_buckets)
        self.eval_set = load_eval_set(job.eval_dataset_dir, gen.prompt_buckets) if job.eval_dataset_dir else None
        self.eval_before: float | None = None
        resume_dir = find_resume_checkpoint(job.resume, job.checkpoint_dir) if job.resume else None

        if world_size > 1:
            self.train_layout.init_groups()
            self.infer_layout.init_groups()
        if job.enable_compile_cache:
            ms.set_context(enable_compile_cache=True,
                           compile_cache_path=os.path.join(job.output_dir, "compile_cache", f"rank_{rank}"))

        # ---- nets
        self.train_cfg, self.infer_cfg = train_cfg, infer_cfg
        self._micro_rows_logged: set[tuple] = set()
        self.train_net = Qwen2ForCausalLM(train_cfg, self.train_layout)
        self.infer_net = Qwen2ForCausalLM(infer_cfg, self.infer_layout)
        self.infer_net.update_parameters_name(INFER_PREFIX)
        self.ref_net = Qwen2ForCausalLM(infer_cfg, self.infer_layout)
        self.ref_net.update_parameters_name(REF_PREFIX)
        self.train_strategy = net_layouts(self.train_net, self.train_layout)
        self.infer_strategy = net_layouts(self.infer_net, self.infer_layout)
        self.ref_strategy = net_layouts(self.ref_net, self.infer_layout)
        if job.only_save_strategy:
            return

        if job.load_sft_checkpoint_train:
            load_weights(self.train_net, self.train_layout, job.load_sft_checkpoint_train)
        else:
            init_random_weights(self.train_net, self.train_layout, seed=job.init_seed)
        self.optimizer = AdamW(self.train_net.trainable_params(), learning_rate=config.optimizer.learning_rate,
                               beta1=config.optimizer.beta1, beta2=config.optimizer.beta2, eps=config.optimizer.eps,
                               weight_decay=config.optimizer.weight_decay)
        loss_cell = GRPOLossCell(beta=config.loss.beta, epsilon_low=config.loss.epsilon_low,
                                 epsilon_high=config.loss.epsilon_high, kl_estimator=config.loss.kl_estimator)
        self.train_step = MicroBatchedTrainStep(GRPOLossNet(self.train_net, loss_cell, gen.temperature),
                                                self.optimizer, self.train_layout, grad_reduction="sum",
                                                max_grad_norm=config.optimizer.max_grad_norm)
        self.to_infer = Resharder(self.train_net, self.infer_net, self.train_strategy, self.infer_strategy,
                                  {n: INFER_PREFIX + n for n in self.train_strategy}, rank=rank)
        self.to_ref = Resharder(self.train_net, self.ref_net, self.train_strategy, self.ref_strategy,
                                {n: REF_PREFIX + n for n in self.train_strategy}, rank=rank)
        self.ref_log_probs = ResponseLogProbs(self.ref_net, gen.temperature)
        self.old_log_probs = ResponseLogProbs(self.infer_net, gen.temperature)

        self.swap = SwapManager()
        self.swap.register(TRAIN_WEIGHTS, self.train_net.trainable_params())
        self.swap.register(OPTIMIZER_MOMENTS, self.optimizer_state())
        self.swap.register(INFER_WEIGHTS, self.infer_net.trainable_params())
        self.swap.register(REF_WEIGHTS, self.ref_net.trainable_params())
        self.phases = Phases(self.swap)
        self.comm = HostCollectives(world_size, rank)
        self.generator = Generator(self.infer_net, gen)
        self.generator.rng = np.random.default_rng([gen.seed, self.infer_layout.dp_rank])
        self.eval_generator = Generator(self.infer_net, dataclasses.replace(
            gen, do_sample=False, num_generations=1,
            max_new_tokens=config.eval.eval_max_new_tokens or gen.max_new_tokens))
        self.step = 0
        self.updates = 0

        # ---- initial weights of the inference and reference nets
        if job.load_sft_checkpoint_infer:
            load_weights(self.infer_net, self.infer_layout, job.load_sft_checkpoint_infer, INFER_PREFIX)
        else:
            self.to_infer.run()
        if job.load_ref_checkpoint:
            load_weights(self.ref_net, self.infer_layout, job.load_ref_checkpoint, REF_PREFIX)
        else:
            self.to_ref.run()
        if resume_dir:
            self._resume(resume_dir)
        from mindrlhf.trainer.metrics import MetricsWriter
        self.metrics_writer = MetricsWriter(job.output_dir, job.tensorboard_dir or None, enabled=rank == 0,
                                            resume_step=self.step)
        self.ckpt_writer = CheckpointWriter(job.checkpoint_dir, rank, world_size, self.comm.barrier)
        logger.info("train layout %s, infer layout %s, %d ranks; policy %.2fM parameters; %d prompts, global "
                    "batch %d x %d generations", self.train_layout, self.infer_layout, world_size,
                    train_cfg.num_parameters() / 1e6, self.dataset.num_samples, sched.batch_size, G)

    # ------------------------------------------------------------------ state
    def optimizer_state(self) -> list:
        """The AdamW moments and step counter (what the swap and the checkpoints handle besides weights)."""
        trained = {id(p) for p in self.train_net.trainable_params()}
        return [p for p in self.optimizer.get_parameters() if id(p) not in trained]

    def save_strategies(self, folder: str) -> dict[str, str]:
        """Writes the strategy file of each net for this rank under `folder/<net>/`; returns the paths."""
        from mindrlhf.parallel.strategy import strategy_file_name, write_strategy_file

        paths = {}
        for net, layouts in (("train", self.train_strategy), ("infer", self.infer_strategy),
                             ("ref", self.ref_strategy)):
            paths[net] = write_strategy_file(os.path.join(folder, net, strategy_file_name(self.rank)), layouts)
        return paths

    def _layouts_meta(self) -> dict:
        return {"train": str(self.train_layout), "infer": str(self.infer_layout)}

    def save_checkpoint(self) -> str:
        """Writes a checkpoint of the current step (every rank must call it)."""
        from mindrlhf.parallel.strategy import write_strategy_file

        def rank_files(folder: str) -> None:
            save_parameters(list(self.train_net.trainable_params()) + self.optimizer_state(),
                            os.path.join(folder, TRAIN_CKPT))
            save_parameters(self.ref_net.trainable_params(), os.path.join(folder, REF_CKPT))
            _write_json(os.path.join(folder, RANK_STATE), {"generator_rng": self.generator.rng.bit_generator.state})

        def shared_files(folder: str) -> None:
            write_strategy_file(os.path.join(folder, TRAIN_STRATEGY), self.train_strategy)
            write_strategy_file(os.path.join(folder, INFER_STRATEGY), self.ref_strategy)

        meta = {"step": self.step, "updates": self.updates, "world_size": self.world_size,
                "layouts": self._layouts_meta(), "data": self.dataset.state_dict(), "config": self.config.to_dict(),
                "eval_before": self.eval_before}
        path = self.ckpt_writer.save(self.step, rank_files, shared_files, meta, self.config.checkpoint.keep_last)
        logger.info("checkpoint written: %s", path)
        return path

    def _resume(self, step_dir: str) -> None:
        import json

        import mindspore as ms

        meta = read_meta(step_dir)
        check_resumable(step_dir, meta, self.world_size, self._layouts_meta(), self.config.to_dict())
        folder = rank_dir(step_dir, self.rank)
        train_state = ms.load_checkpoint(os.path.join(folder, TRAIN_CKPT))
        for param in list(self.train_net.trainable_params()) + self.optimizer_state():
            if param.name not in train_state or tuple(train_state[param.name].shape) != tuple(param.shape):
                raise ConfigError(f"{os.path.join(folder, TRAIN_CKPT)}: '{param.name}' missing or of another shape")
            param.set_data(train_state[param.name])
        ms.load_param_into_net(self.ref_net, ms.load_checkpoint(os.path.join(folder, REF_CKPT)), strict_load=True)
        with open(os.path.join(folder, RANK_STATE), encoding="utf-8") as f:
            self.generator.rng.bit_generator.state = json.load(f)["generator_rng"]
        self.dataset.load_state_dict(meta["data"])
        self.step, self.updates = int(meta["step"]), int(meta["updates"])
        self.eval_before = meta.get("eval_before")
        self.to_infer.run()
        logger.info("resumed from %s (step %d)", step_dir, self.step)

    # ------------------------------------------------------------------ one step
    def _rollout(self) -> tuple[Experience, dict]:
        """One generation round for this rank's prompts, scored and with ref (and old) log-probs."""
        G = self.generator.config.num_generations
        batch = self.dataset.next_batch()
        with self.phases("generate"):
            out = self.generator.generate(batch["prompt_ids"], batch["attention_mask"], return_log_probs=True,
                                          progress=self.rank == 0, min_prompt_width=batch["prompt_ids"].shape[1])
        with self.phases("reward"):
            completions = self.tokenizer.batch_decode(
                [ids[mask.astype(bool)].tolist() for ids, mask in zip(out.response_ids, out.response_mask)],
                skip_special_tokens=True)
            solutions = [s for s in batch["solution"] for _ in range(G)]
            rewards, terms = self.reward_fn(completions, solutions)
            advantages = self.advantage_fn(rewards, G, eps=self.config.loss.advantage_eps)
        inputs = (out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
        with self.phases("ref"):
            ref_logp = self._log_probs(self.ref_log_probs, inputs)
        old_logp = out.log_probs
        if self.config.schedule.num_iterations > 1:
            with self.phases("old"):
                old_logp = self._log_probs(self.old_log_probs, inputs)
        mask = out.response_mask.astype(np.float32)
        experience = Experience(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                (old_logp * mask).astype(np.float32), (ref_logp * mask).astype(np.float32),
                                rewards.astype(np.float32), advantages.astype(np.float32),
                                {k: np.asarray(v, np.float32) for k, v in terms.items()})
        return experience, {"sample": completions[0]}

    def _micro_rows(self, kind: str, rows: int, prompt_width: int, response_width: int) -> int:
        """Rows per graph call of the `kind` ("train" or "log_prob") pass: the configured micro-batch size, or
        (0) the most rows whose estimated activations fit schedule.activation_memory_gib."""
        from mindrlhf.trainer import memory_budget

        sched = self.config.schedule
        configured = sched.micro_batch_size_per_device if kind == "train" else \
            sched.log_prob_micro_batch_size_per_device
        if configured:
            return configured
        cfg, tp = (self.train_cfg, self.train_layout.tp) if kind == "train" else (self.infer_cfg, self.infer_layout.tp)
        tokens = prompt_width + response_width - 1
        shape = dict(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                     vocab=cfg.vocab_size, tp=tp)
        if kind == "train":
            per_row = memory_budget.train_bytes_per_row(tokens, response_width, layers=cfg.num_layers, **shape)
        else:
            per_row = memory_budget.log_prob_bytes_per_row(tokens, response_width, **shape)
        chosen = memory_budget.rows_per_call(rows, per_row, int(sched.activation_memory_gib * 2**30))
        if (kind, rows, tokens, chosen) not in self._micro_rows_logged:
            self._micro_rows_logged.add((kind, rows, tokens, chosen))
            logger.info("%s micro-batches: %d of %d rows per call (auto: ~%.0f MiB of activations a row at %d "
                        "tokens, schedule.activation_memory_gib=%g)", kind, chosen, rows, per_row / 2**20, tokens,
                        sched.activation_memory_gib)
        return chosen

    def _log_probs(self, cell, arrays) -> np.ndarray:
        """`cell`'s response log-probs of the rows of `arrays` (prompt ids, prompt mask, response ids, response
        mask), a micro-batch of rows per call (`_micro_rows`)."""
        from mindrlhf.parallel.spmd import split_micro_batches

        size = self._micro_rows("log_prob", len(arrays[0]), arrays[0].shape[1], arrays[2].shape[1])
        return np.concatenate([cell(*micro_batch).asnumpy() for micro_batch in split_micro_batches(arrays, size)])

    def _gather(self, local: Experience) -> Experience:
        return local.unpack(self.comm.gather_data_parallel_rows(local.pack(), self.infer_layout))

    def _collect_experience(self) -> tuple[Experience, Experience, dict]:
        """(all generated rows, the rows to train on, sampling stats), on every rank."""
        from mindrlhf.algorithms import dynamic_sampling_mask, expand_group_mask

        sched, G = self.config.schedule, self.generator.config.num_generations
        rounds, kept_parts, all_parts = 0, [], []
        kept_groups = 0
        while True:
            local, _ = self._rollout()
            with self.phases("train"):
                round_exp = self._gather(local)
            rounds += 1
            all_parts.append(round_exp)
            if not sched.dynamic_sampling:
                kept_parts.append(round_exp)
                break
            keep = dynamic_sampling_mask(round_exp.rewards, G)
            if keep.any():
                kept_parts.append(round_exp.rows(expand_group_mask(keep, G)))
                kept_groups += int(keep.sum())
            if kept_groups >= sched.batch_size or rounds > sched.max_sampling_retries:
                break
        pad = self.generator.config.pad_token_id
        generated = concat_experiences(all_parts, pad)
        stats = {"sampling/rounds": rounds}
        if not kept_parts:
            return generated, generated.rows(slice(0, 0)), {**stats, "sampling/kept_groups": 0}
        train = concat_experiences(kept_parts, pad)
        groups = min(train.num_rows // G, sched.batch_size)
        groups -= groups % group_unit(G, self.train_layout.dp)
        train = train.rows(slice(0, groups * G))
        if sched.dynamic_sampling:
            stats["sampling/kept_groups"] = groups
        return generated, train, stats

    def _train(self, exp: Experience) -> dict:
        """num_iterations passes of mini-batch updates; returns the averaged actor metrics."""
        from mindrlhf.algorithms import aggregation_weights
        from mindrlhf.algorithms.policy_cells import GRPO_OUTPUT_NAMES
        from mindrlhf.parallel.spmd import split_micro_batches
        from mindrlhf.trainer.optimizer import learning_rate_at

        cfg, G = self.config, self.generator.config.num_generations
        layout = self.train_layout
        sums: dict[str, float] = {}
        count = 0
        total_updates = self._total_updates()
        for _ in range(cfg.schedule.num_iterations):
            for chunk in update_chunks(exp.num_rows // G, cfg.schedule.prompts_per_update, G):
                part = exp.rows(chunk)
                weights = aggregation_weights(part.response_mask, cfg.loss.aggregation).astype(np.float32)
                mine = rows_of_rank(part.num_rows, layout.dp, layout.dp_rank)
                lr = learning_rate_at(self.updates, cfg.optimizer.learning_rate, cfg.optimizer.warmup_steps,
                                      total_updates, cfg.optimizer.lr_schedule, cfg.optimizer.min_lr_ratio)
                self.optimizer.set_learning_rate(lr)
                inputs = [part.prompt_ids[mine], part.prompt_mask[mine], part.response_ids[mine],
                          part.response_mask[mine], part.old_logp[mine], part.ref_logp[mine],
                          part.advantages[mine], weights[mine]]
                size = self._micro_rows("train", len(inputs[0]), inputs[0].shape[1], inputs[2].shape[1])
                shares, grad_norm = self.train_step(split_micro_batches(inputs, size))
                values = self.comm.group_sum(shares.astype(np.float32), layout.dp_group)
                for name, value in zip(GRPO_OUTPUT_NAMES, values):
                    sums[name] = sums.get(name, 0.0) + float(value)
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + grad_norm
                self.updates += 1
                count += 1
                last_lr = lr
        if not count:
            return {"actor/updates": 0}
        metrics = {name: value / count for name, value in sums.items()}
        metrics["actor/lr"] = last_lr
        metrics["actor/updates"] = count
        return metrics

    def _total_updates(self) -> int:
        sched = self.config.schedule
        return sched.steps * sched.num_iterations * math.ceil(sched.batch_size / sched.prompts_per_update)

    def train_one_step(self) -> dict:
        """Runs one GRPO step; returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        self.phases.start_step()
        self.step += 1
        generated, train_exp, sampling = self._collect_experience()
        with self.phases("train"):
            actor = self._train(train_exp)
        sync_ref = bool(self.config.schedule.ref_model_sync_steps) and \
            self.step % self.config.schedule.ref_model_sync_steps == 0
        from mindrlhf.parallel.swap import REF_WEIGHTS
        with self.phases("reshard", also_resident=(REF_WEIGHTS,) if sync_ref else ()):
            self.to_infer.run()
            if sync_ref:
                self.to_ref.run()
        elapsed = time.perf_counter() - start
        metrics = self._step_metrics(generated, actor, sampling, elapsed)
        if self.job.save_data_file and self.rank == 0:
            write_experience(f"{self.job.save_data_file}.step_{self.step:06d}.mindrecord", generated)
        return metrics

    def _step_metrics(self, generated: Experience, actor: dict, sampling: dict, elapsed: float) -> dict:
        G = self.generator.config.num_generations
        rewards = generated.rewards.astype(np.float64)
        lengths = generated.response_mask.sum(axis=1)
        max_new = generated.response_mask.shape[1]
        eos = np.isin(generated.response_ids[np.arange(len(lengths)), np.maximum(lengths - 1, 0)],
                      self.generator.config.eos_token_ids)
        grouped = rewards.reshape(-1, G)
        metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std())}
        metrics.update({f"reward/{k}": float(v.mean()) for k, v in generated.reward_terms.items()})
        metrics["reward/frac_zero_std"] = float((grouped.max(axis=1) == grouped.min(axis=1)).mean())
        metrics.update(actor)
        metrics.update({"response_length/mean": float(lengths.mean()), "response_length/max": int(lengths.max()),
                        "response_length/clip_ratio": float(((lengths == max_new) & ~eos).mean())})
        metrics.update(sampling)
        metrics.update(self.phases.step_metrics())
        metrics["timing_s/step"] = round(elapsed, 4)
        tokens = int(generated.prompt_mask.sum() + lengths.sum())
        metrics["perf/tokens_per_s_per_device"] = round(tokens / self.world_size / elapsed, 2)
        peaks = self.comm.all_gather(np.array([peak_rss_gib()], np.float32))
        metrics["perf/max_rss_gib"] = round(float(peaks.max()), 3)
        return metrics

    def evaluate(self) -> float:
        """Greedy accuracy on every held-out prompt (`--eval_dataset_dir`), split over the infer dp ranks."""
        from mindrlhf.trainer.evaluation import count_correct

        prompts, solutions = self.eval_set
        layout = self.infer_layout
        mine = np.array_split(np.arange(len(prompts)), layout.dp)[layout.dp_rank]
        with self.phases("eval"):
            correct = count_correct(self.eval_generator, self.tokenizer, [prompts[i] for i in mine],
                                    [solutions[i] for i in mine], self.config.eval.eval_batch_size,
                                    progress=self.rank == 0)
        totals = self.comm.group_sum(np.array([correct, len(mine)]), layout.dp_group)
        return float(totals[0] / totals[1])

    def _evaluate_now(self) -> bool:
        interval = self.config.eval.eval_interval
        return self.eval_set is not None and (self.step == self.config.schedule.steps or
                                              bool(interval and self.step % interval == 0))

    def fit(self) -> list[dict]:
        """Runs the remaining steps (checkpoints every save_interval and at the end); returns their metrics.

        With an eval set: held-out accuracy before the first step, every eval_interval steps and after the
        last one (`eval/accuracy`), and a final line `held-out accuracy: before=.. after=..`."""
        sched, ckpt = self.config.schedule, self.config.checkpoint
        history = []
        if self.eval_set is not None and self.step == 0:
            start = time.perf_counter()
            self.eval_before = self.evaluate()
            self.metrics_writer.record(0, {"eval/accuracy": self.eval_before,
                                           "timing_s/eval": round(time.perf_counter() - start, 4)})
            logger.info("held-out accuracy before training: %.1f%% (%d prompts)", 100 * self.eval_before,
                        len(self.eval_set[0]))
        if self.step >= sched.steps:
            logger.info("nothing to do: the checkpoint is at step %d of %d", self.step, sched.steps)
        while self.step < sched.steps:
            metrics = self.train_one_step()
            if self._evaluate_now():
                start = time.perf_counter()
                metrics["eval/accuracy"] = self.evaluate()
                metrics["timing_s/eval"] = round(time.perf_counter() - start, 4)
            history.append(metrics)
            self.metrics_writer.write(self.step, sched.steps, metrics)
            for callback in self.callbacks:
                callback(self, self.step, metrics)
            if self.step == sched.steps or (ckpt.save_interval and self.step % ckpt.save_interval == 0):
                self.save_checkpoint()
        self.metrics_writer.close()
        if self.metrics_writer.enabled and self.metrics_writer.jsonl_path:
            from mindrlhf.trainer.plot import plot_progress

            png = os.path.join(os.path.dirname(self.metrics_writer.jsonl_path), "progress.png")
            plot_progress(self.metrics_writer.jsonl_path, png)
            logger.info("plot of reward and held-out accuracy: %s", png)
        logger.info("%s", self.swap.summary())
        if history and "eval/accuracy" in history[-1] and self.eval_before is not None:
            logger.info("held-out accuracy: before=%.1f%% after=%.1f%%", 100 * self.eval_before,
                        100 * history[-1]["eval/accuracy"])
        return history


def load_eval_set(path: str, prompt_buckets) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, solutions) of a held-out prompt MindRecord; errors name the file."""
    from mindrlhf.data.reader import read_prompt_records

    try:
        ids, solutions = read_prompt_records(path)
    except (OSError, RuntimeError, ValueError) as err:
        raise ConfigError(f"{path}: cannot read the eval MindRecord ({str(err).splitlines()[0]})") from None
    if not ids:
        raise ConfigError(f"{path}: the eval MindRecord holds no prompt")
    longest = max(len(row) for row in ids)
    if prompt_buckets and longest > max(prompt_buckets):
        raise ConfigError(f"{path}: an eval prompt has {longest} tokens, more than the largest prompt bucket "
                          f"{max(prompt_buckets)} (generation.prompt_buckets)")
    return [row.tolist() for row in ids], solutions


def _write_json(path: str, data: dict) -> None:
    import json
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


EXPERIENCE_SCHEMA = {
    "prompt_ids": {"type": "int32", "shape": [-1]}, "response_ids": {"type": "int32", "shape": [-1]},
    "response_mask": {"type": "int32", "shape": [-1]}, "ref_logp": {"type": "float32", "shape": [-1]},
    "old_logp": {"type": "float32", "shape": [-1]}, "reward": {"type": "float32"}, "advantage": {"type": "float32"},
}


def write_experience(path: str, exp: Experience) -> None:
    """One step's experience as MindRecord (real prompt tokens only; responses padded to the step's width)."""
    from mindrlhf.data.mindrecord import write_mindrecord_atomically

    records = []
    for i in range(exp.num_rows):
        records.append({"prompt_ids": exp.prompt_ids[i][exp.prompt_mask[i].astype(bool)].astype(np.int32),
                        "response_ids": exp.response_ids[i].astype(np.int32),
                        "response_mask": exp.response_mask[i].astype(np.int32),
                        "ref_logp": exp.ref_logp[i].astype(np.float32), "old_logp": exp.old_logp[i].astype(np.float32),
                        "reward": float(exp.rewards[i]), "advantage": float(exp.advantages[i])})
    write_mindrecord_atomically(records, path, "mindrlhf GRPO experience", schema=EXPERIENCE_SCHEMA)
