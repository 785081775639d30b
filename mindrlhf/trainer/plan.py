"""`JobPlan`: every cross-check of a job (config, flags, files, model YAMLs, layouts, batch splits, tokenizer),
run before any net is built or file written, and what the trainer builds from: the nets' configs and layouts and
the generation settings.

Errors are `ConfigError`s (a `LayoutError` for a layout that does not cover the world) naming the file and the
field; the checks run in a fixed order, so the first problem of a job is always the one reported.

`python -m mindrlhf.trainer.plan world-size YAML` prints the ranks a model YAML's layout spans (run_grpo.sh's
default WORKER_NUM).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mindrlhf.algorithms import ADVANTAGE_ESTIMATORS, check_loss_hyperparameters
from mindrlhf.algorithms.advantages import GROUP_ESTIMATORS
from mindrlhf.checkpoint.step import find_resume_checkpoint
from mindrlhf.configs.base import ConfigError, load_yaml
from mindrlhf.configs.generation import GenerationConfig
from mindrlhf.configs.grpo_configs import GRPOConfig, ScheduleConfig
from mindrlhf.configs.job import JobOptions
from mindrlhf.configs.lora import LoraConfig
from mindrlhf.configs.mindspeed import is_mindspeed_yaml
from mindrlhf.configs.recompute import RecomputeConfig
from mindrlhf.data.reader import read_prompt_records
from mindrlhf.engine.batches import group_unit
from mindrlhf.engine.step_shape import StepShape
from mindrlhf.models.qwen2.config import Qwen2Config
from mindrlhf.parallel.layout import Layout, tensor_parallel_refusal, tensor_parallel_sizes
from mindrlhf.reward import get_reward_function
from mindrlhf.tool_use import ToolDefinitionError, ToolRunner, ToolTurns, load_tools
from mindrlhf.trainer.specs import REF_WEIGHTS, ActorSpec, CriticSpec, NetSpec, ReferenceSpec, RewardSpec
from mindrlhf.utils import output_owner

logger = logging.getLogger("mindrlhf.trainer")

# LossConfig fields `check_loss_hyperparameters` reads (an error there names the source of the latest of them).
_LOSS_FIELDS = ("beta", "epsilon_low", "epsilon_high", "aggregation", "kl_estimator")


@dataclass(frozen=True)
class JobPlan:
    """What the trainer builds a checked job from (`JobPlan.build`)."""

    config: GRPOConfig  # validated
    job: JobOptions  # its flags and input files checked
    world_size: int
    rank: int
    shape: StepShape  # the step's geometry: prompts and rows per rank of each layout, updates per step
    actor: ActorSpec
    reference: ReferenceSpec | None  # None without a KL term (`needs_reference`): no reference net, no ref pass
    critic: CriticSpec | None  # None without --sft_path_critic
    reward: RewardSpec
    generation: GenerationConfig  # config.generation with the stop and pad ids of `resolve_token_ids`
    eval_batch_size: int  # prompts per evaluation call on each inference data-parallel rank
    eval_set: tuple[list[list[int]], list[str]] | None  # the held-out (prompt ids, solutions), if any
    rollout_rows_stay: bool  # `rollout_rows_stay`: each rank trains on the rows it generated, none are gathered

    @classmethod
    def build(cls, config: GRPOConfig, job: JobOptions, tokenizer, world_size: int = 1, rank: int = 0,
              device: str | None = None) -> JobPlan:
        """Checks the whole job, in the order: config (`config.validate`, `check_registered_names`), flags and
        input files (`check_job_inputs`), the policy's YAMLs and layouts, batch splits, tokenizer and generation
        lengths (`check_decode_rows` too), critic, reward model, the prompts' lengths (`check_prompt_lengths`), the
        held-out set (`load_eval_set`), and with `device` (MindSpore's device_target) the nets' dtypes on it
        (`check_dtypes_on_device`; `--plan` passes none: it reads Ascend recipes on CPU). Reads the YAMLs and the
        prompts; builds nothing."""
        config.validate()
        check_registered_names(config)
        check_job_inputs(job)
        train_cfg, infer_cfg, train_layout, infer_layout, shape = _policy_nets(config, job, world_size, rank)
        eval_batch_size = _check_batches(config, job, shape)
        generation = _generation(config, tokenizer, job, train_cfg, infer_cfg)
        check_tool_template(config, tokenizer)
        check_decode_rows(config, generation, job, shape, eval_batch_size)
        critic_cfg, critic_layout = _critic_config_and_layout(config, job, train_cfg, shape, world_size, rank)
        shape = shape.with_critic(critic_layout.dp) if critic_layout is not None else shape
        reward_model_cfg = reward_model_config(job, infer_cfg, infer_layout) if config.reward.reward_model_path \
            else None
        check_prompt_lengths(config, job, generation.prompt_buckets)
        eval_set = load_eval_set(job.eval_dataset_file, generation.prompt_buckets) \
            if job.eval_dataset_file and not job.check_flags else None  # --check_flags: not written yet
        train = NetSpec(train_cfg, train_layout, job.sft_path_train, job.load_sft_checkpoint_train)
        infer = NetSpec(infer_cfg, infer_layout, job.sft_path_infer, job.load_sft_checkpoint_infer)
        check_lora_adapter(config, job)
        actor = ActorSpec(train, infer, shares_train_weights(train, infer), generation, config.loss, config.optimizer,
                          config.schedule, shape, config.eval.eval_max_new_tokens or generation.max_new_tokens,
                          job.init_seed, config.tools, job.load_lora_adapter)
        # the reference is the base policy: the inference net without adapters (with LoRA, on that net's weights)
        shares_base = infer_cfg.lora.enabled and not job.load_ref_checkpoint
        reference = ReferenceSpec(dataclasses.replace(infer, model=with_lora(infer_cfg, LoraConfig()),
                                                      checkpoint=job.load_ref_checkpoint), generation.temperature,
                                  actor.infer_group if shares_base else REF_WEIGHTS) \
            if needs_reference(config, job) else None
        critic = CriticSpec(NetSpec(critic_cfg, critic_layout, job.sft_path_critic, job.load_critic_checkpoint),
                            train, config.critic, config.optimizer, config.schedule, config.loss.aggregation,
                            shape, job.init_seed) if critic_cfg is not None else None
        reward_model = NetSpec(reward_model_cfg, infer_layout, job.sft_path_reward or job.sft_path_infer,
                               config.reward.reward_model_path) if reward_model_cfg is not None else None
        plan = cls(config=config, job=job, world_size=world_size, rank=rank, shape=shape, actor=actor,
                   reference=reference, critic=critic,
                   reward=RewardSpec(config.reward, reward_model, config.schedule, shape),
                   generation=generation, eval_batch_size=eval_batch_size, eval_set=eval_set,
                   rollout_rows_stay=rollout_rows_stay(config, job, train_layout, infer_layout, critic is not None))
        if device is not None:
            check_dtypes_on_device(plan, device)
        return plan

    def for_rank(self, rank: int) -> JobPlan:
        """The same checked plan seen from `rank` (its place in each layout); nothing is checked again. The launch
        builds the plan before the cluster forms, when only the world size is known, and asks for its rank after."""
        def placed(net: NetSpec | None) -> NetSpec | None:
            return None if net is None else net.for_rank(self.world_size, rank)

        actor = dataclasses.replace(self.actor, train=placed(self.actor.train), infer=placed(self.actor.infer))
        reference = self.reference and dataclasses.replace(self.reference, net=placed(self.reference.net))
        critic = self.critic and dataclasses.replace(self.critic, net=placed(self.critic.net), policy=actor.train)
        reward = dataclasses.replace(self.reward, model=placed(self.reward.model))
        return dataclasses.replace(self, rank=rank, actor=actor, reference=reference, critic=critic, reward=reward)

    def roles(self) -> list:
        """The specs of the job's roles (actor, reference, reward, critic: those it has)."""
        return [spec for spec in (self.actor, self.reference, self.reward, self.critic) if spec is not None]

    def nets(self) -> list[NetSpec]:
        """Every net the job builds, as its YAMLs describe them (the reference is the inference net's twin)."""
        nets = [self.actor.train, self.actor.infer, self.critic and self.critic.net, self.reward.model]
        return [net for net in nets if net is not None]

    def layouts(self) -> list[Layout]:
        """The layouts of the job's nets (their communication groups)."""
        return [self.actor.train.layout, self.actor.infer.layout] + ([self.critic.net.layout] if self.critic else [])

    def trained_layouts(self) -> list[Layout]:
        """The layouts of the nets that learn (their data-parallel gradient sums)."""
        return [self.actor.train.layout] + ([self.critic.net.layout] if self.critic else [])


def shares_train_weights(train: NetSpec, infer: NetSpec) -> bool:
    """Whether the inference net can be the train net itself: the same architecture, dtypes and layout (the
    same shards on every rank), and no inference checkpoint of its own. Recompute acts in backward passes only,
    so it may differ."""
    def architecture(cfg):
        return dataclasses.replace(cfg, parallel_config=None, recompute=RecomputeConfig())

    own_weights = bool(infer.checkpoint) and infer.checkpoint != train.checkpoint
    return architecture(train.model) == architecture(infer.model) and train.layout == infer.layout and \
        not own_weights


def rollout_rows_stay(config: GRPOConfig, job: JobOptions, train_layout: Layout, infer_layout: Layout,
                      has_critic: bool) -> bool:
    """Whether each rank can train on the rows it generated, so that no rank needs another's rows: the train and
    infer layouts place every rank alike (same data-parallel rank), a step makes one update a pass (or dp is 1:
    each update takes every rank's share of its prompts), the advantages are computed within prompt
    groups (no critic, no KL in the reward), no dynamic sampling (its kept groups are shared out over the whole
    batch) and no experience file (rank 0 writes the whole batch). Otherwise the rollout is gathered and each
    rank keeps its train share."""
    same_places = (train_layout.dp, train_layout.tp, train_layout.pp) == (infer_layout.dp, infer_layout.tp,
                                                                           infer_layout.pp)
    algo, schedule = config.algorithm, config.schedule
    # a rank's share of each update is its share of that update's rows: all of its own rows with one update a pass
    own_rows_make_its_updates = train_layout.dp == 1 or schedule.prompts_per_update == schedule.batch_size
    return same_places and own_rows_make_its_updates and algo.adv_estimator in GROUP_ESTIMATORS and not (
        has_critic or algo.use_kl_in_reward or algo.dynamic_sampling or job.save_data_file)


def needs_reference(config: GRPOConfig, job: JobOptions) -> bool:
    """Whether the job reads reference log-probs: only a KL term does (`loss.beta` > 0, or
    `algorithm.use_kl_in_reward`). Without one, as TRL does at its default beta 0, no reference net is built and no
    reference pass runs; flags that would only feed it are said to be unused."""
    if config.loss.beta > 0 or config.algorithm.use_kl_in_reward:
        return True
    unused = [flag for flag, value in (("--load_ref_checkpoint", job.load_ref_checkpoint),
                                       ("schedule.ref_model_sync_steps", config.schedule.ref_model_sync_steps))
              if value]
    if unused:
        logger.warning("%s: not used, the job has no reference model (loss.beta is 0 and "
                       "algorithm.use_kl_in_reward is off)", ", ".join(unused))
    return False


def load_eval_set(path: str, prompt_buckets) -> tuple[list[list[int]], list[str]]:
    """(prompt ids, solutions) of a held-out prompt MindRecord; errors name the file."""
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


def check_dtypes_on_device(plan: JobPlan, device: str) -> None:
    """Every net's dtypes have kernels on `device` (MindSpore's device_target): CPU has none for bfloat16."""
    if device != "CPU":
        return
    for net in plan.nets():
        for name in ("compute_dtype", "param_init_type"):
            if getattr(net.model, name) == "bfloat16":
                raise ConfigError(f"{net.yaml}: model_config.{name}: bfloat16 has no CPU kernels; set float32 (or "
                                  "float16) to run on CPU (bfloat16 is for Ascend)")


# ---------------------------------------------------------------------- config and flags
def check_registered_names(config: GRPOConfig) -> None:
    """The names `config` looks up in the algorithm and reward registries exist: algorithm.adv_estimator, the
    loss settings (`check_loss_hyperparameters`: aggregation, KL estimator and the clip/KL numbers),
    reward.reward_funcs (registered names or importable `package.module:function`s).

    An error names the YAML file (or "command line") that gave the value, as when the config was loaded."""
    algo, loss = config.algorithm, config.loss
    try:
        ADVANTAGE_ESTIMATORS.get(algo.adv_estimator)
    except ValueError as err:
        raise _sourced(config, "algorithm", ("adv_estimator",), f"algorithm.adv_estimator: {err}") from None
    try:
        check_loss_hyperparameters(loss.beta, loss.epsilon_low, loss.epsilon_high, loss.aggregation, loss.kl_estimator)
    except ValueError as err:
        raise _sourced(config, "loss", _LOSS_FIELDS, f"loss: {err}") from None
    for name in config.reward.reward_funcs:
        try:
            get_reward_function(name)
        except (ValueError, ImportError, TypeError) as err:
            raise _sourced(config, "reward", ("reward_funcs",), f"reward.reward_funcs: {err}") from None
    try:
        load_tools(config.tools.tools)
    except ToolDefinitionError as err:
        raise _sourced(config, "tools", ("tools",), str(err)) from None


def check_tool_template(config: GRPOConfig, tokenizer) -> None:
    """A job with tools needs a tokenizer whose chat template renders them and their answers' turns, each within
    generation.max_tool_response_tokens (`ToolTurns` checks both)."""
    if config.tools.tools:
        try:
            ToolTurns(ToolRunner(()), tokenizer, config.generation.max_tool_response_tokens)
        except ToolDefinitionError as err:
            raise _sourced(config, "tools", ("tools",), str(err)) from None


def _sourced(config: GRPOConfig, section: str, fields: tuple[str, ...], message: str) -> ConfigError:
    """`message` (which names the section) prefixed with where the fields were given (`<file>: `); unprefixed
    for defaults."""
    source = config.source_of(section, *fields)
    return ConfigError(f"{source}: {message}" if source else message)


def yaml_world_size(job: JobOptions) -> int:
    """The ranks the train YAML's layout spans (`--plan` and `--check_flags` run without msrun)."""
    return model_world_size(job.sft_path_train)


def model_world_size(path: str) -> int:
    """The ranks the layout of the model YAML at `path` spans (data_parallel x model_parallel x pipeline_stage)."""
    return Qwen2Config.from_yaml(path).parallel_config.world_size


def main(argv: Sequence[str] | None = None) -> int:
    """`world-size YAML`: prints `model_world_size` of YAML; a YAML it cannot read prints `error: ...` and gives
    2."""
    parser = argparse.ArgumentParser(prog="python -m mindrlhf.trainer.plan", description="Facts of a job's plan.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("world-size", help="the ranks the layout of a model YAML spans").add_argument("yaml")
    args = parser.parse_args(argv)
    try:
        print(model_world_size(args.yaml))
    except (ValueError, OSError) as err:  # ConfigError
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def check_job_inputs(job: JobOptions) -> None:
    """The launch flags that need no model: --cpu_threads, then the input files (`check_files`; not with
    `--check_flags`, which runs before they are written)."""
    if job.cpu_threads < 0:
        raise ConfigError(f"--cpu_threads must be >= 0 (0 = cores / ranks on this host), got {job.cpu_threads}")
    if not job.check_flags:
        check_files(job)


def check_files(job: JobOptions) -> None:
    """The model YAMLs, datasets and checkpoints the flags name exist."""
    for flag in ("sft_path_train", "sft_path_infer", "mind_dataset_dir"):
        path = getattr(job, flag)
        if flag == "sft_path_infer" and job.stage != "rl":
            continue  # the stages before RL train one net
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: --{flag} file not found")
    if job.eval_dataset_file and not os.path.isfile(job.eval_dataset_file):
        raise ConfigError(f"{job.eval_dataset_file}: --eval_dataset_file file not found")
    for flag in ("load_sft_checkpoint_train", "load_sft_checkpoint_infer", "load_ref_checkpoint"):
        path = getattr(job, flag)
        if path and not os.path.exists(path):
            raise ConfigError(f"{path}: --{flag} not found")


def claim_output(job: JobOptions, environ: Mapping[str, str] = os.environ) -> None:
    """One run per --output_dir (`mindrlhf.utils.output_owner`): every process refuses a folder another live run
    holds; the real job's owner (`job_owner_pid`) holds its lock while `job` lives. Checks only look."""
    owner, msrun_job = output_owner.job_owner_pid(environ), output_owner.job_of(environ)
    try:
        if job.check_flags or job.only_save_strategy or job.plan or owner is None:
            output_owner.check(job.output_dir, job=msrun_job)
        else:
            output_owner.hold(job.output_dir, owner, keep_while=job, job=msrun_job)
    except OSError as err:
        raise ConfigError(f"{job.output_dir}: --output_dir cannot be written ({err.strerror or err})") from None


def check_write_targets(job: JobOptions) -> None:
    """Every folder the job writes into (`--output_dir`, the checkpoints, TensorBoard's, the experience files') is
    tried at start-up (`try_writing_into`), so that a folder that cannot be written stops the job before any work, not
    at its first checkpoint after a step's. Then the run's own folders (`check_rerun`): --resume's checkpoint exists,
    an earlier run's checkpoints or metrics are refused unless --resume or --overwrite_output."""
    targets = {"output_dir": job.output_dir, "save_ckpt_dir": job.checkpoint_dir,
               "tensorboard_dir": job.tensorboard_dir,
               "save_data_file": os.path.dirname(os.path.abspath(job.save_data_file)) if job.save_data_file else ""}
    for flag, folder in targets.items():
        if folder:
            try:
                try_writing_into(folder)
            except OSError as err:
                raise ConfigError(f"{folder}: --{flag} cannot be written ({err.strerror or err})") from None
    check_rerun(job)


def check_rerun(job: JobOptions) -> None:
    """--resume names a complete checkpoint; without it, a run's checkpoints or metrics in the folder are refused,
    or deleted first with --overwrite_output (in the real job, by the owner `claim_output` made)."""
    if job.resume:
        if job.overwrite_output:
            raise ConfigError("--overwrite_output deletes the run --resume would continue; give one of them")
        find_resume_checkpoint(job.resume, job.checkpoint_dir, announce=False)
        return
    if job.only_save_strategy:
        return
    leftovers = output_owner.find_leftovers(job.output_dir, job.checkpoint_dir)
    if not leftovers:
        return
    own_checkpoints = _is_inside(job.checkpoint_dir, job.output_dir)
    folder = job.output_dir if own_checkpoints or leftovers.metric_lines else job.checkpoint_dir
    what = leftovers.describe("" if own_checkpoints or folder == job.checkpoint_dir else job.checkpoint_dir)
    if not job.overwrite_output:
        raise ConfigError(f"{folder}: holds a run's {what}; --resume continues that run, --overwrite_output deletes "
                          "its checkpoints, metrics.jsonl, completions.jsonl, TensorBoard events and progress.png "
                          "first, or choose another --output_dir (run_grpo.sh: OUTPUT)")
    if not job.check_flags and output_owner.claimed(job.output_dir):
        tensorboard = (job.tensorboard_dir, os.path.join(job.output_dir, "tensorboard"))
        output_owner.delete_leftovers(job.output_dir, job.checkpoint_dir, tensorboard)
        logger.warning("%s: --overwrite_output: deleted the earlier run's %s", folder, what)


def _is_inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def try_writing_into(folder: str) -> None:
    """Writes and removes a file of a unique name in `folder`, or, while it does not exist yet, in the nearest folder
    above it that does (where it would be made); OSError when that cannot be done or a file stands in the way.
    Nothing is left behind, and ranks trying the same folder at once do not disturb each other."""
    path = os.path.abspath(folder)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
        pass


# ---------------------------------------------------------------------- model YAMLs and layouts
def _model_signature(cfg) -> dict:
    """Fields that must agree between the train and the infer nets (everything but dtypes, layout, head, the job's
    adapters (a critic may train without them), and what does not change the network: the longest trained
    position and the token ids, which the tokenizer gives; MindRLHF's finetune and predict YAMLs differ in those)."""
    skip = {"parallel_config", "compute_dtype", "param_init_type", "softmax_compute_type", "rotary_dtype",
            "layernorm_compute_type", "value_head_bias", "arch", "recompute", "use_flash_attention", "lora",
            "max_position_embedding", "bos_token_id", "eos_token_id", "pad_token_id"}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def check_model_configs(train_cfg, infer_cfg, train_path: str, infer_path: str) -> None:
    """The train and infer YAMLs must describe the same network."""
    train_sig, infer_sig = _model_signature(train_cfg), _model_signature(infer_cfg)
    differing = [f"{k}: {train_sig[k]!r} vs {infer_sig[k]!r}" for k in train_sig if train_sig[k] != infer_sig[k]]
    if differing:
        raise ConfigError(f"{train_path} and {infer_path} describe different models ({'; '.join(differing)}); "
                          "only dtypes and parallel_config may differ")


def check_tensor_parallel(cfg, tp: int, path: str) -> None:
    """The model's widths split over `tp`; the kv heads may also be fewer (a divisor of tp: each is replicated).
    Flash attention is refused off CPU (on CPU the YAML's reader warned about it)."""
    import mindspore as ms  # for the device only: importing the plan loads no MindSpore (MINDSPORE_FREE)

    device = ms.get_context("device_target")
    if cfg.use_flash_attention and device != "CPU":
        raise ConfigError(f"{path}: model.model_config.use_flash_attention=true is not supported on {device}: "
                          "flash attention is not built here (attention is softmax(q k^T) v); set it to false")

    sizes = (cfg.num_heads, cfg.n_kv_heads, cfg.vocab_size, cfg.intermediate_size)
    refusal = tensor_parallel_refusal(*sizes, tp)
    if refusal:
        allowed = ", ".join(map(str, tensor_parallel_sizes(*sizes)))
        raise ConfigError(f"{path}: model_config.{refusal}; this model allows model_parallel {allowed}")


def check_unstaged(layout, path: str, what: str) -> None:
    """Nets that only run forward have no pipeline stages."""
    if layout.pp > 1:
        raise ConfigError(f"{path}: parallel_config.pipeline_stage={layout.pp}, but {what} runs without pipeline "
                          "stages; use pipeline_stage: 1 (only the actor's train net is split into stages)")


def check_pipeline(cfg, layout, sched: ScheduleConfig, rows_per_rank: int, path: str) -> None:
    """A train layout with pipeline stages: an equal share of the decoder layers for every stage, and
    `micro_batch_num` micro-batches that split each rank's rows of an update evenly (and stand for
    schedule.micro_batch_size_per_device)."""
    if layout.pp == 1:
        return
    if cfg.num_layers % layout.pp:
        raise ConfigError(f"{path}: parallel_config.pipeline_stage={layout.pp} must divide model_config.num_layers="
                          f"{cfg.num_layers} (each stage holds an equal share of the decoder layers)")
    count = cfg.parallel_config.micro_batch_num
    if rows_per_rank % count:
        raise ConfigError(f"{path}: parallel_config.micro_batch_num={count} must divide the {rows_per_rank} "
                          "responses each train rank gets per update")
    if sched.micro_batch_size_per_device:
        raise ConfigError(f"schedule.micro_batch_size_per_device={sched.micro_batch_size_per_device}: with pipeline "
                          f"stages the train micro-batches are {path}'s parallel_config.micro_batch_num; leave it 0")


def _policy_nets(config: GRPOConfig, job: JobOptions, world_size: int, rank: int):
    """(train_cfg, infer_cfg, train_layout, infer_layout, the step's `StepShape` over them) of the policy's two
    YAMLs, checked together; both nets carry the job's LoRA adapters (`lora`), if any."""
    sched, gen = config.schedule, config.generation
    train_cfg = with_lora(Qwen2Config.from_yaml(job.sft_path_train), config.lora)
    infer_cfg = with_lora(Qwen2Config.from_yaml(job.sft_path_infer), config.lora)
    check_model_configs(train_cfg, infer_cfg, job.sft_path_train, job.sft_path_infer)
    train_layout = Layout.from_config(train_cfg.parallel_config, world_size, rank,
                                      f"{job.sft_path_train}: parallel_config")
    infer_layout = Layout.from_config(infer_cfg.parallel_config, world_size, rank,
                                      f"{job.sft_path_infer}: parallel_config")
    check_unstaged(infer_layout, job.sft_path_infer, "the inference net (and the reference and the reward model "
                                                     "in its layout)")
    shape = StepShape.of(sched, gen.num_generations, infer_layout.dp, train_layout.dp)
    check_pipeline(train_cfg, train_layout, sched, shape.train_update_rows_per_rank, job.sft_path_train)
    check_tensor_parallel(train_cfg, train_layout.tp, job.sft_path_train)
    check_tensor_parallel(infer_cfg, infer_layout.tp, job.sft_path_infer)
    return train_cfg, infer_cfg, train_layout, infer_layout, shape


def check_lora_adapter(config: GRPOConfig, job: JobOptions) -> None:
    """A --load_lora_adapter folder must be a PEFT LoRA adapter of the job's rank, alpha and target modules."""
    if not job.load_lora_adapter:
        return
    from mindrlhf.models.qwen2.peft_files import LoraFilesError, check_adapter_config, read_peft_folder

    if not config.lora.enabled:
        raise ConfigError(f"--load_lora_adapter {job.load_lora_adapter}: the job trains no adapters (lora.lora_rank "
                          "is 0); give --lora_rank and the adapter's other settings")
    try:
        adapter_config, _ = read_peft_folder(job.load_lora_adapter)
        check_adapter_config(adapter_config, config.lora, job.load_lora_adapter)
    except LoraFilesError as err:
        raise ConfigError(str(err)) from None


def with_lora(model: Qwen2Config, lora: LoraConfig) -> Qwen2Config:
    """`model` with `lora`'s adapters (checked as the model's YAML is: a rank above a target layer's width refused,
    naming it)."""
    adapted = dataclasses.replace(model, lora=lora)
    adapted.validate()
    return adapted


# ---------------------------------------------------------------------- batches, tokenizer, generation
def _check_micro_batch_size(sched: ScheduleConfig, field: str, rows: int, whose: str) -> None:
    """`schedule.<field>` (0 = auto) must divide the `rows` it splits ("responses <whose>")."""
    size = getattr(sched, field)
    if size and rows % size:
        raise ConfigError(f"schedule.{field}={size} must divide the {rows} responses {whose}")


def _check_batches(config: GRPOConfig, job: JobOptions, shape: StepShape) -> int:
    """The step's prompts and responses (`shape`) split over the layouts' data-parallel ranks; returns the eval batch
    size (prompts per evaluation call on this rank: by default the rollout's rows, so the same graphs serve both)."""
    sched, group_size, train_dp, infer_dp = config.schedule, shape.group_size, shape.train_dp, shape.infer_dp
    if sched.batch_size % infer_dp:
        raise ConfigError(f"schedule.batch_size={sched.batch_size} is not divisible by the inference "
                          f"data_parallel={infer_dp} ({job.sft_path_infer})")
    eval_batch_size = config.eval.eval_batch_size or shape.rollout_rows_per_infer_rank
    unit = group_unit(group_size, train_dp)
    if sched.prompts_per_update % unit:
        raise ConfigError(f"schedule.mini_batch_size: {sched.prompts_per_update} prompts x {group_size} generations "
                          f"per update do not split evenly over the train data_parallel="
                          f"{train_dp} ({job.sft_path_train})")
    _check_micro_batch_size(sched, "micro_batch_size_per_device", shape.train_update_rows_per_rank,
                            f"each train rank gets per update ({sched.prompts_per_update} prompts x {group_size} "
                            f"generations / train data_parallel={train_dp})")
    _check_micro_batch_size(sched, "log_prob_micro_batch_size_per_device", shape.rollout_rows_per_infer_rank,
                            f"each inference rank generates per round ({sched.batch_size} prompts / "
                            f"inference data_parallel={infer_dp} x {group_size} generations)")
    return eval_batch_size


def resolve_token_ids(gen: GenerationConfig, stop_token_ids: Sequence[int], pad_token_id: int,
                      given: Mapping[str, str]) -> GenerationConfig:
    """`gen` with the stop and pad ids a job generates with: for `eos_token_ids` and `pad_token_id`, the value the
    user set (`given`: field name -> the YAML file or "command line" that set it) wins, with an info log naming
    it when it differs from the tokenizer's; a field not set takes the tokenizer's (`stop_token_ids`,
    `pad_token_id`)."""
    tokenizer_ids = {"eos_token_ids": [int(t) for t in stop_token_ids], "pad_token_id": int(pad_token_id)}
    resolved = {}
    for name, theirs in tokenizer_ids.items():
        if name not in given:
            resolved[name] = theirs
            continue
        resolved[name] = getattr(gen, name)
        if resolved[name] != theirs:
            logger.info("generation.%s=%s (from %s) is used instead of the tokenizer's %s", name, resolved[name],
                        given[name], theirs)
    return dataclasses.replace(gen, **resolved)


def _generation(config: GRPOConfig, tokenizer, job: JobOptions, train_cfg, infer_cfg) -> GenerationConfig:
    """`config.generation` with the stop and pad ids of `resolve_token_ids`, checked against both nets
    (vocabulary, cache length)."""
    if len(tokenizer) > train_cfg.vocab_size:
        raise ConfigError(f"{tokenizer.source}: the tokenizer has {len(tokenizer)} "
                          f"ids but {job.sft_path_train} model_config.vocab_size is {train_cfg.vocab_size}: "
                          "tokenizer and model do not belong together")
    given = {name: config.source_of("generation", name) for name in ("eos_token_ids", "pad_token_id")}
    gen = resolve_token_ids(config.generation, tokenizer.stop_token_ids, tokenizer.pad_token_id,
                            {name: source for name, source in given.items() if source})
    for cfg, path in ((infer_cfg, job.sft_path_infer), (train_cfg, job.sft_path_train)):
        for check, model_field, fields in ((gen.check_token_ids, cfg.vocab_size, ("eos_token_ids", "pad_token_id")),
                                           (gen.check_cache_length, cfg.seq_length,
                                            ("max_new_tokens", "prompt_buckets"))):
            try:
                check(model_field, path)
            except ConfigError as err:
                raise _sourced(config, "generation", fields, str(err)) from None
    return gen


def check_decode_rows(config: GRPOConfig, gen: GenerationConfig, job: JobOptions, shape: StepShape,
                      eval_batch_size: int) -> None:
    """`generation.min_decode_rows` is smaller than the rows an inference rank decodes at once (its rollout's, or
    with --eval_dataset_file a larger held-out call's): else no row count steps down and it would do nothing."""
    if not gen.min_decode_rows:
        return
    sched = config.schedule
    samples = shape.rollout_rows_per_infer_rank
    rows = gen.decode_rows(samples)
    counted = (f"generation.max_num_seqs={gen.max_num_seqs} slots" if rows < samples else
               f"{sched.batch_size} prompts / inference data_parallel={shape.infer_dp} x {shape.group_size} "
               "generations")
    if job.eval_dataset_file and gen.decode_rows(eval_batch_size) > rows:
        rows, counted = gen.decode_rows(eval_batch_size), f"eval.eval_batch_size={eval_batch_size} held-out prompts"
    try:
        gen.check_min_decode_rows(rows, counted)
    except ConfigError as err:
        raise _sourced(config, "generation", ("min_decode_rows",), str(err)) from None


def check_prompt_lengths(config: GRPOConfig, job: JobOptions, prompt_buckets: Sequence[int]) -> None:
    """Every training prompt (--mind_dataset_dir) fits the largest prompt bucket: checked once, before the cluster
    forms, rather than by each rank's data reader after it. Not with --plan (it reads no prompt) nor before the file
    is written (--check_flags); a file that cannot be read is left to the data reader, which says why."""
    path = job.mind_dataset_dir
    if job.plan or not os.path.isfile(path):
        return
    try:
        ids, _ = read_prompt_records(path)
    except (OSError, ValueError):  # not a MindRecord (yet): the data reader says what is wrong with it
        return
    largest = max(prompt_buckets)
    longer = [len(row) for row in ids if len(row) > largest]
    if not longer:
        return
    source = config.source_of("generation", "prompt_buckets")
    bucket = f"generation.prompt_buckets, from {source}" if source else "generation.prompt_buckets"
    raise_it = "add a larger bucket"
    if source and os.path.isfile(source) and is_mindspeed_yaml(load_yaml(source)):
        bucket, raise_it = f"rl_config.max_prompt_length of {source}", "raise max_prompt_length"
    raise ConfigError(f"{path}: {len(longer)} of {len(ids)} prompts are longer than the largest prompt bucket "
                      f"{largest} ({bucket}), the longest {max(longer)} tokens: convert them again with "
                      f"mindrlhf-prepare-data --max_prompt_length {largest} (it drops longer ones) or {raise_it}")


# ---------------------------------------------------------------------- critic and reward model
def _critic_config_and_layout(config: GRPOConfig, job: JobOptions, train_cfg, shape: StepShape, world_size: int,
                              rank: int):
    """(critic_cfg, critic_layout) of --sft_path_critic, or (None, None): a critic exactly when the advantage
    estimator is gae, reading the policy's tokens, split like a train net (`shape`: the step's rows)."""
    algo, sched, group_size = config.algorithm, config.schedule, shape.group_size
    if (algo.adv_estimator == "gae") != bool(job.sft_path_critic):
        raise ConfigError("algorithm.adv_estimator: 'gae' needs a critic (--sft_path_critic)"
                          if not job.sft_path_critic else
                          f"--sft_path_critic: a critic is only used by algorithm.adv_estimator gae, not "
                          f"{algo.adv_estimator!r}")
    if not job.sft_path_critic:
        return None, None

    path = job.sft_path_critic
    critic_cfg = with_lora(Qwen2Config.from_yaml(path), config.lora if config.critic.use_lora else LoraConfig())
    if job.load_critic_checkpoint:
        if critic_cfg.vocab_size != train_cfg.vocab_size:
            raise ConfigError(f"{path}: model_config.vocab_size={critic_cfg.vocab_size}, but "
                              f"the policy's is {train_cfg.vocab_size}: the critic must read the same tokens")
    else:  # the critic starts from the policy: the same network
        check_model_configs(train_cfg, critic_cfg, job.sft_path_train, path)
    critic_layout = Layout.from_config(critic_cfg.parallel_config, world_size, rank, f"{path}: parallel_config")
    check_pipeline(critic_cfg, critic_layout, sched, shape.update_rows_per_rank(critic_layout.dp), path)
    check_tensor_parallel(critic_cfg, critic_layout.tp, path)
    if shape.rollout_rows % critic_layout.dp:
        raise ConfigError(f"{path}: the {shape.rollout_rows} responses of a step do not "
                          f"split over the critic's data_parallel={critic_layout.dp}")
    unit = group_unit(group_size, critic_layout.dp)
    if sched.prompts_per_update % unit:
        raise ConfigError(f"schedule.mini_batch_size: {sched.prompts_per_update} prompts x {group_size} generations "
                          f"per update do not split evenly over the critic data_parallel="
                          f"{critic_layout.dp} ({path})")
    return critic_cfg, critic_layout


def reward_model_config(job: JobOptions, infer_cfg, infer_layout: Layout):
    """The reward model's architecture (--sft_path_reward, default the inference YAML), checked against the
    policy's tokens and the inference layout it runs in."""
    path = job.sft_path_reward
    if not path:
        return infer_cfg
    cfg = Qwen2Config.from_yaml(path)
    if cfg.vocab_size != infer_cfg.vocab_size:
        raise ConfigError(f"{path}: model_config.vocab_size={cfg.vocab_size}, but the policy's is "
                          f"{infer_cfg.vocab_size}: the reward model must read the same tokens")
    reward_split = (cfg.parallel_config.data_parallel, cfg.parallel_config.model_parallel)
    infer = (infer_layout.dp, infer_layout.tp)
    if reward_split != infer:
        raise ConfigError(f"{path}: parallel_config data_parallel x model_parallel = "
                          f"{reward_split[0]} x {reward_split[1]}, "
                          f"but the reward model runs in the inference layout ({infer[0]} x {infer[1]}, "
                          f"{job.sft_path_infer})")
    check_tensor_parallel(cfg, infer_layout.tp, path)
    return cfg


if __name__ == "__main__":
    sys.exit(main())
