"""Roles of an RL job (actor, reference, reward, critic): each owns its nets, layouts, optimizer, swap
groups, strategy files and checkpoint state, so the loop only sequences phases and moves experience.

A role declares:
    swap_groups()      group name -> parameters (registered with the job's `SwapManager`)
    resident_in        phase -> its groups that must be on device in that phase (all others are offloaded)
    strategies()       net name -> per-parameter layouts (`--only_save_strategy` writes them; a net in
                       pipeline stages: this rank's stage, `strategy_stage`)
    checkpoint_files   rank file name -> parameters, and shared strategy file name -> (layouts, stages)
    rank_state()       JSON-able per-rank state (random streams), restored by `load_rank_state`
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from mindrlhf.configs.base import ConfigError
from mindrlhf.trainer.checkpoint import (
    CRITIC_CKPT,
    CRITIC_PREFIX,
    CRITIC_STRATEGY,
    INFER_STRATEGY,
    REF_CKPT,
    TRAIN_CKPT,
    TRAIN_STRATEGY,
    read_policy_weights,
)

logger = logging.getLogger("mindrlhf.trainer")

# Swap groups (names as they appear in the swap log and the phase plan)
TRAIN_WEIGHTS = "train_weights"
OPTIMIZER_MOMENTS = "optimizer_moments"
INFER_WEIGHTS = "infer_weights"
REF_WEIGHTS = "ref_weights"
CRITIC_WEIGHTS = "critic_weights"
CRITIC_MOMENTS = "critic_moments"
REWARD_MODEL_WEIGHTS = "reward_model_weights"

INFER_PREFIX = "infer."
REF_PREFIX = "ref."
REWARD_MODEL_PREFIX = "reward_model."
VALUE_HEAD = "score.weight"
VALUE_HEAD_BIAS = "score.bias"


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


def load_value_model(net, layout, state: dict, source: str, prefix: str, yaml_path: str) -> None:
    """Loads the backbone and value head of `state` (from `source`) into the value model `net` (names with
    `prefix`); the head's bias must be there exactly when `yaml_path` declares `value_head_bias`."""
    from mindrlhf.parallel.layers import load_full_state

    if VALUE_HEAD not in state:
        raise ConfigError(f"{source}: no value head '{VALUE_HEAD}' (expected a critic or a reward model converted by "
                          "tools/convert_weight.py)")
    has_bias, wants_bias = VALUE_HEAD_BIAS in state, net.config.value_head_bias
    if has_bias != wants_bias:
        raise ConfigError(f"{source}: the value head {'has' if has_bias else 'has no'} bias '{VALUE_HEAD_BIAS}' "
                          f"({'a *ForTokenClassification' if has_bias else 'a *ForSequenceClassification'}), but "
                          f"{yaml_path} sets model_config.value_head_bias: {str(wants_bias).lower()}")
    wanted = {prefix + name: value for name, value in state.items()
              if name.startswith("model.") or name in (VALUE_HEAD, VALUE_HEAD_BIAS)}
    try:
        load_full_state(net, wanted, layout)
    except ValueError as err:
        raise ConfigError(f"{source}: {err} ({yaml_path})") from None


def load_rank_params(params, path: str) -> None:
    """Sets `params` from this rank's checkpoint file `path`; every one must be there with its shape."""
    import mindspore as ms

    state = ms.load_checkpoint(path)
    for param in params:
        if param.name not in state or tuple(state[param.name].shape) != tuple(param.shape):
            raise ConfigError(f"{path}: '{param.name}' missing or of another shape")
        param.set_data(state[param.name])


class NonFiniteUpdates(RuntimeError):
    """Too many optimizer updates in a row had a NaN/inf loss or gradient (`optimizer.max_consecutive_skips`)."""


