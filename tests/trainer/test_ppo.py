"""PPO through grpo_one_stage.py in one process: a critic role (`--sft_path_critic`, `adv_estimator: gae`) that
starts from the policy with a zero head, is resident only in its phases, learns, and resumes exactly."""
import json

import numpy as np
import pytest
from support.jobs import base_args, load_script, yaml_with
from support.metrics_doc import assert_documented
from support.paths import TINY, TINY_SFT_CKPT

from mindrlhf.trainer.roles import CRITIC_MOMENTS, CRITIC_WEIGHTS

pytestmark = pytest.mark.usefixtures("graph_mode")


def ppo_args(mindrecord, out, *extra):
    return base_args(mindrecord, out) + [
        "--sft_path_critic", str(TINY / "model.yaml"), "--adv_estimator", "gae", "--critic.learning_rate", "1e-3",
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), *extra]


def test_ppo_steps_score_tokens_train_the_critic_and_keep_it_offloaded_elsewhere(tmp_path, mindrecord):
    from mindspore.dataset import MindDataset

    from mindrlhf.algorithms import masked_whiten

    seen = []

    def check(trainer, step, metrics):
        seen.append((step, list(trainer.swap.phase_plan), trainer.critic.net.score.weight.asnumpy().copy()))

    out = tmp_path / "out"
    code = load_script().main(ppo_args(mindrecord, out, "--steps", "2", "--save_data_file",
                                       str(tmp_path / "exp" / "ppo")), callbacks=[check])
    assert code == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert_documented(lines)
    first, second = lines
    # step 1: the critic starts from the policy with a zero head: every value is 0, nothing is explained yet
    assert first["critic/values/max"] == first["critic/values/min"] == 0.0
    assert first["critic/updates"] == 4 and first["actor/updates"] == 4
    # its updates move the head, so step 2 sees values (and the value loss) of a trained critic
    assert np.abs(seen[0][2]).max() > 0 and second["critic/values/max"] != second["critic/values/min"]
    assert second["critic/vf_loss"] < first["critic/vf_loss"]
    for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/lr", "critic/returns/mean",
                 "critic/advantages/mean", "critic/vf_explained_var", "timing/values", "timing/update_critic"):
        assert np.isfinite(second[name]), name
    # the critic's groups are resident exactly in its phases
    for _, plan, _ in seen:
        for phase, resident in plan:
            assert (CRITIC_WEIGHTS in resident) == (phase in ("values", "update_critic")), (phase, resident)
            assert (CRITIC_MOMENTS in resident) == (phase == "update_critic"), (phase, resident)
    # step 1 by hand: values 0 and gamma = lam = 1 without a KL penalty, so each token's return is the response's
    # reward and its advantage is that return whitened over the batch's tokens
    records = list(MindDataset(str(tmp_path / "exp" / "ppo.step_000001.mindrecord"), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    mask = np.stack([r["response_mask"] for r in records])
    rewards = np.array([float(r["reward"]) for r in records])
    returns = np.stack([r["returns"] for r in records])
    np.testing.assert_allclose(returns, rewards[:, None] * mask, atol=1e-6)
    np.testing.assert_allclose(np.stack([r["advantages"] for r in records]), masked_whiten(returns, mask), atol=1e-5)
    ckpt = out / "checkpoints" / "step_000002"
    assert (ckpt / "rank_0" / "critic.ckpt").is_file() and (ckpt / "critic_strategy.ckpt").is_file()


@pytest.mark.parametrize("extra,message", [
    (("--adv_estimator", "grpo"), r"--sft_path_critic: a critic is only used by algorithm.adv_estimator gae"),
    (("--sft_path_critic", "DEEPER"), r"describe different models \(num_layers: 2 vs 3\)"),
    (("--load_critic_checkpoint", str(TINY_SFT_CKPT)), r"tiny_sft.ckpt: no value head 'score.weight'"),
    (("--dynamic_sampling", "true"), r"dynamic_sampling .* cannot be used with adv_estimator gae"),
])
def test_bad_ppo_input_is_one_line(extra, message, tmp_path, mindrecord, capsys):
    extra = tuple(str(yaml_with(tmp_path, "deeper.yaml", [("num_layers: 2", "num_layers: 3")])) if e == "DEEPER"
                  else e for e in extra)
    out = tmp_path / "out"
    code = load_script().main(ppo_args(mindrecord, out, *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: "), err
    assert __import__("re").search(message, err[-1]), err[-1]
    assert not (out / "checkpoints").exists()


def test_the_critic_can_start_from_a_value_model_checkpoint(tmp_path, mindrecord):
    """--load_critic_checkpoint: a checkpoint with a value head (here the policy's backbone and a random head, as
    tools/convert_weight.py writes a reward model) starts the critic instead of the zero head."""
    import mindspore as ms

    from mindrlhf.checkpoint.weights import read_weights

    weights = {k: v for k, v in read_weights(str(TINY_SFT_CKPT)).items() if k != "lm_head.weight"}
    hidden = weights["model.norm_out.weight"].shape[0]
    weights["score.weight"] = np.random.default_rng(0).normal(0, 0.05, (1, hidden)).astype(np.float32)
    ckpt = tmp_path / "rm.ckpt"
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], str(ckpt))
    out = tmp_path / "out"
    code = load_script().main(ppo_args(mindrecord, out, "--steps", "1", "--load_critic_checkpoint", str(ckpt)))
    assert code == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["critic/values/max"] > first["critic/values/min"]  # not the zero head
