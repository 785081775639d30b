"""The preference losses against references of TRL's formulas: DPO / IPO (`DPOTrainer.dpo_loss` and its logged
metrics) on a Hugging Face model in torch, its loss, metrics and gradient norm; Bradley-Terry (`RewardTrainer`) in
numpy on the reward model's own scores."""
import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("graph_mode")  # the trainer's mode (the cells compile as they do in a job)
PROMPTS = ([11, 12, 13], [21, 22, 23, 24, 25])
ANSWERS = (([31, 32, 33, 34], [41, 42]), ([51, 52], [61, 62, 63, 64, 65, 66]))  # (chosen, rejected) of each pair


def pair_columns():
    """Two pairs: prompts once per pair [2, P], answers as rows [4, R] (chosen, rejected, chosen, rejected)."""
    from mindrlhf.algorithms import aggregation_weights
    from mindrlhf.data.reader import pad_rows

    prompt_ids, prompt_mask = pad_rows(list(PROMPTS), 6, 0)
    response_ids, response_mask = pad_rows([a for pair in ANSWERS for a in pair], 8, 0, side="right")
    weights = aggregation_weights(response_mask, "seq-mean-token-mean").astype(np.float32)
    return prompt_ids, prompt_mask, response_ids, response_mask, weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Hugging Face Qwen2 and the same weights as mindrlhf's net."""
    from support.hf_fixtures import make_hf_model_dir

    from mindrlhf.checkpoint.weights import load_weights
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.qwen2.convert import convert_hf_to_ms
    from mindrlhf.parallel.layout import Layout

    tmp = tmp_path_factory.mktemp("dpo")
    folder, hf = make_hf_model_dir(tmp / "hf", arch="qwen2", seed=5)
    convert_hf_to_ms(folder, tmp / "m.ckpt", output_yaml=tmp / "m.yaml")
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(tmp / "m.yaml"))
    load_weights(net, Layout(), str(tmp / "m.ckpt"))
    return hf, net


def trl_dpo(hf, ref_logps, beta, label_smoothing, loss_type):
    """TRL's DPO on the pairs in torch: each answer's summed (IPO: mean) token log-prob under `hf` given its prompt,
    the loss of `dpo_loss`, its metrics (means over the pairs) and the gradient norm of the loss."""
    import torch
    import torch.nn.functional as F

    hf.zero_grad()
    logps = []
    for prompt, pair in zip(PROMPTS, ANSWERS):
        for answer in pair:
            ids = torch.tensor([prompt + answer])
            logits = hf(input_ids=ids).logits[0, len(prompt) - 1:-1]
            token_logps = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(answer)[:, None])[:, 0]
            logps.append(token_logps.mean() if loss_type == "ipo" else token_logps.sum())
    logps = torch.stack(logps)
    chosen, rejected = logps[0::2], logps[1::2]
    ref = torch.tensor(ref_logps)
    logits = (chosen - rejected) - (ref[0::2] - ref[1::2])
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    loss = losses.mean()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    chosen_rewards, rejected_rewards = beta * (chosen - ref[0::2]).detach(), beta * (rejected - ref[1::2]).detach()
    metrics = {"rewards/chosen": chosen_rewards.mean(), "rewards/rejected": rejected_rewards.mean(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
               "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
               "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean()}
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, float(norm)


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.1), ("ipo", 0.0)])  # cDPO includes DPO
def test_the_dpo_loss_its_metrics_and_gradient_norm_are_trls(models, loss_type, label_smoothing):
    import mindspore as ms

    from mindrlhf.algorithms.preference_cells import DPOLossNet

    hf, net = models
    beta = 0.3
    # references that rank the first pair's answers the other way round: one pair is right, one wrong
    ref_logps = np.array([-20.0, -5.0, -3.0, -30.0], np.float32) * (0.2 if loss_type == "ipo" else 1.0)
    loss, metrics, norm = trl_dpo(hf, ref_logps, beta, label_smoothing, loss_type)
    cell = DPOLossNet(net, beta, label_smoothing, loss_type)
    prompt_ids, prompt_mask, response_ids, response_mask, weights = pair_columns()
    inputs = [ms.Tensor(a) for a in (prompt_ids, prompt_mask, response_ids, response_mask, ref_logps, weights)]
    outputs = [float(o.asnumpy()) for o in cell(*inputs)]
    assert outputs[0] == pytest.approx(loss, rel=1e-5)
    for name, value in zip(DPOLossNet.OUTPUTS[1:], outputs[1:]):
        assert value == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), name
    assert 0 < metrics["rewards/accuracies"] < 1  # the accuracy is a real mean, not 0 or 1 by construction
    def loss_of(*columns):
        return cell(*columns)[0]

    grads = ms.grad(loss_of, grad_position=None, weights=net.trainable_params())(*inputs)
    ours = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in grads)))
    assert ours == pytest.approx(norm, rel=1e-4)


def test_the_bradley_terry_loss_accuracy_and_margin_are_trls_on_the_models_scores(tmp_path):
    """`PairwiseRewardLoss` on a value model with a random head, against TRL's `RewardTrainer` formulas in numpy on
    the model's own last-token scores (`ResponseScores`, which the converter's tests hold to transformers')."""
    import mindspore as ms

    from mindrlhf.algorithms.policy_cells import ResponseScores
    from mindrlhf.algorithms.preference_cells import PairwiseRewardLoss
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForValue
    from mindrlhf.parallel.layers import init_random_weights
    from mindrlhf.parallel.layout import Layout

    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, n_kv_heads=2)
    net = Qwen2ForValue(cfg)
    init_random_weights(net, Layout(), seed=1)
    net.score.weight.set_data(ms.Tensor(np.random.default_rng(2).normal(0, 1, (1, 32)).astype(np.float32)))
    prompt_ids, prompt_mask, response_ids, response_mask, weights = pair_columns()
    columns = [ms.Tensor(a) for a in (prompt_ids, prompt_mask, response_ids, response_mask)]
    scores = ResponseScores(net)(*columns).asnumpy().astype(np.float64)
    chosen, rejected = scores[0::2], scores[1::2]
    assert chosen[0] != rejected[0]
    margin, center = 0.25, 0.01
    (loss, accuracy, gap, mean_chosen, mean_rejected) = [
        float(o.asnumpy()) for o in PairwiseRewardLoss(net, margin, center)(*columns, ms.Tensor(weights))]
    expected = np.mean(np.log1p(np.exp(-(chosen - rejected - margin)))) + center * np.mean((chosen + rejected) ** 2)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert accuracy == pytest.approx(np.mean(chosen > rejected))
    assert gap == pytest.approx(np.mean(chosen - rejected), rel=1e-5)
    assert (mean_chosen, mean_rejected) == pytest.approx((chosen.mean(), rejected.mean()), rel=1e-5)
