"""A PPO job with LoRA adapters (#68) in one process: the policy starts from a base checkpoint with PEFT's adapters
(B = 0), only the adapters train (the optimizer holds them alone; every base weight is saved bit-identical to the
checkpoint it started from), the rollout runs on a copy of the adapted weights with the adapters merged in after each
update (or, asked, through the adapters), the reference is the base model without adapters, the critic trains
adapters of its own and its value head on its frozen backbone, and a resumed job continues bit for bit. The
trained adapters, exported as a PEFT folder, start a new job (--load_lora_adapter); an adapter of another rank is
refused in one line."""
import json

import numpy as np
import pytest
from support.jobs import base_args
from support.paths import TINY, TINY_SFT_CKPT

from mindrlhf.checkpoint.weights import read_weights
from mindrlhf.cli import train
from mindrlhf.configs.lora import is_adapter
from mindrlhf.models.qwen2.peft_files import merged_weights

pytestmark = [pytest.mark.usefixtures("graph_mode"), pytest.mark.slow]


def reference_and_policy_log_probs(actor, reference, merged: bool = True) -> tuple:
    """Log-probs of 16 random responses under the reference, the policy (the rollout's net: `merged` copy or the
    inference net itself), and the policy with every B zeroed (its adapters off: the base model)."""
    import mindspore as ms

    rng = np.random.default_rng(0)
    columns = {"prompt_ids": rng.integers(3, 700, (16, 256), dtype=np.int32),
               "prompt_mask": np.ones((16, 256), np.int32),
               "response_ids": rng.integers(3, 700, (16, 96), dtype=np.int32),
               "response_mask": np.ones((16, 96), np.int32)}
    ref, policy = reference.engine.run(columns), actor.old_log_probs.run(columns)
    b_weights = [p for p in actor.infer_net.get_parameters() if p.name.endswith("lora_b")]
    trained = [b.asnumpy().copy() for b in b_weights]
    for b in b_weights:
        b.set_data(ms.Tensor(np.zeros_like(b.asnumpy())))
    if merged:
        actor.merge()  # the rollout's merged copy of the adapters that are now off
    base = actor.old_log_probs.run(columns)
    for b, value in zip(b_weights, trained):
        b.set_data(ms.Tensor(value))
    if merged:
        actor.merge()
    return ref, policy, base


def merged(weights: dict, lora_alpha: float) -> dict:
    """Each adapted layer's weight with its adapter merged in, W + (alpha / r) B A (numpy: `merged_weights`, which
    the PEFT export tests check against peft), in the weight's dtype."""
    adapted = {name[:-len("lora_a")] + "weight" for name in weights if name.endswith(".lora_a")}
    return {name: value for name, value in merged_weights(weights, lora_alpha).items() if name in adapted}


