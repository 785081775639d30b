"""Weights files into nets: a whole `.ckpt` (as `tools/convert_weight.py` writes it) or one net of a trainer step
folder, read to full arrays and split to this rank's shards; a folder of per-rank shards (`rank_<r>/*.ckpt`, as
`tools/transform_checkpoint.py` writes it), read rank by rank or resharded (`mindrlhf.checkpoint.shards`); this
rank's own checkpoint files, read as they are."""
from __future__ import annotations

import os

import numpy as np
from mindspore import Tensor, ops

from mindrlhf.checkpoint.shards import checkpoint_form, listed, load_shards, match_params, merge_shard_folder
from mindrlhf.checkpoint.step import (
    STEP_NETS,
    CheckpointError,
    is_optimizer_state,
    is_step_folder,
    is_weight,
    plain_name,
    rank_dir,
    read_arrays,
    read_meta,
    stored_parameters,
)
from mindrlhf.configs.base import ConfigError
from mindrlhf.configs.lora import is_adapter
from mindrlhf.models.qwen2.peft_files import LoraFilesError, merged_weights, read_peft_folder
from mindrlhf.parallel.layers import init_random_weights, load_full_state, lora_full_state
from mindrlhf.parallel.strategy import StrategyError, merge_shards, read_staged_strategy_file, staged_world_size

VALUE_HEAD = "score.weight"
VALUE_HEAD_BIAS = "score.bias"


def read_weights(path: str, net: str = "actor") -> dict:
    """Weights (name -> numpy array) of a `.ckpt` file, of one net of a trainer `step_*` folder (`STEP_NETS`:
    the actor's or the critic's rank shards merged through its strategy file, names without the net's prefix) or of
    a folder of per-rank shards with its `strategy.ckpt` (merged through it); optimizer entries are dropped. Errors
    name the file."""
    return _read_form(path, checkpoint_form(path), net)


def _read_form(path: str, form: str, net: str) -> dict:
    """The weights of `path` in its `checkpoint_form`; each form's reader leaves the optimizer entries out."""
    if form == "shards":
        return merge_shard_folder(path)
    if form == "step":
        return merge_trainer_checkpoint(path, net)
    return read_arrays(path, keep=is_weight)


def merge_trainer_checkpoint(step_dir: str, net: str = "actor") -> dict:
    """The full weights (name -> numpy array) of one net of a trainer checkpoint folder (`STEP_NETS`): every
    rank's file merged through the net's strategy file, the net's name prefix removed; optimizer entries are
    dropped."""
    rank_file, strategy_file, prefix = STEP_NETS[net]
    strategy_path = os.path.join(step_dir, strategy_file)
    if not os.path.isfile(strategy_path):
        raise CheckpointError(f"{step_dir}: not a trainer checkpoint folder with a {net} (no {strategy_file})")
    try:
        layouts, stages = read_staged_strategy_file(strategy_path)  # a train net in pipeline stages: all of them
        world = staged_world_size(layouts, stages, strategy_path)
        shards = []
        for rank in range(world):
            path = os.path.join(rank_dir(step_dir, rank), rank_file)
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: missing ({strategy_path} describes {world} ranks)")
            shards.append(read_arrays(path, keep=is_weight))
        merged = merge_shards(shards, layouts, step_dir, stages)
        return {name[len(prefix):] if name.startswith(prefix) else name: value for name, value in merged.items()}
    except (StrategyError, RuntimeError) as err:
        raise CheckpointError(f"{step_dir}: cannot merge the rank checkpoints: {str(err).splitlines()[0]}") from None


def load_weights(net, layout, path: str, prefix: str = "", adapter_seed: int = 0) -> None:
    """Loads a full `.ckpt` (split to this rank's shards), a trainer step folder (its actor, merged and split) or a
    folder of per-rank shards (`shards.load_shards`: this rank's own file, or resharded) into `net`.

    Names in the files are the plain model names (as `tools/convert_weight.py` writes them; a net prefix in them
    is dropped); the net's own names may carry `prefix`. Optimizer entries are ignored. Adapters in the file (a LoRA
    job's step) are merged into their weights, and a net with adapters starts them as PEFT does
    (`load_state_merging_adapters`). Errors name the file.
    """
    form = checkpoint_form(path)
    if form == "shards":
        load_shards(net, layout, path, prefix)
        return
    state = _read_form(path, form, "actor")
    load_state_merging_adapters(net, layout, {prefix + plain_name(name): value for name, value in state.items()},
                                path, prefix, adapter_seed)


def load_state_merging_adapters(net, layout, state: dict, source: str, prefix: str = "", adapter_seed: int = 0,
                                where: str = "") -> None:
    """Loads the full arrays `state` (read from `source`; names with `prefix`) into `net`. LoRA adapters in `state`
    are merged into their weights first (W + alpha/r B A, alpha from `source`'s step folder): a LoRA job's policy
    starts another job as the policy it computes, and is that job's reference too; `net`'s own adapters, if any,
    then start as PEFT's (B = 0). Errors name `source` (and `where`)."""
    suffix = f" ({where})" if where else ""
    state = merge_saved_adapters(state, source)
    try:
        missing = load_full_state(net, state, layout, strict=False)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}{suffix}") from None
    others = [name for name in missing if not is_adapter(name)]
    if others:
        raise ConfigError(f"{source}: parameters missing from the state: {', '.join(others)}{suffix}")
    if missing:
        start_adapters(net, layout, adapter_seed, prefix)


