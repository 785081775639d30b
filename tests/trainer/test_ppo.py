"""PPO through grpo_one_stage.py in one process: a critic role (`--sft_path_critic`, `adv_estimator: gae`) that
starts from the policy with a zero head, is resident only in its phases, learns, and resumes exactly."""
import json

import numpy as np
import pytest
from support.jobs import base_args, yaml_with
from support.metrics_doc import assert_documented
from support.paths import TINY, TINY_SFT_CKPT

from mindrlhf.cli import train
from mindrlhf.trainer.roles import CRITIC_MOMENTS, CRITIC_WEIGHTS

pytestmark = pytest.mark.usefixtures("graph_mode")


def ppo_args(mindrecord, out, *extra):
    return base_args(mindrecord, out) + [
        "--sft_path_critic", str(TINY / "model.yaml"), "--adv_estimator", "gae", "--critic.learning_rate", "1e-3",
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), *extra]


@pytest.mark.slow
def test_ppo_steps_score_tokens_train_the_critic_and_keep_it_offloaded_elsewhere(tmp_path, mindrecord):
    from mindspore.dataset import MindDataset

    from mindrlhf.algorithms import masked_whiten

    seen = []

    def check(trainer, step, metrics):
        seen.append((step, list(trainer.swap.phase_plan), trainer.critic.net.score.weight.asnumpy().copy()))

    out = tmp_path / "out"
    code = train.main(ppo_args(mindrecord, out, "--steps", "2", "--save_data_file",
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
    code = train.main(ppo_args(mindrecord, out, *extra))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: "), err
    assert __import__("re").search(message, err[-1]), err[-1]
    assert not (out / "checkpoints").exists()


def checkpoint_values(records, *weight_sets) -> list[np.ndarray]:
    """The value model of each of `weight_sets` (one `Qwen2ForValue`, built here) on each record's unpadded prompt +
    response: its value of the state before each response token [N, R] (0 on padding), as verl reads a critic. One
    call for the batch, right-padded: causal attention, so the padding changes nothing before it."""
    import mindspore as ms

    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForValue
    from mindrlhf.parallel.layers import load_full_state
    from mindrlhf.parallel.layout import Layout

    net = Qwen2ForValue(Qwen2Config.from_yaml(str(TINY / "model.yaml")))
    sequences = [np.concatenate([r["prompt_ids"], r["response_ids"][r["response_mask"].astype(bool)]])
                 for r in records]
    ids = np.zeros((len(records), max(map(len, sequences))), np.int32)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)], mask[row, :len(sequence)] = sequence, 1
    found = []
    for weights in weight_sets:
        load_full_state(net, weights, Layout())
        out = net(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()
        values = np.zeros((len(records), len(records[0]["response_mask"])), np.float32)
        for row, record in enumerate(records):
            length, prompt = int(record["response_mask"].sum()), len(record["prompt_ids"])
            assert record["response_mask"][:length].all()  # the valid tokens first, then padding
            values[row, :length] = out[row, prompt - 1:prompt - 1 + length]
        found.append(values)
    return found


@pytest.mark.slow
def test_the_critic_can_start_from_a_value_model_checkpoint(tmp_path, mindrecord):
    """--load_critic_checkpoint: a checkpoint with a value head (a backbone of its own, here the policy's with every
    weight perturbed, and a random head, as tools/convert_weight.py writes a reward model) starts the critic
    instead of the policy's backbone with a zero head: step 1's values (scored before the critic's first update)
    are the ones that checkpoint's value model gives the step's responses, in the metrics and in the advantages."""
    import mindspore as ms
    from mindspore.dataset import MindDataset

    from mindrlhf.algorithms import masked_whiten
    from mindrlhf.checkpoint.weights import read_weights

    rng = np.random.default_rng(0)
    weights = {k: (v * (1 + 0.1 * rng.standard_normal(v.shape))).astype(np.float32)
               for k, v in read_weights(str(TINY_SFT_CKPT)).items() if k != "lm_head.weight"}
    hidden = weights["model.norm_out.weight"].shape[0]
    weights["score.weight"] = rng.normal(0, 0.05, (1, hidden)).astype(np.float32)
    ckpt = tmp_path / "rm.ckpt"
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], str(ckpt))
    out = tmp_path / "out"
    code = train.main(ppo_args(mindrecord, out, "--steps", "1", "--load_critic_checkpoint", str(ckpt),
                                       "--save_data_file", str(tmp_path / "exp" / "ppo")))
    assert code == 0
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["critic/values/max"] > first["critic/values/min"]  # not the zero head
    records = list(MindDataset(str(tmp_path / "exp" / "ppo.step_000001.mindrecord"), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    mask = np.stack([r["response_mask"] for r in records])
    values, policy_backbone = checkpoint_values(
        records, weights, {**read_weights(str(TINY_SFT_CKPT)), "score.weight": weights["score.weight"]})
    assert np.abs(values - policy_backbone)[mask > 0].max() > 0.01  # the checkpoint's backbone shows in its values
    for stat in ("mean", "max", "min"):
        assert first[f"critic/values/{stat}"] == pytest.approx(getattr(values[mask > 0], stat)(), abs=1e-4), stat
    # gamma = lam = 1 without a KL penalty: each token's return is the response's reward, its advantage that return
    # minus the token's value, whitened over the batch's tokens
    returns = np.stack([r["returns"] for r in records])
    np.testing.assert_allclose(returns, np.array([float(r["reward"]) for r in records])[:, None] * mask, atol=1e-6)
    np.testing.assert_allclose(np.stack([r["advantages"] for r in records]), masked_whiten(returns - values, mask),
                               atol=1e-4)
