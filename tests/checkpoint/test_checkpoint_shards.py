"""Folders of per-rank shards into nets (`mindrlhf.checkpoint.shards`; `--load_sft_checkpoint_train/_infer`,
`--load_ref_checkpoint`): in one process, each rank's net is built with `Layout(rank=r)` and must hold, bit for
bit, what loading the whole .ckpt gives it: from shards in its own layout (only its own rank file read), from
shards without a strategy file (MindSpore's transform output) and from shards of another layout (resharded on
load). Plus the one-line errors and the step folder kept apart. The tutorial's whole flow under msrun is at the
end."""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.checkpoints import NET_LAYOUTS, mindspore_split, tiny_strategy
from support.jobs import grpo_msrun_command
from support.msrun import free_port, msrun_env, run_command
from support.paths import GSM8K_SAMPLE, TINY, TINY_SFT_CKPT, TOKENIZER

from mindrlhf.checkpoint import shards as shards_module
from mindrlhf.checkpoint.step import CheckpointError
from mindrlhf.checkpoint.weights import load_weights, read_weights
from mindrlhf.cli import transform_checkpoint
from mindrlhf.parallel.layout import Layout
from mindrlhf.trainer.metrics import MACHINE_METRICS

PREFIX = "infer."
WHOLE = str(TINY_SFT_CKPT)


def build(key: str, rank: int, prefix: str = PREFIX):
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    layout = Layout(**NET_LAYOUTS[key], rank=rank)
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(os.path.join(TINY, "model.yaml")), layout)
    if prefix:
        net.update_parameters_name(prefix)
    return net, layout


def weights(net) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in net.get_parameters()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """key -> shards of the whole tiny checkpoint cut by the tool for that 2-rank layout (with strategy.ckpt), and
    'ms_tp2' -> MindSpore's transform of it for tp=2 (no strategy file)."""
    root = tmp_path_factory.mktemp("shards")
    found = {}
    for key in NET_LAYOUTS:
        strategy_dir, plain = tiny_strategy(str(root / key), key)
        found[key] = str(root / key / "shards")
        assert transform_checkpoint.main([f"--src_checkpoint={WHOLE}", f"--dst_checkpoint={found[key]}",
                                    f"--dst_strategy={strategy_dir}"]) == 0
        if key == "tp2":
            found["ms_tp2"] = mindspore_split(str(root / key), plain)
    return found


@pytest.fixture(scope="module")
def expected():
    """(key, rank) -> the net's weights loaded from the whole .ckpt."""
    cache = {}

    def get(key, rank):
        if (key, rank) not in cache:
            net, layout = build(key, rank)
            load_weights(net, layout, WHOLE, PREFIX)
            cache[key, rank] = weights(net)
        return cache[key, rank]
    return get


def load_recording_reads(monkeypatch, key, rank, folder):
    net, layout = build(key, rank)
    read = []
    original = shards_module.read_shard
    monkeypatch.setattr(shards_module, "read_shard", lambda path: read.append(path) or original(path))
    load_weights(net, layout, folder, PREFIX)
    return weights(net), read


def assert_same_weights(got, want, what):
    assert sorted(got) == sorted(want), what
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].tobytes() == value.tobytes(), (what, name)


@pytest.mark.parametrize("key", list(NET_LAYOUTS))
@pytest.mark.parametrize("rank", [0, 1])
def test_own_layout_shards_read_only_the_ranks_file(folders, expected, key, rank, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, "mindrlhf.checkpoint"):
        got, read = load_recording_reads(monkeypatch, key, rank, folders[key])
    assert read == [os.path.join(folders[key], f"rank_{rank}", f"checkpoint_{rank}.ckpt")]
    assert "another layout" not in caplog.text
    assert_same_weights(got, expected(key, rank), f"{key} rank {rank}")


@pytest.mark.parametrize("rank", [0, 1])
def test_shards_without_a_strategy_file_assume_the_nets_layout(folders, expected, rank, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, "mindrlhf.checkpoint"):
        got, read = load_recording_reads(monkeypatch, "tp2", rank, folders["ms_tp2"])
    assert read == [os.path.join(folders["ms_tp2"], f"rank_{rank}", f"checkpoint_{rank}.ckpt")]
    assert "no strategy.ckpt; the shards are taken to be in the net's layout (dp=1 x tp=2)" in caplog.text
    assert_same_weights(got, expected("tp2", rank), f"rank {rank}")


