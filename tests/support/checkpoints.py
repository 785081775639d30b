"""Checkpoints and strategy files the tests write or compare against: the tiny model's strategy for a 2-rank layout
and MindSpore's split of its whole checkpoint (the oracle of the shard tools), a trainer step folder of one net, a
strategy file's names renamed, and MindSpore's `transform_checkpoints` as the online reshard's oracle."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np

from mindrlhf.parallel.layout import Layout
from mindrlhf.parallel.strategy import ParamLayout, read_strategy_file, strategy_file_name, write_strategy_file
from support.paths import TINY, TINY_SFT_CKPT

# the 2-rank layouts the tiny model's checkpoint is cut for
NET_LAYOUTS = {"tp2": {"dp": 1, "tp": 2}, "dp2": {"dp": 2, "tp": 1}, "pp2": {"dp": 1, "tp": 1, "pp": 2}}


def tiny_strategy(root, key: str, prefix: str = "infer.") -> tuple[str, str]:
    """The tiny model's strategy files for a 2-rank layout as `--only_save_strategy` writes them (one per rank, each
    of its rank's pipeline stage, names with the net's `prefix`), and the same strategy with plain names in one file
    for MindSpore (the stages' files merged by `merge_pipeline_strategys`); returns (folder, plain file)."""
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.strategy import net_layouts

    cfg = Qwen2Config.from_yaml(os.path.join(TINY, "model.yaml"))
    for rank in range(2):
        layout = Layout(**NET_LAYOUTS[key], rank=rank)
        net = Qwen2ForCausalLM(cfg, layout)
        if prefix:
            net.update_parameters_name(prefix)
        layouts = net_layouts(net, layout)
        write_strategy_file(os.path.join(root, "strategy", strategy_file_name(rank)), layouts, stage=layout.stage)
        plain = {n[len(prefix):]: ParamLayout(n[len(prefix):], lay.dev_matrix, lay.tensor_map)
                 for n, lay in layouts.items()}
        write_strategy_file(os.path.join(root, "plain", strategy_file_name(rank)), plain, stage=layout.stage)
    plain_file = os.path.join(root, "plain_merged.ckpt")
    if key == "pp2":
        ms.parallel.merge_pipeline_strategys(os.path.join(root, "plain"), plain_file)
    else:
        shutil.copy(os.path.join(root, "plain", strategy_file_name(0)), plain_file)
    return os.path.join(root, "strategy"), plain_file


def mindspore_split(root, plain_strategy: str) -> str:
    """The oracle: MindSpore's transform of the whole checkpoint (as rank_0/ of a folder, no source strategy)."""
    os.makedirs(os.path.join(root, "whole", "rank_0"))
    shutil.copy(str(TINY_SFT_CKPT), os.path.join(root, "whole", "rank_0", "tiny_sft.ckpt"))
    ms.parallel.transform_checkpoints(os.path.join(root, "whole"), os.path.join(root, "oracle"), "checkpoint_", None,
                                      plain_strategy)
    return os.path.join(root, "oracle")


def write_trainer_checkpoint(weights: dict, step_dir: Path, net: str = "actor") -> None:
    """One net of a trainer step folder as tp=2 writes it: 2-D weights split along dim 0, with the net's name
    prefix, AdamW entries beside them (the critic's prefixed `critic_`)."""
    from mindrlhf.checkpoint.step import STEP_NETS, rank_dir, save_parameters
    from mindrlhf.parallel.strategy import layouts_for

    rank_file, strategy_file, prefix = STEP_NETS[net]
    optimizer = "critic_" if net == "critic" else ""
    weights = {prefix + name: value for name, value in weights.items()}
    axes = {name: 0 if value.ndim == 2 and value.shape[0] > 1 else None for name, value in weights.items()}
    layouts = layouts_for(Layout(dp=1, tp=2), axes, {name: value.shape for name, value in weights.items()})
    write_strategy_file(step_dir / strategy_file, layouts)
    for rank in range(2):
        os.makedirs(rank_dir(str(step_dir), rank), exist_ok=True)
        params = [ms.Parameter(ms.Tensor(np.ascontiguousarray(weights[name][lay.slice_of(rank)])), name=name)
                  for name, lay in layouts.items()]
        params += [ms.Parameter(ms.Tensor(np.ones(p.shape, np.float32)), name=f"{optimizer}adam_m.{p.name}")
                   for p in params[:2]]
        params += [ms.Parameter(ms.Tensor(3.0, ms.float32), name=f"{optimizer}adam_step"),
                   ms.Parameter(ms.Tensor(1e-3, ms.float32), name=f"{optimizer}learning_rate")]
        save_parameters(params, os.path.join(rank_dir(str(step_dir), rank), rank_file))


def transform_oracle(out, src_strategy, dst_strategy_renamed, tmp_path):
    from mindspore.parallel import transform_checkpoints
    dst_dir = tmp_path / "oracle"
    transform_checkpoints(str(out / "src_ckpt"), str(dst_dir), "oracle", src_strategy, dst_strategy_renamed)
    return dst_dir


def rename_strategy(path, prefix, out_path):
    layouts = read_strategy_file(path)
    renamed = {n[len(prefix):]: ParamLayout(n[len(prefix):], lay.dev_matrix, lay.tensor_map)
               for n, lay in layouts.items()}
    return write_strategy_file(out_path, renamed)