def test_a_lora_job_trains_the_adapters_only_against_the_base_model_as_reference(tmp_path, mindrecord, capfd):
    """The actor's and the critic's adapters (and the critic's head) alone train; both resume bit for bit."""
    base = read_weights(str(TINY_SFT_CKPT))
    seen = {}

    def check(trainer, step, metrics):
        if step != 1:
            return
        actor, reference = trainer.actor, trainer.reference
        seen["optimized"] = [p.name for p in actor.engine.optimizer.parameters]
        seen["critic_optimized"] = [p.name for p in trainer.critic.engine.optimizer.parameters]
        seen["reference"] = {p.name: p.asnumpy().copy() for p in reference.net.get_parameters()}
        seen["train"] = {p.name: p.asnumpy().copy() for p in actor.train_net.get_parameters()}
        policy_params = {id(p) for p in actor.infer_net.get_parameters()}
        seen["shared"] = all(id(p) in policy_params for p in reference.net.get_parameters())
        seen["ref_groups"] = reference.swap_groups()
        # the rollout: the model without adapters, the adapted layers' weights merged after the update and synced
        # (the train net's), every other parameter the policy's own
        seen["rollout"] = {p.name: p.asnumpy().copy() for p in actor.rollout_net.get_parameters()}
        seen["rollout_shares"] = sorted(p.name for p in actor.rollout_net.get_parameters() if id(p) in policy_params)
        seen["log_probs"] = reference_and_policy_log_probs(actor, reference)

    out = tmp_path / "out"
    args = base_args(mindrecord, out) + ["--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "2",
                                         "--save_interval", "1", "--lora_rank", "4", "--lora_alpha", "8",
                                         "--lora_target_modules", "q_proj", "v_proj", "down_proj",
                                         "--sft_path_critic", str(TINY / "model.yaml"), "--adv_estimator", "gae",
                                         "--critic.learning_rate", "1e-3"]
    assert train.main(args, callbacks=[check]) == 0
    adapters = sorted(n for n in seen["train"] if is_adapter(n))
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 modules in each of the 2 layers
    assert sorted(seen["optimized"]) == adapters
    # the reference: the base model (no adapters) on the policy's own base weights (no copy to swap or save), its
    # log-probs the policy's with the adapters off, not the policy's
    assert not any(is_adapter(n) for n in seen["reference"])
    assert set(seen["reference"]) == set(base) and seen["shared"] and seen["ref_groups"] == {}
    for name, value in base.items():
        np.testing.assert_array_equal(seen["reference"][name], value, err_msg=name)
    expected = merged(seen["train"], 8)
    assert sorted(seen["rollout"]) == sorted(seen["rollout_shares"] + [f"rollout.{n}" for n in expected])
    assert not any(is_adapter(n) for n in seen["rollout"]) and set(seen["rollout_shares"]) < set(base)
    for name, value in expected.items():
        np.testing.assert_allclose(seen["rollout"][f"rollout.{name}"], value, rtol=1e-6, atol=1e-7, err_msg=name)
        assert not np.array_equal(value, base[name])  # the adapters moved in step 1: the merge is not the base
    ref_logp, policy_logp, base_logp = seen["log_probs"]
    assert np.abs(ref_logp - policy_logp).max() > 1e-4
    np.testing.assert_allclose(ref_logp, base_logp, atol=1e-5)
    assert not list((out / "checkpoints" / "step_000001").rglob("ref.ckpt"))
    # after two steps: every base weight is the checkpoint's, bit for bit; the adapters learned
    saved = read_weights(str(out / "checkpoints" / "step_000002"))
    assert sorted(n for n in saved if is_adapter(n)) == adapters
    for name, value in base.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=f"{name} moved")
    b_norms = [np.abs(saved[n]).max() for n in adapters if n.endswith(".lora_b")]
    assert min(b_norms) > 0  # B started at 0
    # the critic: adapters of its own and the value head train, its backbone (the policy's base) stays
    assert sorted(seen["critic_optimized"]) == sorted(f"critic.{n}" for n in adapters + ["score.weight"])
    critic = read_weights(str(out / "checkpoints" / "step_000002"), "critic")
    for name, value in base.items():
        if name != "lm_head.weight":
            np.testing.assert_array_equal(critic[name], value, err_msg=f"critic {name} moved")
    assert np.abs(critic["score.weight"]).max() > 0
    assert max(np.abs(critic[n]).max() for n in adapters if n.endswith(".lora_b")) > 0
    assert any(not np.array_equal(critic[n], saved[n]) for n in adapters)  # not the actor's
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "actor/grad_norm" in r] == [1, 2]
    assert all(np.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0 for r in lines if "actor/grad_norm" in r)
    # resumed from step 1, the job's step 2 is the straight run's, bit for bit
    import shutil

    from support.jobs import without_timing

    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001")
    assert train.main(base_args(mindrecord, resumed) + args[len(base_args(mindrecord, out)):] + ["--resume"]) == 0
    step2 = [without_timing(r) for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())
             if r["step"] == 2]
    assert step2 and step2 == [without_timing(r) for r in lines if r["step"] == 2]
    again_saved = read_weights(str(resumed / "checkpoints" / "step_000002"))
    for name in adapters:
        np.testing.assert_array_equal(again_saved[name], saved[name], err_msg=name)
    again_critic = read_weights(str(resumed / "checkpoints" / "step_000002"), "critic")
    for name in adapters + ["score.weight"]:
        np.testing.assert_array_equal(again_critic[name], critic[name], err_msg=f"critic {name}")
    # the trained adapters as a PEFT folder (lora_alpha from the step folder), then the start of a new job
    from mindrlhf.cli import convert_weight

    step = out / "checkpoints" / "step_000002"
    adapter = tmp_path / "adapter"
    assert convert_weight.main(["--reverse", "--mindspore_ckpt_path", str(step), "--torch_ckpt_dir", str(adapter),
                                "--config_path", str(TINY / "model.yaml")]) == 0
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"] == 8.0
    started = {}

    def first(trainer, step, metrics):
        started.update({p.name: p.asnumpy().copy() for p in trainer.actor.train_net.get_parameters()})

    again = base_args(mindrecord, tmp_path / "again") + [
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "1", "--learning_rate", "1e-12",
        "--lora_rank", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj", "down_proj",
        "--load_lora_adapter", str(adapter)]
    assert train.main(again, callbacks=[first]) == 0
    for name in adapters:  # an update of lr 1e-12 moves them by ~1e-12
        np.testing.assert_allclose(started[name], saved[name], atol=1e-8, err_msg=name)
    other_rank = list(again)
    other_rank[other_rank.index("--lora_rank") + 1] = "2"
    capfd.readouterr()
    assert train.main(other_rank) == 2
    err = capfd.readouterr().err
    assert "the adapter has r=4" in err and "lora_rank=2" in err and "Traceback" not in err