@pytest.mark.parametrize("src, dst", [("tp2", "dp2"), ("dp2", "tp2"), ("tp2", "pp2"), ("pp2", "tp2")])
@pytest.mark.parametrize("rank", [0, 1])
def test_shards_of_another_layout_are_resharded_on_load(folders, expected, src, dst, rank, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, "mindrlhf.checkpoint"):
        got, read = load_recording_reads(monkeypatch, dst, rank, folders[src])
    assert len(read) == 2 and "the shards are in another layout than the net's" in caplog.text
    assert_same_weights(got, expected(dst, rank), f"{src} -> {dst} rank {rank}")


def test_a_shard_folder_with_its_strategy_merges_to_the_whole_checkpoint(folders, tmp_path):
    import mindspore as ms

    whole = {name: p.asnumpy() for name, p in ms.load_checkpoint(WHOLE).items()}
    for key in NET_LAYOUTS:
        assert_same_weights(read_weights(folders[key]), whole, key)
    with pytest.raises(CheckpointError, match="without strategy.ckpt, so its full weights cannot be merged"):
        read_weights(folders["ms_tp2"])


def copy_folder(folders, key, tmp_path) -> Path:
    folder = tmp_path / key
    shutil.copytree(folders[key], folder)
    return folder


def test_errors_name_the_folder_and_what_was_expected(folders, tmp_path):
    folder = copy_folder(folders, "tp2", tmp_path)
    shutil.rmtree(folder / "rank_1")
    net, layout = build("tp2", 1)
    with pytest.raises(CheckpointError, match=rf"{folder}: no rank_1/\*.ckpt, the shards of rank 1"):
        load_weights(net, layout, str(folder), PREFIX)
    net, layout = build("dp2", 0)  # resharding reads every rank's file
    with pytest.raises(CheckpointError, match=r"no rank_<r>/\*.ckpt for rank\(s\) \[1\]"):
        load_weights(net, layout, str(folder), PREFIX)
    shapes = copy_folder(folders, "ms_tp2", tmp_path)  # tp=2 shards without a strategy into a dp=2 net
    with pytest.raises(CheckpointError, match=r"checkpoint_0.ckpt: not the shards of rank 0 of a net in layout dp=2 x "
                                              r"tp=1: 'model.tok_embeddings.embedding_weight' has shape \[352, 64\], "
                                              r"the net's shard \[704, 64\]"):
        load_weights(net, layout, str(shapes), PREFIX)


def test_a_ranks_trainer_file_loads_whole_or_not_at_all(tmp_path, monkeypatch):
    """`load_rank_params` (resume): every parameter, optimizer moments included, from the rank's file as it is, copied
    into the parameters' own storage (`set_data` would give them new storage, the old staying allocated: a resumed
    run peaked ~1 GiB a rank higher); a missing or reshaped entry is refused with all problems named, and nothing is
    set."""
    import mindspore as ms

    from mindrlhf.checkpoint.weights import load_rank_params
    from mindrlhf.parallel.layers import init_random_weights

    saved, layout = build("tp2", 0)
    init_random_weights(saved, layout, seed=3)
    moment = ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="adam_m.w")
    params = list(saved.get_parameters())
    ms.save_checkpoint(params + [moment], str(tmp_path / "rank.ckpt"))
    net, _ = build("tp2", 0)
    target = ms.Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name="adam_m.w")
    with monkeypatch.context() as patch:
        patch.setattr(ms.Parameter, "set_data", lambda *a, **k: pytest.fail("set_data replaces the storage"))
        load_rank_params(list(net.get_parameters()) + [target], str(tmp_path / "rank.ckpt"))
    for name, value in weights(saved).items():
        np.testing.assert_array_equal(weights(net)[name], value, err_msg=name)
    np.testing.assert_array_equal(target.asnumpy(), moment.asnumpy())

    fresh, _ = build("tp2", 0)
    before = weights(fresh)
    flat = ms.Parameter(ms.Tensor(np.zeros(3, np.float32)), name="adam_m.w")  # a moment sharded over dp: flat
    gone = ms.Parameter(ms.Tensor(np.zeros(2, np.float32)), name="adam_v.w")
    with pytest.raises(CheckpointError, match=r"rank.ckpt: 'adam_m.w' has shape \[2, 3\], the net's shard \[3\]; "
                                              r"'adam_v.w' missing \(parallel_config.optimizer_shard must be as in "
                                              r"the run that saved it\)$"):
        load_rank_params(list(fresh.get_parameters()) + [flat, gone], str(tmp_path / "rank.ckpt"))
    assert all(np.array_equal(value, before[name]) for name, value in weights(fresh).items())  # nothing set
    with pytest.raises(CheckpointError, match=r"nothing.ckpt: not a readable MindSpore checkpoint"):
        load_rank_params([], str(tmp_path / "nothing.ckpt"))