def merge_saved_adapters(state: dict, source: str) -> dict:
    """`state` with the LoRA adapters it holds, if any, merged into their weights (`peft_files.merged_weights`), at
    the lora_alpha `source` was trained with."""
    if not any(is_adapter(name) for name in state):
        return state
    try:
        return merged_weights(state, saved_lora_alpha(source))
    except LoraFilesError as err:
        raise ConfigError(f"{source}: {err}") from None


def saved_lora_alpha(path: str) -> float:
    """The lora_alpha of the adapters a trainer step folder holds (its job config's); an error naming `path` where
    the file does not say it."""
    alpha = read_meta(path).get("config", {}).get("lora", {}).get("lora_alpha") if is_step_folder(path) else None
    if alpha is None:
        raise ConfigError(f"{path}: holds LoRA adapters but not their lora_alpha (a trainer step folder's meta.json "
                          "says it): merge them first with tools/convert_weight.py --reverse --merge_lora "
                          "--lora_alpha A")
    return float(alpha)


def load_adapters(net, layout, folder: str, prefix: str = "") -> None:
    """Loads a PEFT LoRA folder's adapters into `net` (every adapter of the net, split to this rank's shards; the
    net's names may carry `prefix`)."""
    _, adapters = read_peft_folder(folder)
    adapters = {prefix + name: value for name, value in adapters.items()}
    try:
        missing = [name for name in load_full_state(net, adapters, layout, strict=False) if is_adapter(name)]
    except ValueError as err:
        raise ConfigError(f"{folder}: {err}") from None
    if missing:
        raise ConfigError(f"{folder}: no adapter for {missing[0]} (and {len(missing) - 1} more)")


def start_from(net, layout, checkpoint: str, seed: int) -> None:
    """A job's start for `net`: `checkpoint` (`load_weights`, adapters seeded by `seed`), or `random_start`."""
    if checkpoint:
        load_weights(net, layout, checkpoint, adapter_seed=seed)
    else:
        random_start(net, layout, seed)


def random_start(net, layout, seed: int, prefix: str = "") -> None:
    """Random weights of `seed` for a job that starts without a checkpoint, its adapters, if any, as PEFT starts
    them (B = 0: the net computes its random base model)."""
    init_random_weights(net, layout, seed=seed)
    start_adapters(net, layout, seed, prefix)


def start_adapters(net, layout, seed: int, prefix: str = "") -> None:
    """Sets `net`'s LoRA adapters to PEFT's start (A seeded, B zero: the net computes its base model's logits)."""
    load_full_state(net, lora_full_state(net, layout, seed, prefix), layout, strict=False)


def load_value_model(net, layout, state: dict, source: str, prefix: str, yaml_path: str,
                     adapter_seed: int = 0) -> None:
    """Loads the backbone and value head of `state` (from `source`) into the value model `net` (names with
    `prefix`; adapters as `load_state_merging_adapters` does); the head's bias must be there exactly when
    `yaml_path` declares `value_head_bias`."""
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
    load_state_merging_adapters(net, layout, wanted, source, prefix, adapter_seed, yaml_path)


def value_model_start(path: str, hidden_size: int, bias: bool) -> dict:
    """The weights a value model starts from: a reward model or critic (a step folder's critic, or a file with a value
    head) as it is, a policy's backbone with a zero value head (`with_zero_value_head`)."""
    holds_critic = checkpoint_form(path) == "step" and os.path.isfile(os.path.join(path, STEP_NETS["critic"][1]))
    state = read_weights(path, "critic" if holds_critic else "actor")
    return state if VALUE_HEAD in state else with_zero_value_head(state, hidden_size, bias)


def with_zero_value_head(state: dict, hidden_size: int, bias: bool) -> dict:
    """`state` (a policy's weights) with a zero value head of `hidden_size` inputs (and bias): the critic's start
    when no critic checkpoint is given."""
    state = dict(state)
    state[VALUE_HEAD] = np.zeros((1, hidden_size), np.float32)
    if bias:
        state[VALUE_HEAD_BIAS] = np.zeros((1,), np.float32)
    return state


def load_rank_params(params, path: str) -> None:
    """Sets `params` from this rank's checkpoint file `path` (a trainer step's), names as they are (net prefix,
    optimizer state); every one must be there with its shape. Nothing is set unless all are."""
    with stored_parameters(path) as state:
        pairs, problems = match_params(params, state)
        if problems:
            # moments sharded over dp are flat slices (`mindrlhf.optim.ShardedAdamW`), whole ones are not
            moments = any(is_optimizer_state(p.name) and p.name in state and
                          tuple(state[p.name].shape) != tuple(p.shape) for p in params)
            hint = " (parallel_config.optimizer_shard must be as in the run that saved it)" if moments else ""
            raise CheckpointError(f"{path}: {listed(problems)}{hint}")
        # one tensor's copy at a time, into the parameter's own storage: `set_data` would give it new storage while
        # the old one stays allocated (a resumed SmolLM2 run peaked ~1 GiB a rank above the straight run)
        for param, stored in pairs:
            ops.assign(param, Tensor(stored.array(), param.dtype))