class MicroBatchSizer:
    """How one pass splits a rank's rows into graph calls: `plan` gives the responses per call (the configured size,
    `micro_batches` equal micro-batches for a train net in pipeline stages (its `micro_batch_num`), or (0) the most
    responses whose estimated activations fit `schedule.activation_memory_gib`, `mindrlhf.trainer.memory_budget`),
    how many of them share each prompt read (up to `share_limit`, a prompt's responses, when
    `schedule.share_prompts`; 1 reads the prompt again for every response) and the response width the calls read
    (the narrowest of `schedule.response_buckets` widths that holds the longest response); the choice is logged once
    per shape."""

    def __init__(self, kind: str, configured: int, model_config, tp: int, budget_gib: float, micro_batches: int = 0,
                 share_limit: int = 1, response_buckets: int = 1):
        self.kind, self.configured, self.model_config, self.tp = kind, configured, model_config, tp
        self.budget_gib, self.micro_batches, self.share_limit = budget_gib, micro_batches, share_limit
        self.response_buckets = response_buckets
        self._logged: set[tuple] = set()

    @classmethod
    def for_pass(cls, kind: str, schedule, model_config, layout, group_size: int, training: bool) -> MicroBatchSizer:
        """The sizer of a net in `layout` whose rows come in groups of `group_size` responses to one prompt: for
        training its `micro_batch_num` micro-batches with pipeline stages, else
        `schedule.micro_batch_size_per_device`; for a forward pass `schedule.log_prob_micro_batch_size_per_device`
        (0: from the memory budget)."""
        stages_split = model_config.parallel_config.micro_batch_num if training and layout.pp > 1 else 0
        configured = schedule.micro_batch_size_per_device if training else schedule.log_prob_micro_batch_size_per_device
        return cls(kind, configured, model_config, layout.tp, schedule.activation_memory_gib, stages_split,
                   group_size if schedule.share_prompts else 1, schedule.response_buckets)

    def _call_bytes(self, prompts: int, rows: int, prompt_width: int, response_width: int) -> int:
        from mindrlhf.trainer import memory_budget

        cfg = self.model_config
        shape = dict(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                     vocab=cfg.vocab_size, tp=self.tp)
        if self.kind.endswith("train"):
            return memory_budget.train_bytes(prompts, rows, prompt_width, response_width, layers=cfg.num_layers,
                                             **shape)
        return memory_budget.log_prob_bytes(prompts, rows, prompt_width, response_width, **shape)

    def width(self, response_mask: np.ndarray) -> int:
        """The response width calls over the rows of `response_mask` read (`experience.trimmed_width`)."""
        from mindrlhf.trainer.experience import response_widths, trimmed_width

        return trimmed_width(response_mask, response_widths(response_mask.shape[1], self.response_buckets))

    def plan(self, arrays, width: int | None = None) -> tuple[int, int, int]:
        """(responses per call, responses per prompt read, response width) for `arrays` (prompt ids, prompt mask,
        response ids, response mask, ...: one row per response); `width` (default: `self.width` of these rows)
        lets a caller read as many positions on every data-parallel rank."""
        from mindrlhf.trainer import memory_budget
        from mindrlhf.trainer.experience import shared_prompt_run

        prompt_ids, prompt_mask = arrays[0], arrays[1]
        rows, prompt_width = len(prompt_ids), prompt_ids.shape[1]
        width = width or self.width(arrays[3])
        run = shared_prompt_run(prompt_ids, prompt_mask, self.share_limit) if self.share_limit > 1 else 1
        if self.micro_batches:
            size = math.ceil(rows / self.micro_batches)
        elif self.configured:
            size = self.configured
        else:
            size = memory_budget.rows_per_call(
                rows, lambda d: self._call_bytes(d // math.gcd(d, run), d, prompt_width, width),
                int(self.budget_gib * 2**30))
        share = math.gcd(size, run)
        if (rows, prompt_width, width, size, share) not in self._logged:
            self._logged.add((rows, prompt_width, width, size, share))
            estimate = self._call_bytes(size // share, size, prompt_width, width) / 2**20
            how = f"auto, schedule.activation_memory_gib={self.budget_gib:g}" if not (self.micro_batches or
                                                                                      self.configured) else "set"
            logger.info("%s micro-batches: %d of %d responses per call, %d per prompt read (%d + %d of %d tokens; "
                        "~%.0f MiB of activations a call; %s)", self.kind, size, rows, share, prompt_width, width,
                        arrays[2].shape[1], estimate, how)
        return size, share, width

    def split(self, arrays, width: int | None = None) -> list[list]:
        """The graph calls' inputs for the rows of `arrays` (`experience.prompt_micro_batches` of `plan`, the
        per-token columns cut to its width)."""
        from mindrlhf.trainer.experience import prompt_micro_batches, trim_responses

        size, share, width = self.plan(arrays, width)
        return prompt_micro_batches(trim_responses(arrays, width), size, share)

    def run(self, cell, arrays) -> np.ndarray:
        """`cell` on the rows of `arrays` (prompt ids, prompt mask, response ids, response mask), a micro-batch
        of rows per call, outputs concatenated (per-token outputs padded back to the responses' width with zeros);
        a pass through pipeline stages (`PipelineForward`) gets all the micro-batches at once, so that its stages
        overlap."""
        micro_batches = self.split(arrays)
        outputs = cell.map(micro_batches) if hasattr(cell, "map") else [cell(*inputs) for inputs in micro_batches]
        out = np.concatenate([output.asnumpy() for output in outputs])
        full = arrays[2].shape[1]
        if out.ndim == 2 and out.shape[1] < full:
            out = np.pad(out, ((0, 0), (0, full - out.shape[1])))
        return out


class Role:
    """Base of the roles: no nets, nothing to swap, checkpoint or restore."""

    name = "role"
    resident_in: dict[str, tuple[str, ...]] = {}
    swap = None

    def attach(self, swap) -> None:
        """Registers the role's swap groups with the job's `SwapManager`; its nets then check residency."""
        for group, params in self.swap_groups().items():
            swap.register(group, params)
        self.swap = swap

    def require(self, groups: tuple[str, ...], operation: str) -> None:
        """Raises `SwapError` when one of `groups` is offloaded (a phase plan that forgot a net)."""
        if self.swap is not None:
            self.swap.check_resident(groups, f"{self.name}.{operation}")

    def swap_groups(self) -> dict[str, list]:
        return {}

    def strategies(self) -> dict[str, dict]:
        return {}

    def rank_files(self) -> dict[str, list]:
        """Per-rank checkpoint file name -> the parameters saved in it."""
        return {}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        """Checkpoint strategy file name -> (layouts, parameter name -> pipeline stage or None), written once, by
        rank 0."""
        return {}

    def strategy_stage(self, net: str) -> int:
        """The pipeline stage of this rank's part of `net` (0 for nets without stages)."""
        del net
        return 0

    def rank_state(self) -> dict:
        return {}

    def load_rank_state(self, state: dict) -> None:
        del state

    def after_resume(self) -> None:
        """Called once every role has loaded its checkpoint state."""


def strategy_file(name: str, strategy: dict, stages) -> dict[str, tuple[dict, dict | None]]:
    """`Role.shared_files` entry of a trained net's strategy file: its layouts (`strategy`), or with pipeline
    stages (`stages`, what `gather_stage_layouts` returned) every stage's layouts and the stage of each name."""
    if stages:
        layouts, stage_of, _ = stages
        return {name: (layouts, stage_of)}
    return {name: (strategy, None)}


def pipeline_train_step(net, loss_net, optimizer, layout, model_cfg, strategy: dict, num_inputs: int,
                        num_outputs: int, max_grad_norm: float, stage_shared=()):
    """The train step of a trained net in pipeline stages (`PipelineTrainStep`): `loss_net` on the last stage, the
    response positions' hidden states of `net` on the others; returns (every stage's layouts for the
    checkpoints, what `gather_stage_layouts` gives; the step)."""
    from mindrlhf.algorithms.policy_cells import ResponseHidden, response_hidden_shape
    from mindrlhf.parallel.layers import to_ms_dtype
    from mindrlhf.parallel.pipeline import PipelineTrainStep, gather_stage_layouts

    stages = gather_stage_layouts(strategy, {p.name: p.dtype for p in net.get_parameters()}, layout)
    stage_net = loss_net if layout.stage == layout.pp - 1 else ResponseHidden(net)
    step = PipelineTrainStep(stage_net, optimizer, layout, response_hidden_shape(model_cfg.hidden_size),
                             to_ms_dtype(model_cfg.compute_dtype), num_inputs=num_inputs, forward_inputs=4,
                             num_outputs=num_outputs, grad_reduction="sum", max_grad_norm=max_grad_norm,
                             stage_shared=stage_shared)
    return stages, step


def phase_plan(roles, phases) -> dict[str, tuple[str, ...]]:
    """Phase -> the swap groups resident in it: the union of what each role declares (`Role.resident_in`)."""
    plan: dict[str, tuple[str, ...]] = {phase: () for phase in phases}
    for role in roles:
        for phase, groups in role.resident_in.items():
            plan[phase] = plan.get(phase, ()) + tuple(groups)
    return plan


def actor_residency(infer_group: str) -> dict[str, tuple[str, ...]]:
    """The actor's phase -> resident groups, its inference net's weights being `infer_group` (`TRAIN_WEIGHTS`
    when it uses the train net's)."""
    infer = (infer_group,)
    return {"generate": infer, "eval": infer, "old": infer, "train": (TRAIN_WEIGHTS, OPTIMIZER_MOMENTS),
            "reshard": tuple(dict.fromkeys((TRAIN_WEIGHTS, infer_group)))}


def shares_train_weights(train_cfg, infer_cfg, train_layout, infer_layout, infer_checkpoint: str,
                         train_checkpoint: str) -> bool:
    """Whether the inference net can be the train net itself: the same architecture, dtypes and layout (the
    same shards on every rank), and no inference checkpoint of its own."""
    same_model = dataclasses.replace(train_cfg, parallel_config=None) == \
        dataclasses.replace(infer_cfg, parallel_config=None)
    own_weights = bool(infer_checkpoint) and infer_checkpoint != train_checkpoint
    return same_model and train_layout == infer_layout and not own_weights


class Actor(Role):
    """The policy: a train net (train layout, possibly in pipeline stages) with AdamW and the GRPO loss, an
    inference net (infer layout) with the sampling generator, and the online train -> infer reshard.

    When both nets would hold the same shards (`shares_train_weights`), the inference net is the train net: one
    set of weights, nothing to reshard, and the inference phases keep `TRAIN_WEIGHTS` resident."""

    name = "actor"
    resident_in = actor_residency(INFER_WEIGHTS)

    def __init__(self, config, job, train_cfg, infer_cfg, train_layout, infer_layout, generation, rank: int):
        from mindrlhf.models.qwen2 import Qwen2ForCausalLM
        from mindrlhf.parallel.strategy import net_layouts

        self.config, self.job, self.rank = config, job, rank
        self.train_cfg, self.infer_cfg = train_cfg, infer_cfg
        self.train_layout, self.infer_layout = train_layout, infer_layout
        self.generation = generation
        self.updates = 0  # optimizer updates so far (the learning-rate schedule's position)
        self.consecutive_skips = 0  # updates skipped in a row for a non-finite loss or gradient
        self.train_net = Qwen2ForCausalLM(train_cfg, train_layout)
        self.train_strategy = net_layouts(self.train_net, train_layout)  # of this rank's stage
        self.shares_weights = shares_train_weights(train_cfg, infer_cfg, train_layout, infer_layout,
                                                   job.load_sft_checkpoint_infer, job.load_sft_checkpoint_train)
        if self.shares_weights:
            self.infer_net, self.infer_group, self.infer_prefix = self.train_net, TRAIN_WEIGHTS, ""
            self.infer_strategy = self.train_strategy
            self.resident_in = actor_residency(TRAIN_WEIGHTS)
        else:
            self.infer_net, self.infer_group, self.infer_prefix = \
                Qwen2ForCausalLM(infer_cfg, infer_layout), INFER_WEIGHTS, INFER_PREFIX
            self.infer_net.update_parameters_name(INFER_PREFIX)
            self.infer_strategy = net_layouts(self.infer_net, infer_layout)
        self.train_stages = None  # with pipeline stages: `gather_stage_layouts` of the train net, from build()

    def build(self) -> None:
        """Weights, optimizer, train step, resharder and generators (skipped by --only_save_strategy)."""
        from mindrlhf.algorithms import GRPOLossCell
        from mindrlhf.algorithms.policy_cells import GRPO_OUTPUT_NAMES, GRPOLossNet, ResponseLogProbs
        from mindrlhf.generation import Generator
        from mindrlhf.optim import AdamW
        from mindrlhf.parallel.layers import init_random_weights
        from mindrlhf.parallel.spmd import MicroBatchedTrainStep

        cfg, job, gen = self.config, self.job, self.generation
        if job.load_sft_checkpoint_train:
            load_weights(self.train_net, self.train_layout, job.load_sft_checkpoint_train)
        else:
            init_random_weights(self.train_net, self.train_layout, seed=job.init_seed)
        opt = cfg.optimizer
        self.optimizer = AdamW(self.train_net.trainable_params(), learning_rate=opt.learning_rate, beta1=opt.beta1,
                               beta2=opt.beta2, eps=opt.eps, weight_decay=opt.weight_decay)
        loss_cell = GRPOLossCell(beta=cfg.loss.beta, epsilon_low=cfg.loss.epsilon_low,
                                 epsilon_high=cfg.loss.epsilon_high, kl_estimator=cfg.loss.kl_estimator)
        loss_net = GRPOLossNet(self.train_net, loss_cell, gen.temperature)
        if self.train_layout.pp > 1:
            self.train_stages, self.train_step = pipeline_train_step(
                self.train_net, loss_net, self.optimizer, self.train_layout, self.train_cfg, self.train_strategy,
                num_inputs=8, num_outputs=len(GRPO_OUTPUT_NAMES), max_grad_norm=opt.max_grad_norm,
                stage_shared=self.train_net.stage_shared_params)
        else:
            self.train_step = MicroBatchedTrainStep(loss_net, self.optimizer, self.train_layout, grad_reduction="sum",
                                                    max_grad_norm=opt.max_grad_norm)
        self.to_infer = None if self.shares_weights else \
            self.resharder_to(self.infer_net, self.infer_strategy, INFER_PREFIX)
        self.old_log_probs = ResponseLogProbs(self.infer_net, gen.temperature)
        sched, group = cfg.schedule, gen.num_generations
        self.train_rows = MicroBatchSizer.for_pass("train", sched, self.train_cfg, self.train_layout, group, True)
        self.log_prob_rows = MicroBatchSizer.for_pass("log_prob", sched, self.infer_cfg, self.infer_layout, group,
                                                      False)
        self.generator = Generator(self.infer_net, gen)
        self.generator.rng = np.random.default_rng([gen.seed, self.infer_layout.dp_rank])
        # the evaluation prefills as many prompts a call as the rollout: both run one prefill graph
        self.eval_generator = Generator(self.infer_net, dataclasses.replace(
            gen, do_sample=False, num_generations=1,
            max_new_tokens=cfg.eval.eval_max_new_tokens or gen.max_new_tokens), share_graphs_with=self.generator,
            prefill_prompts=sched.batch_size // self.infer_layout.dp)
        if self.shares_weights:
            logger.info("actor: the inference net uses the train net's weights (same model and layout %s): no "
                        "second copy, no reshard", self.infer_layout)
        elif job.load_sft_checkpoint_infer:
            load_weights(self.infer_net, self.infer_layout, job.load_sft_checkpoint_infer, INFER_PREFIX)
        else:
            self.to_infer.run()

    def resharder_to(self, net, strategy: dict, prefix: str):
        """The online reshard of the train net's weights into `net` (its parameters named `prefix` + the train
        net's names), from every pipeline stage when the train net has them."""
        from mindrlhf.parallel.reshard import Resharder

        names = {name[len(prefix):]: name for name in strategy}
        return Resharder(self.train_net, net, self.train_strategy, strategy, names, rank=self.rank,
                         src_pipeline=self.train_layout, src_stage_layouts=self.train_stages)

    # ------------------------------------------------------------------ state
    def optimizer_state(self) -> list:
        """The AdamW moments and step counter (what the swap and the checkpoints handle besides weights)."""
        trained = {id(p) for p in self.train_net.trainable_params()}
        return [p for p in self.optimizer.get_parameters() if id(p) not in trained]

    def swap_groups(self) -> dict[str, list]:
        groups = {TRAIN_WEIGHTS: list(self.train_net.trainable_params()), OPTIMIZER_MOMENTS: self.optimizer_state()}
        if not self.shares_weights:
            groups[INFER_WEIGHTS] = list(self.infer_net.trainable_params())
        return groups

    def strategies(self) -> dict[str, dict]:
        return {"train": self.train_strategy, "infer": self.infer_strategy}

    def rank_files(self) -> dict[str, list]:
        return {TRAIN_CKPT: list(self.train_net.trainable_params()) + self.optimizer_state()}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return strategy_file(TRAIN_STRATEGY, self.train_strategy, self.train_stages)

    def strategy_stage(self, net: str) -> int:
        return self.train_layout.stage if net == "train" else 0

    def rank_state(self) -> dict:
        return {"generator_rng": self.generator.rng.bit_generator.state}

    def load_rank_state(self, state: dict) -> None:
        self.generator.rng.bit_generator.state = state["generator_rng"]

    def after_resume(self) -> None:
        self.sync_inference()

    # ------------------------------------------------------------------ work
    def generate(self, prompt_ids, attention_mask, progress: bool = False):
        """`num_generations` samples per prompt with their log-probs (`GenerationOutput`)."""
        self.require((self.infer_group,), "generate")
        return self.generator.generate(prompt_ids, attention_mask, return_log_probs=True, progress=progress,
                                       min_prompt_width=prompt_ids.shape[1])

    def greedy_generator(self):
        """The greedy generator of held-out evaluation (after checking the inference net is resident)."""
        self.require((self.infer_group,), "evaluate")
        return self.eval_generator

    def log_probs(self, arrays) -> np.ndarray:
        """Old-policy log-probs of the rows of `arrays` under the inference net."""
        self.require((self.infer_group,), "log_probs")
        return self.log_prob_rows.run(self.old_log_probs, arrays)

    def total_updates(self) -> int:
        """Optimizer updates of the whole run (the length of the learning-rate schedule)."""
        sched = self.config.schedule
        return sched.steps * sched.num_iterations * math.ceil(sched.batch_size / sched.prompts_per_update)

    def train(self, exp, comm) -> dict:
        """`schedule.num_iterations` passes of mini-batch updates on the experience (every rank holds all of
        it and takes its data-parallel share); returns the `actor/*` metrics averaged over the updates."""
        from mindrlhf.algorithms import aggregation_weights
        from mindrlhf.algorithms.policy_cells import GRPO_OUTPUT_NAMES
        from mindrlhf.optim import learning_rate_at
        from mindrlhf.trainer.experience import rows_of_rank, update_chunks

        self.require((TRAIN_WEIGHTS, OPTIMIZER_MOMENTS), "train")
        cfg, G, layout = self.config, self.generation.num_generations, self.train_layout
        opt = cfg.optimizer
        sums: dict[str, float] = {}
        count = skipped = 0
        for _ in range(cfg.schedule.num_iterations):
            for chunk in update_chunks(exp.num_rows // G, cfg.schedule.prompts_per_update, G):
                part = exp.rows(chunk)
                weights = aggregation_weights(part.response_mask, cfg.loss.aggregation).astype(np.float32)
                mine = rows_of_rank(part.num_rows, layout.dp, layout.dp_rank)
                lr = learning_rate_at(self.updates, opt.learning_rate, opt.warmup_steps, self.total_updates(),
                                      opt.lr_schedule, opt.min_lr_ratio)
                self.optimizer.set_learning_rate(lr)
                inputs = [part[name][mine] for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                        "old_logp", "ref_logp", "advantages")] + [weights[mine]]
                # every dp rank reads the update's widest response, so that no rank waits for another
                width = self.train_rows.width(part.response_mask)
                shares, grad_norm = self.train_step(self.train_rows.split(inputs, width))
                self.updates += 1
                last_lr = lr
                if not np.isfinite(grad_norm):  # the step skipped it, on every rank (the norm is global)
                    skipped += 1
                    self._count_skip(grad_norm)
                    continue
                self.consecutive_skips = 0
                values = comm.group_sum(shares.astype(np.float32), layout.dp_group)
                for name, value in zip(GRPO_OUTPUT_NAMES, values):
                    sums[name] = sums.get(name, 0.0) + float(value)
                sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + grad_norm
                count += 1
        if not count + skipped:
            return {"actor/updates": 0}
        metrics = {name: value / count for name, value in sums.items()}
        metrics["actor/lr"] = last_lr
        metrics["actor/updates"] = count
        metrics["actor/skipped_updates"] = skipped
        return metrics

    def _count_skip(self, grad_norm: float) -> None:
        self.consecutive_skips += 1
        limit = self.config.optimizer.max_consecutive_skips
        logger.warning("actor update %d skipped: the gradient norm is %s (%d in a row)", self.updates, grad_norm,
                       self.consecutive_skips)
        if limit and self.consecutive_skips >= limit:
            raise NonFiniteUpdates(f"{self.consecutive_skips} actor updates in a row had a non-finite loss or "
                                   f"gradient (optimizer.max_consecutive_skips={limit}); the job stops with its last "
                                   "checkpoint intact: lower the learning rate or check the rewards and data")

    def sync_inference(self) -> None:
        """Reshards the train net's weights into the inference net (nothing to do when it is the train net)."""
        self.require((TRAIN_WEIGHTS, self.infer_group), "sync_inference")
        if self.to_infer is not None:
            self.to_infer.run()


class Reference(Role):
    """The reference policy in the inference layout: log-probs for the KL term; copied from the actor's train
    net at the start and every `schedule.ref_model_sync_steps` steps."""

    name = "reference"
    resident_in = {"ref": (REF_WEIGHTS,)}

    def __init__(self, config, job, infer_cfg, infer_layout, temperature: float, rank: int):
        from mindrlhf.models.qwen2 import Qwen2ForCausalLM
        from mindrlhf.parallel.strategy import net_layouts

        self.config, self.job, self.rank = config, job, rank
        self.infer_cfg, self.layout, self.temperature = infer_cfg, infer_layout, temperature
        self.net = Qwen2ForCausalLM(infer_cfg, infer_layout)
        self.net.update_parameters_name(REF_PREFIX)
        self.strategy = net_layouts(self.net, infer_layout)

    def build(self, actor: Actor) -> None:
        from mindrlhf.algorithms.policy_cells import ResponseLogProbs

        self.from_actor = actor.resharder_to(self.net, self.strategy, REF_PREFIX)
        self.cell = ResponseLogProbs(self.net, self.temperature)
        self.rows = actor.log_prob_rows
        if self.job.load_ref_checkpoint:
            load_weights(self.net, self.layout, self.job.load_ref_checkpoint, REF_PREFIX)
        else:
            self.from_actor.run()

    def swap_groups(self) -> dict[str, list]:
        return {REF_WEIGHTS: list(self.net.trainable_params())}

    def strategies(self) -> dict[str, dict]:
        return {"ref": self.strategy}

    def rank_files(self) -> dict[str, list]:
        return {REF_CKPT: list(self.net.trainable_params())}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return {INFER_STRATEGY: (self.strategy, None)}

    def log_probs(self, arrays) -> np.ndarray:
        """Reference log-probs of the rows of `arrays` (prompt ids, prompt mask, response ids, response mask)."""
        self.require((REF_WEIGHTS,), "log_probs")
        return self.rows.run(self.cell, arrays)

    def sync_from_actor(self) -> None:
        """Reshards the actor's train weights into the reference net."""
        self.require((TRAIN_WEIGHTS, REF_WEIGHTS), "sync_from_actor")
        self.from_actor.run()


class Critic(Role):
    """The PPO value function: `Qwen2ForValue` in its own layout (`--sft_path_critic`), AdamW and the clipped
    value loss. It scores every response token of the rollout (phase `values`) and trains on the returns
    (phase `update_critic`); it is offloaded in every other phase."""

    name = "critic"
    resident_in = {"values": (CRITIC_WEIGHTS,), "update_critic": (CRITIC_WEIGHTS, CRITIC_MOMENTS)}

    def __init__(self, config, job, critic_cfg, layout, rank: int):
        from mindrlhf.models.qwen2 import Qwen2ForValue
        from mindrlhf.parallel.strategy import net_layouts

        self.config, self.job, self.rank = config, job, rank
        self.model_config, self.layout = critic_cfg, layout
        self.net = Qwen2ForValue(critic_cfg, layout)
        self.net.update_parameters_name(CRITIC_PREFIX)
        self.strategy = net_layouts(self.net, layout)  # of this rank's stage
        self.stages = None  # with pipeline stages: `gather_stage_layouts` of the net, from build()
        self.updates = 0

    def build(self, actor: Actor) -> None:
        """Weights (a critic checkpoint, or the starting policy's backbone with a zero head), optimizer, train
        step and the values cell."""
        from mindrlhf.algorithms import ValueLossCell
        from mindrlhf.algorithms.policy_cells import (
            ResponseHidden,
            ResponseValues,
            ValueLossNet,
            response_hidden_shape,
            response_values_shape,
        )
        from mindrlhf.algorithms.value_loss_cell import OUTPUT_NAMES as VALUE_OUTPUT_NAMES
        from mindrlhf.optim import AdamW
        from mindrlhf.parallel.layers import random_full_state, to_ms_dtype
        from mindrlhf.parallel.pipeline import PipelineForward
        from mindrlhf.parallel.spmd import MicroBatchedTrainStep

        job, cfg = self.job, self.config
        if job.load_critic_checkpoint:
            source = job.load_critic_checkpoint
            state = read_policy_weights(source, "critic")
        else:
            source = job.load_sft_checkpoint_train or f"random weights (seed {job.init_seed})"
            state = read_policy_weights(job.load_sft_checkpoint_train) if job.load_sft_checkpoint_train else \
                random_full_state(actor.train_net, actor.train_layout, job.init_seed)
            state[VALUE_HEAD] = np.zeros((1, self.model_config.hidden_size), np.float32)
            if self.model_config.value_head_bias:
                state[VALUE_HEAD_BIAS] = np.zeros((1,), np.float32)
            logger.info("critic: the starting policy's backbone with a zero value head (--load_critic_checkpoint "
                        "not given)")
        load_value_model(self.net, self.layout, state, source, CRITIC_PREFIX, f"critic {job.sft_path_critic}")
        critic = cfg.critic
        self.optimizer = AdamW(self.net.trainable_params(), learning_rate=critic.lr, beta1=cfg.optimizer.beta1,
                               beta2=cfg.optimizer.beta2, eps=cfg.optimizer.eps,
                               weight_decay=cfg.optimizer.weight_decay, state_prefix="critic_")
        loss_net = ValueLossNet(self.net, ValueLossCell(critic.cliprange_value))
        if self.layout.pp > 1:
            self.stages, self.train_step = pipeline_train_step(
                self.net, loss_net, self.optimizer, self.layout, self.model_config, self.strategy, num_inputs=7,
                num_outputs=len(VALUE_OUTPUT_NAMES), max_grad_norm=critic.grad_clip)
            last = self.layout.stage == self.layout.pp - 1
            self.values_cell = PipelineForward(
                ResponseValues(self.net) if last else ResponseHidden(self.net), self.layout,
                response_hidden_shape(self.model_config.hidden_size), to_ms_dtype(self.model_config.compute_dtype),
                response_values_shape)
        else:
            self.train_step = MicroBatchedTrainStep(loss_net, self.optimizer, self.layout, grad_reduction="sum",
                                                    max_grad_norm=critic.grad_clip)
            self.values_cell = ResponseValues(self.net)
        sched, group = cfg.schedule, cfg.generation.num_generations
        self.train_rows = MicroBatchSizer.for_pass("critic train", sched, self.model_config, self.layout, group, True)
        self.value_rows = MicroBatchSizer.for_pass("values", sched, self.model_config, self.layout, group, False)

    def optimizer_state(self) -> list:
        trained = {id(p) for p in self.net.trainable_params()}
        return [p for p in self.optimizer.get_parameters() if id(p) not in trained]

    def swap_groups(self) -> dict[str, list]:
        return {CRITIC_WEIGHTS: list(self.net.trainable_params()), CRITIC_MOMENTS: self.optimizer_state()}

    def strategies(self) -> dict[str, dict]:
        return {"critic": self.strategy}

    def rank_files(self) -> dict[str, list]:
        return {CRITIC_CKPT: list(self.net.trainable_params()) + self.optimizer_state()}

    def shared_files(self) -> dict[str, tuple[dict, dict | None]]:
        return strategy_file(CRITIC_STRATEGY, self.strategy, self.stages)

    def strategy_stage(self, net: str) -> int:
        return self.layout.stage if net == "critic" else 0

    def values(self, exp, comm) -> np.ndarray:
        """Values of every row of `exp` [N, R] (0 on padding): each critic dp rank scores its share of the rows,
        then the shares are gathered."""
        from mindrlhf.trainer.experience import rows_of_rank

        self.require((CRITIC_WEIGHTS,), "values")
        mine = rows_of_rank(exp.num_rows, self.layout.dp, self.layout.dp_rank)
        arrays = [exp[name][mine] for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
        local = self.value_rows.run(self.values_cell, arrays).astype(np.float32)
        values = comm.gather_data_parallel_rows(local, self.layout) if self.layout.world_size > 1 else local
        return values * exp.response_mask.astype(np.float32)

    def train(self, exp, comm, group_size: int) -> dict:
        """`schedule.num_iterations` passes of the actor's mini-batches on the value loss; `critic/*` metrics."""
        from mindrlhf.algorithms import aggregation_weights
        from mindrlhf.algorithms.value_loss_cell import OUTPUT_NAMES
        from mindrlhf.optim import learning_rate_at
        from mindrlhf.trainer.experience import rows_of_rank, update_chunks

        self.require((CRITIC_WEIGHTS, CRITIC_MOMENTS), "train")
        cfg, layout = self.config, self.layout
        sums: dict[str, float] = {}
        count = skipped = 0
        total = cfg.schedule.steps * cfg.schedule.num_iterations * math.ceil(
            cfg.schedule.batch_size / cfg.schedule.prompts_per_update)
        for _ in range(cfg.schedule.num_iterations):
            for chunk in update_chunks(exp.num_rows // group_size, cfg.schedule.prompts_per_update, group_size):
                part = exp.rows(chunk)
                weights = aggregation_weights(part.response_mask, cfg.loss.aggregation).astype(np.float32)
                mine = rows_of_rank(part.num_rows, layout.dp, layout.dp_rank)
                lr = learning_rate_at(self.updates, cfg.critic.lr, cfg.critic.lr_warmup_steps, total,
                                      cfg.optimizer.lr_schedule, cfg.optimizer.min_lr_ratio)
                self.optimizer.set_learning_rate(lr)
                inputs = [part[name][mine] for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                                                        "values", "returns")] + [weights[mine]]
                width = self.train_rows.width(part.response_mask)
                shares, grad_norm = self.train_step(self.train_rows.split(inputs, width))
                self.updates += 1
                if not np.isfinite(grad_norm):
                    skipped += 1
                    logger.warning("critic update %d skipped: the gradient norm is %s", self.updates, grad_norm)
                    continue
                values = comm.group_sum(shares.astype(np.float32), layout.dp_group)
                for name, value in zip(OUTPUT_NAMES, values):
                    sums[f"critic/{name}"] = sums.get(f"critic/{name}", 0.0) + float(value)
                sums["critic/grad_norm"] = sums.get("critic/grad_norm", 0.0) + grad_norm
                count += 1
        metrics = {name: value / count for name, value in sums.items()} if count else {}
        metrics.update({"critic/lr": lr, "critic/updates": count, "critic/skipped_updates": skipped})
        return metrics


class Reward(Role):
    """Rewards of a rollout: the rule functions (`reward.reward_funcs`, weighted, on the host) plus, with
    `reward.reward_model_path`, a reward model's score at the last response token (`Qwen2ForValue` in the
    inference layout, on device only in the `reward` phase), weighted by `reward.reward_model_weight`."""

    name = "reward"

    def __init__(self, config, job, tokenizer, model_cfg=None, layout=None, rank: int = 0):
        from mindrlhf.reward import build_reward_fn

        reward = config.reward
        self.config, self.job, self.tokenizer, self.rank = config, job, tokenizer, rank
        self.rules = build_reward_fn(reward.reward_funcs, reward.reward_weights) if reward.reward_funcs else None
        self.net = None
        if reward.reward_model_path:
            from mindrlhf.models.qwen2 import Qwen2ForValue
            from mindrlhf.parallel.strategy import net_layouts

            self.model_config, self.layout = model_cfg, layout
            self.net = Qwen2ForValue(model_cfg, layout)
            self.net.update_parameters_name(REWARD_MODEL_PREFIX)
            self.strategy = net_layouts(self.net, layout)
            self.resident_in = {"reward": (REWARD_MODEL_WEIGHTS,)}

    def build(self) -> None:
        """Loads the reward model (a checkpoint with a value head) and its scoring cell."""
        from mindrlhf.algorithms.policy_cells import ResponseScores

        if self.net is None:
            return
        path = self.config.reward.reward_model_path
        state = read_policy_weights(path, "critic")  # a step folder's value model is its critic
        load_value_model(self.net, self.layout, state, path, REWARD_MODEL_PREFIX,
                         f"reward model {self.job.sft_path_reward or self.job.sft_path_infer}")
        self.cell = ResponseScores(self.net)
        self.rows = MicroBatchSizer.for_pass("reward model", self.config.schedule, self.model_config, self.layout,
                                             self.config.generation.num_generations, False)
        logger.info("reward model %s (weight %g)%s", path, self.config.reward.reward_model_weight,
                    f" + rule rewards {self.rules}" if self.rules else "")

    def swap_groups(self) -> dict[str, list]:
        return {REWARD_MODEL_WEIGHTS: list(self.net.trainable_params())} if self.net is not None else {}

    def strategies(self) -> dict[str, dict]:
        return {"reward_model": self.strategy} if self.net is not None else {}

    def model_scores(self, arrays) -> np.ndarray:
        """The reward model's score of each row of `arrays` (prompt ids, prompt mask, response ids, response mask)."""
        self.require((REWARD_MODEL_WEIGHTS,), "model_scores")
        return self.rows.run(self.cell, arrays).astype(np.float32)

    def __call__(self, prompt_ids, prompt_mask, response_ids, response_mask, solutions, columns=None):
        """(rewards [N], per-term rewards (unweighted; `reward_model` for the model), decoded completions).
        `columns`: the prompts' other dataset fields, one list per name with a value per response, passed to
        TRL-form reward functions as keyword arguments."""
        from mindrlhf.trainer.evaluation import decode_completions

        completions = decode_completions(self.tokenizer, response_ids, response_mask)
        rewards, terms = np.zeros(len(completions), np.float32), {}
        if self.rules is not None:
            extra = {}
            if self.rules.needs_prompts:  # TRL-form functions also get the prompts, completion ids and columns
                extra.update(columns or {})
                extra["prompts"] = decode_completions(self.tokenizer, prompt_ids, prompt_mask,
                                                      skip_special_tokens=False)
                extra["completion_ids"] = [ids[mask.astype(bool)].tolist()
                                           for ids, mask in zip(response_ids, response_mask)]
            rewards, terms = self.rules(completions, solutions, **extra)
        if self.net is not None:
            scores = self.model_scores((prompt_ids, prompt_mask, response_ids, response_mask))
            rewards = (rewards + self.config.reward.reward_model_weight * scores).astype(np.float32)
            terms = {**terms, "reward_model": scores}
        return rewards, terms, completions