def test_shards_or_a_strategy_of_another_world_size_are_refused(folders, tmp_path):
    from mindrlhf.parallel.strategy import layouts_for, write_strategy_file

    net, layout = build("tp2", 0)
    folder = copy_folder(folders, "tp2", tmp_path)
    write_strategy_file(folder / "strategy.ckpt", layouts_for(Layout(tp=4), {"model.norm_out.weight": None},
                                                              {"model.norm_out.weight": (64,)}))
    with pytest.raises(CheckpointError, match=r"strategy.ckpt: a strategy of 4 ranks, but the job has 2"):
        load_weights(net, layout, str(folder), PREFIX)
    write_strategy_file(folder / "strategy.ckpt", layouts_for(Layout(tp=2), {"model.norm_out.weight": None},
                                                              {"model.norm_out.weight": (64,)}))
    with pytest.raises(CheckpointError, match=r"no layout for the net's parameter\(s\) lm_head.weight"):
        load_weights(net, layout, str(folder), PREFIX)
    shutil.copytree(folder / "rank_1", folder / "rank_3")
    with pytest.raises(CheckpointError, match=r"holds shards of rank\(s\) \[3\], but the job has 2 ranks"):
        load_weights(net, layout, str(folder), PREFIX)
    (tmp_path / "empty").mkdir()
    for read in (lambda path: load_weights(net, layout, path, PREFIX), read_weights):  # one message for both
        with pytest.raises(CheckpointError, match=r"empty: neither a trainer step folder \(meta.json, "
                                                  r"\*_strategy.ckpt\) nor a folder of per-rank shards"):
            read(str(tmp_path / "empty"))


def test_a_trainer_step_folder_is_not_taken_for_a_shard_folder(folders, expected, tmp_path):
    """A step folder's rank files are read as the trainer wrote them (train.ckpt through train_strategy.ckpt), not
    as the last .ckpt of each rank folder."""
    step = copy_folder(folders, "tp2", tmp_path)
    os.replace(step / "strategy.ckpt", step / "train_strategy.ckpt")
    for rank in range(2):
        os.replace(step / f"rank_{rank}" / f"checkpoint_{rank}.ckpt", step / f"rank_{rank}" / "train.ckpt")
        shutil.copy(folders["dp2"] + f"/rank_{rank}/checkpoint_{rank}.ckpt", step / f"rank_{rank}" / "zzz.ckpt")
    (step / "meta.json").write_text(json.dumps({"step": 1}))
    for rank in range(2):
        net, layout = build("dp2", rank)
        load_weights(net, layout, str(step), PREFIX)
        assert_same_weights(weights(net), expected("dp2", rank), f"rank {rank}")
    damaged = step / "rank_1" / "train.ckpt"
    with open(damaged, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match=rf"^{damaged}: not a readable MindSpore checkpoint \("):
        read_weights(str(step), "actor")


def test_a_path_is_one_form_of_checkpoint_decided_once(folders, tmp_path):
    """Every reader asks `checkpoint_form`: a file, a step folder (meta.json or a net's strategy file, even with
    rank shards beside), a shard folder; an empty folder or a missing path is one error naming it."""
    from mindrlhf.checkpoint.shards import checkpoint_form

    shards = copy_folder(folders, "tp2", tmp_path)
    assert checkpoint_form(str(shards)) == "shards"
    assert checkpoint_form(str(shards / "rank_0" / "checkpoint_0.ckpt")) == "file"
    (shards / "meta.json").write_text("{}")
    assert checkpoint_form(str(shards)) == "step"
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'empty'}: neither a trainer step folder"):
        read_weights(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'nowhere'}: checkpoint not found"):
        load_weights(*build("tp2", 0), str(tmp_path / "nowhere"), PREFIX)


# ---------------------------------------------------------------- msrun: the tutorial's flow at tiny size
def mindrlhf_yaml(tmp_path, net: str) -> str:
    """The tiny model's YAML of `net` written as MindRLHF's Qwen2.5 YAMLs write a model: rotary_emb_base instead of
    theta, max_position_embeddings, kv_channels, a list eos_token_id, and keys with no meaning here (one warning)."""
    data = yaml.safe_load((TINY / f"{net}.yaml").read_text())
    model = data["model"]["model_config"]
    model["type"] = "LlamaConfig"
    model["rotary_emb_base"] = model.pop("theta")
    model["max_position_embeddings"] = model.pop("max_position_embedding")
    model["eos_token_id"] = [model["eos_token_id"], model["bos_token_id"]]
    model.update(kv_channels=model["hidden_size"] // model["num_heads"], rotary_pct=1.0, compute_in_2d=True,
                 temperature=0.7, min_decode_length=1, use_past=True)
    data["model"]["arch"] = {"type": "LlamaForCausalLM"}
    path = tmp_path / f"mindrlhf_{net}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def tutorial_args(mindrecord, out_dir, *extra, yamls=None):
    yamls = yamls or {net: str(TINY / f"{net}.yaml") for net in ("train", "infer")}
    return ["--sft_path_train", yamls["train"], "--sft_path_infer", yamls["infer"],
            "--vocab_path", str(TOKENIZER / "vocab.json"), "--merges_file_path", str(TOKENIZER / "merges.txt"),
            "--mind_dataset_dir", str(mindrecord), "--config", str(TINY / "grpo.yaml"),
            "--output_dir", str(out_dir), "--steps", "1", "--max_new_tokens", "16", "--num_iterations", "1",
            "--save_interval", "0", "--use_parallel", "True", "--enable_compile_cache", "False", *extra]


