"""A reward model as a reward (`reward.reward_model_path`): its score at each response's last token, weighted and
summed with the rule functions, on device only in the reward phase; bad reward-model input is one line."""
import json
import re

import numpy as np
import pytest
from support.jobs import base_args, yaml_with
from support.paths import TINY, TINY_SFT_CKPT, TOKENIZER

from mindrlhf.cli import train
from mindrlhf.trainer.roles import REWARD_MODEL_WEIGHTS

pytestmark = pytest.mark.usefixtures("graph_mode")


@pytest.fixture(scope="module")
def reward_model_ckpt(tmp_path_factory):
    """The tiny policy's backbone with a random value head: what convert_weight.py writes for a reward model."""
    import mindspore as ms

    from mindrlhf.checkpoint.weights import read_weights

    weights = {k: v for k, v in read_weights(str(TINY_SFT_CKPT)).items() if k != "lm_head.weight"}
    hidden = weights["model.norm_out.weight"].shape[0]
    weights["score.weight"] = np.random.default_rng(0).normal(0, 0.5, (1, hidden)).astype(np.float32)
    path = tmp_path_factory.mktemp("rm") / "rm.ckpt"
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], str(path))
    return path, weights


def last_token_scores(weights, records):
    """The reward model run on each unpadded prompt + response, read at its last token (as HF's
    *ForSequenceClassification scores a sequence). One call for the batch, right-padded: causal attention, so the
    padding changes nothing before it."""
    import mindspore as ms

    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForValue
    from mindrlhf.parallel.layers import load_full_state
    from mindrlhf.parallel.layout import Layout

    net = Qwen2ForValue(Qwen2Config.from_yaml(str(TINY / "model.yaml")))
    load_full_state(net, weights, Layout())
    sequences = [np.concatenate([r["prompt_ids"], r["response_ids"][r["response_mask"].astype(bool)]])
                 for r in records]
    ids = np.zeros((len(records), max(map(len, sequences))), np.int32)
    mask = np.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        ids[row, :len(sequence)], mask[row, :len(sequence)] = sequence, 1
    values = net(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()
    return np.array([values[row, len(sequence) - 1] for row, sequence in enumerate(sequences)], np.float64)


@pytest.mark.slow
def test_the_reward_model_scores_the_last_token_and_adds_to_the_rule_rewards(tmp_path, mindrecord,
                                                                            reward_model_ckpt):
    from mindspore.dataset import MindDataset

    from mindrlhf.models.qwen2 import Qwen2Tokenizer
    from mindrlhf.reward import format_reward

    ckpt, weights = reward_model_ckpt
    plans = []
    out = tmp_path / "out"
    code = train.main(base_args(mindrecord, out) + [
        "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--steps", "1",
        "--reward_funcs", "format", "--reward_weights", "0.5", "--reward_model_path", str(ckpt),
        "--reward_model_weight", "2.0", "--save_data_file", str(tmp_path / "exp" / "rm")],
        callbacks=[lambda trainer, step, metrics: plans.append(list(trainer.swap.phase_plan))])
    assert code == 0
    records = list(MindDataset(str(tmp_path / "exp" / "rm.step_000001.mindrecord"), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    scores = last_token_scores(weights, records)
    assert scores.std() > 0.01  # the head reads something that differs between responses
    tokenizer = Qwen2Tokenizer(TOKENIZER / "vocab.json", TOKENIZER / "merges.txt")
    completions = tokenizer.decode_masked(np.stack([r["response_ids"] for r in records]),
                                          np.stack([r["response_mask"] for r in records]), skip_special_tokens=True)
    rules = 0.5 * np.array(format_reward(completions, ["0"] * len(completions)))
    rewards = np.array([float(r["reward"]) for r in records])
    np.testing.assert_allclose(rewards, rules + 2.0 * scores, atol=1e-4)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["reward/reward_model"] == pytest.approx(scores.mean(), abs=1e-4)  # logged unweighted
    for phase, resident in plans[0]:
        assert (REWARD_MODEL_WEIGHTS in resident) == (phase == "reward"), (phase, resident)


@pytest.mark.parametrize("extra,message", [
    (("--reward_model_path", str(TINY_SFT_CKPT)), r"tiny_sft.ckpt: no value head 'score.weight'"),
    (("--reward_model_path", "RM", "--sft_path_reward", "WIDER"),
     r"rm.ckpt: parameter reward_model.model.tok_embeddings.embedding_weight: shard shape \(704, 64\) "
     r".*does not match the network's \(704, 264\) \(reward model .*wider.yaml\)"),
    (("--reward_model_path", "RM", "--sft_path_reward", "TP2"),
     r"tp2.yaml: parallel_config data_parallel x model_parallel = 1 x 2, but the reward model runs in the "
     r"inference layout \(1 x 1"),
    (("--reward_funcs", "--reward_weights"), r"reward.reward_funcs must list at least one reward function"),
])
def test_bad_reward_model_input_is_one_line(extra, message, tmp_path, mindrecord, reward_model_ckpt,
                                            capsys):
    swaps = {"RM": str(reward_model_ckpt[0]),
             "WIDER": str(yaml_with(tmp_path, "wider.yaml", [("hidden_size: ", "hidden_size: 2")])),
             "TP2": str(yaml_with(tmp_path, "tp2.yaml", [("model_parallel: 1", "model_parallel: 2")]))}
    out = tmp_path / "out"
    code = train.main(base_args(mindrecord, out) + ["--steps", "1", *(swaps.get(e, e) for e in extra)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: "), err
    assert re.search(message, err[-1]), err[-1]
    assert not (out / "checkpoints").exists()