def test_a_lora_jobs_own_inference_net_gets_the_base_once_and_the_adapters_every_step(tmp_path, mindrecord):
    """An inference net of its own (float16 weights: not the train net): the first reshard moves every weight,
    a step's the adapters alone (every move an adapter's, their bytes a fraction of the base's; a mark put on an
    inference base weight after step 1 is still there after step 2's sync); the inference net holds the train net's
    adapters after each step."""
    import mindspore as ms
    from support.jobs import yaml_with

    infer_yaml = yaml_with(tmp_path, "infer.yaml", [("param_init_type: float32", "param_init_type: float16")])
    seen, rollout = [], []

    def check(trainer, step, metrics):
        actor = trainer.actor
        moved = [m.dst_name for m in actor.adapters_to_infer.moves]
        everything = [m.dst_name for m in actor.to_infer.moves]
        train = {p.name: p.asnumpy().copy() for p in actor.train_net.get_parameters()}
        infer = {p.name.split(".", 1)[1]: p.asnumpy().copy() for p in actor.infer_net.get_parameters()}
        rollout.append({p.name.split(".", 1)[1]: p.asnumpy().copy() for p in actor.merge.targets})
        seen.append((moved, everything, train, infer))
        if step == 1:  # a mark on an inference base weight: step 2's sync, adapters only, must leave it
            norm = next(p for p in actor.infer_net.get_parameters() if p.name.endswith("norm_out.weight"))
            norm.set_data(ms.Tensor(norm.asnumpy() * 2))

    args = base_args(mindrecord, tmp_path / "out") + [
        "--sft_path_infer", str(infer_yaml), "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "2",
        "--lora_rank", "4", "--lora_alpha", "8"]
    assert train.main(args, callbacks=[check]) == 0
    for moved, everything, train_weights, infer_weights in seen:
        assert moved and all(is_adapter(name) for name in moved)
        assert set(moved) < set(everything) and any(not is_adapter(name) for name in everything)
        assert set(infer_weights) == set(train_weights)
        adapter_bytes = sum(train_weights[n].nbytes for n in train_weights if is_adapter(n))
        assert adapter_bytes < 0.2 * sum(v.nbytes for v in train_weights.values())
    # the step's update is in the inference net by the next step's rollout: compare after the sync of step 2's
    # callback (each callback runs after its step's reshard)
    _, _, train_weights, infer_weights = seen[-1]
    for name, value in train_weights.items():  # float16 copies of the float32 weights
        expected = value.astype(np.float16) * (2 if name.endswith("norm_out.weight") else 1)
        np.testing.assert_array_equal(infer_weights[name], expected, err_msg=name)
    assert any(not np.array_equal(seen[0][2][n], seen[1][2][n]) for n in seen[0][2] if is_adapter(n))
    # the rollout's copy: each step, the float16 inference weights with their adapters merged in (in float32, then
    # rounded to float16), not the base
    for (_, _, _, infer_weights), copy in zip(seen, rollout):
        expected = merged(infer_weights, 8)
        assert sorted(copy) == sorted(expected)
        for name, value in expected.items():
            assert copy[name].dtype == value.dtype == np.float16
            np.testing.assert_allclose(copy[name].astype(np.float32), value.astype(np.float32), rtol=2e-3, atol=1e-4,
                                       err_msg=name)
            assert not np.array_equal(copy[name], infer_weights[name])


def test_a_lora_job_may_roll_out_through_the_adapters_without_a_merged_copy(tmp_path, mindrecord):
    """`--lora_merged_rollout false`: the rollout runs on the inference net itself (its adapters in the decode
    graph), no merged copy exists, and its log-probs of the rollout are the adapted policy's."""
    seen = {}

    def check(trainer, step, metrics):
        actor = trainer.actor
        seen.update(merge=actor.merge, same=actor.rollout_net is actor.infer_net, groups=set(actor.swap_groups()),
                    adapters=sum(is_adapter(p.name) for p in actor.rollout_net.get_parameters()),
                    log_probs=reference_and_policy_log_probs(actor, trainer.reference, merged=False))

    args = base_args(mindrecord, tmp_path / "out") + [
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "1", "--lora_rank", "4", "--lora_alpha", "8",
        "--lora_merged_rollout", "false"]
    assert train.main(args, callbacks=[check]) == 0
    assert seen["merge"] is None and seen["same"] and seen["adapters"] > 0 and "rollout_weights" not in seen["groups"]
    ref_logp, policy_logp, base_logp = seen["log_probs"]
    assert np.abs(ref_logp - policy_logp).max() > 1e-4
    np.testing.assert_allclose(ref_logp, base_logp, atol=1e-5)