def run_msrun(tmp_path, name, args):
    done = run_command(grpo_msrun_command(tmp_path / f"{name}_logs", free_port(), args), msrun_env(), timeout=900)
    logs = [p.read_text(errors="replace") for p in sorted((tmp_path / f"{name}_logs").glob("worker_*.log"))]
    tails = "".join(log[-3000:] for log in logs)
    assert done.returncode == 0, f"{name}: {done.stdout[-2000:]}{done.stderr[-2000:]}{tails}"
    return "".join(logs)


@pytest.mark.msrun
def test_the_tutorials_shards_train_like_the_whole_checkpoint(tmp_path):
    """`--only_save_strategy` (2 workers) -> tools/transform_checkpoint.py in the tutorial's `--flag=value` form for
    the train (tp=2), infer (dp=2) and ref (dp=2) strategies -> a 1-step run from the three shard folders, whose
    first metrics line equals a run's from the whole .ckpt (same seed), clock and memory readings aside."""
    from mindrlhf.data.mindrecord import convert_to_mindrecord
    from mindrlhf.models.qwen2 import Qwen2Tokenizer

    mindrecord = tmp_path / "sample.mindrecord"
    convert_to_mindrecord(GSM8K_SAMPLE, mindrecord,
                          Qwen2Tokenizer(TOKENIZER / "vocab.json", TOKENIZER / "merges.txt"), template="r1_think",
                          max_prompt_length=256)
    yamls = {net: mindrlhf_yaml(tmp_path, net) for net in ("train", "infer")}
    run_msrun(tmp_path, "strategy", tutorial_args(mindrecord, tmp_path / "strategy_run", "--only_save_strategy",
                                                  yamls=yamls))
    shards = {}
    # the tool's main() on the tutorial's command line, in this process (test_transform_checkpoint.py runs the script)
    tool = transform_checkpoint
    for net in ("train", "infer", "ref"):
        shards[net] = tmp_path / f"ckpt_{net}"
        assert tool.main([f"--src_checkpoint={WHOLE}", f"--dst_checkpoint={shards[net]}",
                          f"--dst_strategy={tmp_path / 'strategy_run' / 'strategy' / net}"]) == 0
    logs = run_msrun(tmp_path, "shards", tutorial_args(
        mindrecord, tmp_path / "from_shards", "--only_save_strategy", "False",
        "--load_sft_checkpoint_train", str(shards["train"]), "--load_sft_checkpoint_infer", str(shards["infer"]),
        "--load_ref_checkpoint", str(shards["ref"]), "--save_ckpt_dir", str(tmp_path / "save_ckpt"),
        "--save_data_file", str(tmp_path / "grpo.mindrecord"), yamls=yamls))
    assert "another layout" not in logs and "no strategy.ckpt" not in logs  # each rank read its own shards
    # MindRLHF's keys: mapped (the run below from the plain YAMLs gives the same numbers), the rest named once
    assert "compute_in_2d" in logs and "temperature" in logs
    assert (tmp_path / "save_ckpt" / "step_000001" / "meta.json").is_file()
    assert (tmp_path / "grpo.mindrecord.step_000001.mindrecord").is_file()
    run_msrun(tmp_path, "whole", tutorial_args(mindrecord, tmp_path / "from_whole", "--load_sft_checkpoint_train",
                                               WHOLE))
    shards_line, whole_line = [json.loads((tmp_path / run / "metrics.jsonl").read_text().splitlines()[0])
                               for run in ("from_shards", "from_whole")]
    assert sorted(shards_line) == sorted(whole_line)
    compared = [key for key in whole_line if not key.startswith(MACHINE_METRICS)]
    assert len(compared) > 10
    assert {k: shards_line[k] for k in compared} == {k: whole_line[k] for k in compared}

