"""The stages before RL under msrun (`mindrlhf-sft`, `mindrlhf-reward`, `mindrlhf-dpo`) on the tiny model: the SFT
loss is transformers' masked cross-entropy; each stage's data-parallel job learns, checkpoints and resumes bit for
bit; a tensor-parallel SFT job makes the data-parallel one's updates; the step folders load where the RL job takes
the net (a policy, a reward model); bad data ends in one line. The preference losses' formulas are
tests/algorithms/test_preference_losses.py's."""
import dataclasses
import json
import shutil
import sys

import numpy as np
import pytest
from support.metrics_doc import assert_documented
from support.msrun import msrun_command, msrun_env, run_command
from support.paths import ARITH, TINY, TUTORIAL, TUTORIAL_DATA
from support.tolerances import assert_weights_close_after_adam

TOKENIZER_DIR = ARITH / "policy"  # a Qwen chat template; its 603 ids fit the tiny model's 704
LR = 1e-3


def pad(rows, width, side):
    from mindrlhf.data.reader import pad_rows

    return pad_rows(rows, width, 0, side=side)


def test_the_sft_loss_is_transformers_masked_cross_entropy(tmp_path):
    """Two conversations of other lengths, the second with an untrained (user) turn inside its response: the loss of
    `SFTLossNet` with the update's token-mean weights is the cross-entropy transformers computes over the labels of
    the trained tokens (-100 elsewhere), averaged over every trained token of the batch."""
    import mindspore as ms
    import torch
    from support.hf_fixtures import make_hf_model_dir

    from mindrlhf.algorithms import aggregation_weights
    from mindrlhf.algorithms.policy_cells import SFTLossNet
    from mindrlhf.checkpoint.weights import load_weights
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.qwen2.convert import convert_hf_to_ms
    from mindrlhf.parallel.layout import Layout

    folder, hf = make_hf_model_dir(tmp_path / "hf", arch="qwen2", seed=3)
    convert_hf_to_ms(folder, tmp_path / "m.ckpt", output_yaml=tmp_path / "m.yaml")
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(tmp_path / "m.yaml"))
    load_weights(net, Layout(), str(tmp_path / "m.ckpt"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 300, 3), rng.integers(1, 300, 5)]
    responses = [rng.integers(1, 300, 4), rng.integers(1, 300, 7)]
    trained = [np.array([1, 1, 1, 1]), np.array([1, 1, 0, 0, 0, 1, 1])]  # the second: a user turn in the middle
    prompt_ids, prompt_mask = pad(prompts, 6, "left")
    response_ids, response_mask = pad(responses, 8, "right")
    loss_mask, _ = pad(trained, 8, "right")
    weights = aggregation_weights(loss_mask, "token-mean").astype(np.float32)
    (ours,) = SFTLossNet(net)(*(ms.Tensor(a) for a in (prompt_ids, prompt_mask, response_ids, response_mask, weights)))
    total, count = 0.0, 0
    for prompt, response, mask in zip(prompts, responses, trained):
        ids = torch.tensor(np.concatenate([prompt, response]))[None]
        labels = ids.clone()
        labels[0, :len(prompt)] = -100
        labels[0, len(prompt):][torch.tensor(mask) == 0] = -100
        with torch.no_grad():
            total += float(hf(input_ids=ids, labels=labels).loss) * int(mask.sum())
        count += int(mask.sum())
    assert float(ours.asnumpy()) == pytest.approx(total / count, rel=1e-5)


def test_packed_rows_give_each_conversations_log_probs_loss_and_gradients(tmp_path):
    """Twelve conversations packed into fewer rows (positions restarting, attention kept within each): every trained
    token's log-prob is the one of its conversation in a row of its own, and the token-mean loss and its gradients
    are the unpacked batch's."""
    import mindspore as ms

    from mindrlhf.algorithms import aggregation_weights
    from mindrlhf.algorithms.policy_cells import PackedLogProbs, PackedSFTLossNet, ResponseLogProbs, SFTLossNet
    from mindrlhf.data.stage_data import PackedSFTDataset, SFTDataset
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.parallel.layers import init_random_weights

    data = stage_data(tmp_path, "sft", problems=12)
    plain = SFTDataset(data, 0).split_rows("train")
    packed_data = PackedSFTDataset(data, 0, max_length=512)
    packed = packed_data.split_rows("train")
    assert packed.num_rows <= plain.num_rows // 2
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(TINY / "model.yaml"))
    init_random_weights(net, seed=0)

    def tensors(rows, names):
        return [ms.Tensor(rows[name]) for name in names]

    plain_logp = ResponseLogProbs(net)(*tensors(plain, ResponseLogProbs.INPUTS)).asnumpy()
    packed_logp = PackedLogProbs(net)(*tensors(packed, PackedLogProbs.INPUTS)).asnumpy()
    by_tokens = {}
    for i in range(plain.num_rows):
        prompt = plain.prompt_ids[i][plain.prompt_mask[i] == 1]
        trained = plain.loss_mask[i] == 1
        by_tokens[tuple(np.concatenate([prompt, plain.response_ids[i][plain.response_mask[i] == 1]]))] = \
            plain_logp[i][trained]
    matched = 0
    for i in range(packed.num_rows):
        for k in range(1, packed.segment_ids[i].max() + 1):
            at = packed.segment_ids[i] == k
            trained = packed.loss_mask[i][at] == 1
            np.testing.assert_allclose(packed_logp[i][at][trained], by_tokens[tuple(packed.response_ids[i][at])],
                                       atol=2e-5)
            matched += 1
    assert matched == plain.num_rows

    class Loss(ms.nn.Cell):
        """The loss alone (PyNative's value_and_grad takes no auxiliary outputs from a net of one output)."""

        def __init__(self, loss_net):
            super().__init__(auto_prefix=False)
            self.loss_net = loss_net

        def construct(self, *inputs):
            return self.loss_net(*inputs)[0]

    def loss_and_grads(loss_net, rows, names):
        weights = aggregation_weights(rows.loss_mask, "token-mean").astype(np.float32)
        inputs = tensors(rows.with_columns(token_weights=weights), names)
        params = net.trainable_params()
        loss, grads = ms.value_and_grad(Loss(loss_net), None, params)(*inputs)
        return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}

    loss, grads = loss_and_grads(PackedSFTLossNet(net), packed, PackedSFTLossNet.INPUTS)
    expected_loss, expected_grads = loss_and_grads(SFTLossNet(net), plain, SFTLossNet.INPUTS)
    assert loss == pytest.approx(expected_loss, rel=1e-5) and loss > 5  # random weights: near ln(704)
    assert len(grads) > 10
    for name, grad in grads.items():
        np.testing.assert_allclose(grad, expected_grads[name], rtol=1e-4, atol=1e-6, err_msg=name)


def layout_yaml(folder, name, dp, tp, pp=1):
    """tiny/train.yaml in another layout (`pp` stages of 2 micro-batches)."""
    text = (TINY / "train.yaml").read_text()
    assert "data_parallel: 1" in text and "model_parallel: 2" in text and "pipeline_stage: 1" in text
    path = folder / name
    path.write_text(text.replace("data_parallel: 1", f"data_parallel: {dp}").replace(
        "model_parallel: 2", f"model_parallel: {tp}").replace(
        "pipeline_stage: 1", f"pipeline_stage: {pp}" + ("\n  micro_batch_num: 2" if pp > 1 else "")))
    return path


def stage_args(data, model_yaml, out, steps=4, extra=()):
    """4 steps of 8 records (SFT: conversations; the others: pairs of 4), checkpoints at 2 and 4, 10% held out."""
    return ["--sft_path_train", str(model_yaml), "--tokenizer_dir", str(TOKENIZER_DIR), "--mind_dataset_dir",
            str(data), "--output_dir", str(out), "--steps", str(steps), "--batch_size", "8", "--learning_rate",
            str(LR), "--weight_decay", "0", "--save_interval", "2", "--keep_last", "5", "--eval_fraction", "0.1",
            "--eval_interval", "2", "--init_seed", "0", *extra]


def run_stage(stage, folder, name, args):
    log_dir = folder / f"{name}_logs"
    proc = run_command(msrun_command(TUTORIAL / f"{stage}.py", args, 2, log_dir), msrun_env(), timeout=600)
    logs = "".join(p.read_text() for p in sorted(log_dir.glob("worker_*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs[-4000:]}"
    return logs


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def last_line(summary, records, key="eval/accuracy"):
    """The stage's last log line for `records` (step 0's score before, the last step's after), as it prints it."""
    before, after = records[0][key], records[-1][key]
    shown = (lambda v: f"{v:.4f}") if key == "eval/loss" else (lambda v: f"{100 * v:.1f}%")
    return f"{summary}: before={shown(before)} after={shown(after)}"


def weights_of(step_dir, net="actor"):
    """The merged weights of a step folder's `net`, as the RL job reads them."""
    from mindrlhf.checkpoint.weights import read_weights

    return read_weights(str(step_dir), net)


def straight_and_resumed(stage, data, folder, model_yaml):
    """A stage's dp2 job of 4 steps and the same job resumed from its step 2: (their logs, their output folders)."""
    logs = run_stage(stage, folder, stage, stage_args(data, model_yaml, folder / stage))
    resumed = folder / f"{stage}_resumed"
    shutil.copytree(folder / stage / "checkpoints" / "step_000002", resumed / "checkpoints" / "step_000002")
    run_stage(stage, folder, f"{stage}_resumed", stage_args(data, model_yaml, resumed, extra=("--resume", "auto")))
    return logs, folder / stage, resumed


def assert_resumes_exactly(straight, resumed, net):
    """The resumed run's steps 3 and 4 are the straight run's, and so are its final weights."""
    from support.jobs import without_timing

    steps = [m for m in metrics(straight) if m["step"] > 2]
    assert [without_timing(m) for m in metrics(resumed)] == [without_timing(m) for m in steps]
    final = [weights_of(f / "checkpoints" / "step_000004", net) for f in (straight, resumed)]
    assert final[0].keys() == final[1].keys() and len(final[0]) > 10
    for name in final[0]:
        np.testing.assert_array_equal(final[0][name], final[1][name], err_msg=name)


def stage_data(folder, kind, problems=48):
    """`problems` of the arithmetic problems as `kind` data (make_stage_data.py), tokenised (rlhf_data.py)."""
    from mindrlhf.cli import prepare_data

    lines = (TUTORIAL_DATA / "arithmetic_train.jsonl").read_text().splitlines(keepends=True)[:problems]
    (folder / "problems.jsonl").write_text("".join(lines))
    made = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", kind, "--input",
                        str(folder / "problems.jsonl"), "--output", str(folder / f"{kind}.jsonl")])
    assert made.returncode == 0 and made.stdout.startswith(f"{problems} "), made.stderr
    assert prepare_data.main(["--tokenizer_dir", str(TOKENIZER_DIR), "--kind", "auto", "--file_path",
                              str(folder / f"{kind}.jsonl"), "--output_path", str(folder / f"{kind}.mindrecord")]) == 0
    return folder / f"{kind}.mindrecord"


def test_pairs_per_problem_give_each_problem_distinct_wrong_answers(tmp_path):
    """make_stage_data.py --pairs_per_problem 3: three pairs a problem, on its prompt with its worked solution, against
    three different wrong answers; the first draws are those of one pair a problem."""
    lines = (TUTORIAL_DATA / "arithmetic_train.jsonl").read_text().splitlines(keepends=True)[:5]
    (tmp_path / "problems.jsonl").write_text("".join(lines))
    made = {}
    for count in (1, 3):
        out = tmp_path / f"pairs_{count}.jsonl"
        done = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "pairwise", "--input",
                            str(tmp_path / "problems.jsonl"), "--output", str(out), "--pairs_per_problem", str(count)])
        assert done.returncode == 0 and done.stdout.startswith(f"{5 * count} pairs"), done.stderr
        made[count] = [json.loads(line) for line in out.read_text().splitlines()]
    for problem in range(5):
        group = made[3][3 * problem:3 * problem + 3]
        assert all(p["prompt"] == group[0]["prompt"] and p["chosen"] == group[0]["chosen"] for p in group)
        rejected = {p["rejected"][0]["content"] for p in group}
        assert len(rejected) == 3 and group[0]["chosen"][0]["content"] not in rejected
    assert made[3][0] == made[1][0]
    bad = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "pairwise", "--input",
                       str(tmp_path / "problems.jsonl"), "--output", str(tmp_path / "x.jsonl"), "--pairs_per_problem",
                       "0"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --pairs_per_problem must be >= 1, got 0"


def test_worked_wrong_share_sets_how_many_wrong_answers_show_their_working(tmp_path):
    """make_stage_data.py --worked_wrong_share: 1 makes every wrong answer a worked one with the last step off by 1-3
    (the steps before it kept), 0 none; 0.5 is the default's draw; a share outside [0, 1] is refused."""
    lines = (TUTORIAL_DATA / "arithmetic_train.jsonl").read_text().splitlines(keepends=True)[:40]
    (tmp_path / "problems.jsonl").write_text("".join(lines))
    made = {}
    for share in ("1", "0", "0.5", None):
        out = tmp_path / f"pairs_{share}.jsonl"
        done = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "pairwise", "--input",
                            str(tmp_path / "problems.jsonl"), "--output", str(out), "--pairs_per_problem", "2"]
                           + (["--worked_wrong_share", share] if share else []))
        assert done.returncode == 0, done.stderr
        made[share] = [json.loads(line) for line in out.read_text().splitlines()]
    worked = {share: [(p["chosen"][0]["content"].split("\n")[:-3], p["rejected"][0]["content"].split("\n")[:-3])
                      for p in rows if "=" in p["rejected"][0]["content"]] for share, rows in made.items()}
    assert len(worked["1"]) == 80 and not worked["0"] and 20 < len(worked["0.5"]) < 60
    assert all(chosen == rejected for chosen, rejected in worked["1"])  # only the last step and the answer differ
    assert made["0.5"] == made[None]
    bad = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "pairwise", "--input",
                       str(tmp_path / "problems.jsonl"), "--output", str(tmp_path / "x.jsonl"), "--worked_wrong_share",
                       "1.5"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --worked_wrong_share must be in [0, 1], got 1.5"


def test_direct_fraction_answers_that_share_of_the_problems_without_the_working(tmp_path):
    """make_stage_data.py --kind sft --direct_fraction 0.5: about half of the conversations answer with the bare
    answer, the others with the worked solution, each on its problem's prompt and gold answer; 1.0 answers all
    directly; a share outside [0, 1] is refused."""
    from mindrlhf.data.answers import r1_completion
    from mindrlhf.data.mindrecord import read_problems

    problems = list(read_problems(TUTORIAL_DATA / "arithmetic_train.jsonl"))[:200]
    (tmp_path / "problems.jsonl").write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                                                     for p in problems))
    answers = {}
    for fraction in ("0.5", "1"):
        out = tmp_path / f"sft_{fraction}.jsonl"
        done = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "sft", "--input",
                            str(tmp_path / "problems.jsonl"), "--output", str(out), "--direct_fraction", fraction])
        assert done.returncode == 0, done.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["messages"][1]["content"] for r in records] == [p.question for p in problems]
        answers[fraction] = [r["messages"][-1]["content"] for r in records]
    direct = [a == r1_completion(p.answer, direct=True) for a, p in zip(answers["0.5"], problems)]
    worked = [a == r1_completion(p.answer) for a, p in zip(answers["0.5"], problems)]
    assert all(d != w for d, w in zip(direct, worked))
    assert 70 <= sum(direct) <= 130
    assert answers["1"] == [r1_completion(p.answer, direct=True) for p in problems]
    bad = run_command([sys.executable, str(TUTORIAL_DATA / "make_stage_data.py"), "--kind", "sft", "--input",
                       str(tmp_path / "problems.jsonl"), "--output", str(tmp_path / "x.jsonl"), "--direct_fraction",
                       "1.5"])
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --direct_fraction must be in [0, 1], got 1.5"


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory):
    """A dp2 SFT job of 4 steps (checkpoints at 2 and 4), the same job resumed from its step 2, a tp2 job and a job
    in 2 pipeline stages."""
    folder = tmp_path_factory.mktemp("sft_runs")
    data = stage_data(folder, "sft")
    dp2, tp2 = layout_yaml(folder, "dp2.yaml", 2, 1), layout_yaml(folder, "tp2.yaml", 1, 2)
    logs, straight, resumed = straight_and_resumed("sft", data, folder, dp2)
    run_stage("sft", folder, "tp2", stage_args(data, tp2, folder / "tp2"))
    run_stage("sft", folder, "pp2", stage_args(data, layout_yaml(folder, "pp2.yaml", 1, 1, pp=2), folder / "pp2"))
    return folder, straight, resumed, logs


@pytest.mark.msrun
def test_a_data_parallel_sft_job_learns_and_resumes_bit_for_bit(sft_runs):
    folder, straight, resumed, logs = sft_runs
    records = metrics(straight)
    assert_documented(records)
    before, steps = records[0], records[1:]
    assert before["step"] == 0 and set(before) == {"step", "eval/loss"}
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all(m["sft/updates"] == 1 and m["sft/trained_tokens"] > 8 * 10 for m in steps)
    # random weights of a 704-token vocabulary start near ln(704); four updates at lr 1e-3 lower both losses
    assert before["eval/loss"] > 5.5 and steps[-1]["eval/loss"] < before["eval/loss"] - 0.5
    assert steps[-1]["sft/loss"] < steps[0]["sft/loss"] - 0.5
    assert last_line("held-out loss", records, "eval/loss") in logs
    assert (straight / "progress.png").stat().st_size > 0
    assert_resumes_exactly(straight, resumed, "actor")


@pytest.mark.msrun
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tensor_parallel_and_pipeline_sft_jobs_make_the_data_parallel_jobs_updates(sft_runs, layout):
    """The same batches on train tp2 (the vocabulary and heads split) or in 2 pipeline stages (a layer each, 2
    micro-batches, the stage checkpoints merged): the same losses and gradient norms up to float rounding, and
    weights within Adam's float-noise bound (tests/support/tolerances.py)."""
    folder, straight, _, _ = sft_runs
    dp, other = metrics(straight), metrics(folder / layout)
    assert [m["step"] for m in other] == [m["step"] for m in dp] == [0, 1, 2, 3, 4]
    for a, b in zip(dp, other):
        for key in ("eval/loss", "sft/loss", "sft/grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)
    assert_weights_close_after_adam(weights_of(folder / layout / "checkpoints" / "step_000004"),
                                    weights_of(straight / "checkpoints" / "step_000004"), LR, 4,
                                    what=f"{layout} vs dp2")


@pytest.mark.msrun
def test_a_packed_sft_job_scores_the_held_out_conversations_as_unpacked_and_learns(sft_runs, tmp_path, capsys,
                                                                                   graph_mode):
    """One process, the dp2 job's data and start packed two or three conversations a row (`--packing`): its held-out
    loss before training is the unpacked job's, and four updates of 8 packed rows lower it."""
    from mindrlhf.cli import stages
    from mindrlhf.data.stage_data import PackedSFTDataset

    folder, straight, _, _ = sft_runs
    out = tmp_path / "packed"
    code = stages.main("sft", stage_args(folder / "sft.mindrecord", layout_yaml(tmp_path, "one.yaml", 1, 1), out,
                                         extra=("--packing", "true", "--max_length", "512")))
    log = capsys.readouterr().err
    assert code == 0, log[-3000:]
    records, unpacked = metrics(out), metrics(straight)
    assert_documented(records)
    assert records[0]["eval/loss"] == pytest.approx(unpacked[0]["eval/loss"], rel=1e-5)
    steps = records[1:]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # 8 packed rows an update hold more conversations than the unpacked job's 8
    assert all(m["sft/trained_tokens"] > unpacked[1]["sft/trained_tokens"] * 1.5 for m in steps)
    assert steps[-1]["eval/loss"] < records[0]["eval/loss"] - 0.5
    line = next(line.split("mindrlhf.trainer: ", 1)[1] for line in log.splitlines() if "trainer: packing: " in line)
    dataset = PackedSFTDataset(folder / "sft.mindrecord", 0, 0, 0.1, max_length=512)  # the job's split
    packed, unpacked = dataset.padding_shares()
    assert line.startswith(f"packing: the training conversations in {len(dataset.train)} rows of 512 tokens, "
                           f"{100 * packed:.1f}% of the positions padding ({100 * unpacked:.1f}% in a row each: ")


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory):
    """The reward-model and DPO stages' dp2 jobs on 48 pairs, each straight and resumed from its step 2."""
    folder = tmp_path_factory.mktemp("pair_runs")
    data = stage_data(folder, "pairwise")
    dp2 = layout_yaml(folder, "dp2.yaml", 2, 1)
    return {stage: straight_and_resumed(stage, data, folder, dp2) for stage in ("reward", "dpo")}


@pytest.mark.msrun
def test_a_reward_model_learns_to_rank_the_pairs_resumes_exactly_and_loads_as_a_reward_model(pair_runs):
    from mindrlhf.checkpoint.weights import read_weights

    logs, straight, resumed = pair_runs["reward"]
    records = metrics(straight)
    assert_documented(records)
    steps = records[1:]
    assert all(0 <= m["reward_model/accuracy"] <= 1 for m in steps)
    for m in steps:  # the margin is the mean score gap
        gap = m["reward_model/rewards/chosen"] - m["reward_model/rewards/rejected"]
        assert m["reward_model/margin"] == pytest.approx(gap, abs=1e-5)
    # from random weights: the loss falls from about log 2 and the chosen answers pull ahead
    assert steps[0]["reward_model/loss"] == pytest.approx(np.log(2), abs=0.1)
    assert steps[-1]["reward_model/loss"] < steps[0]["reward_model/loss"] - 0.2
    assert steps[-1]["reward_model/margin"] > steps[0]["reward_model/margin"] + 0.5
    assert steps[-1]["reward_model/accuracy"] > 0.5
    assert last_line("held-out pair accuracy", records) in logs
    assert_resumes_exactly(straight, resumed, "critic")
    step = straight / "checkpoints" / "step_000004"
    state = read_weights(str(step), "critic")  # what reward.reward_model_path and --load_critic_checkpoint read
    assert "score.weight" in state and np.abs(state["score.weight"]).max() > 0
    assert_exports_as_sequence_classification(step, straight.parent / "dp2.yaml", straight.parent / "hf_rm")
    assert_a_reward_model_starts_from_a_reward_model_as_it_is(step, straight.parent / "dp2.yaml", state)


def assert_a_reward_model_starts_from_a_reward_model_as_it_is(step, model_yaml, state):
    """The reward stage's start (--load_sft_checkpoint_train): a reward model's step folder with its trained head
    (run_grpo.sh's second pass), a policy with its backbone and a zero head."""
    from support.paths import TINY_SFT_CKPT

    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.models.qwen2 import Qwen2Config
    from mindrlhf.parallel.layout import Layout
    from mindrlhf.trainer.stages import RewardModelStage

    stage = RewardModelStage()
    cfg = Qwen2Config.from_yaml(model_yaml)
    for start, expected in ((step, state), (TINY_SFT_CKPT, {**read_weights(str(TINY_SFT_CKPT)),
                                                            "score.weight": np.zeros_like(state["score.weight"])})):
        net = stage.build_net(cfg, Layout())
        stage.load(net, Layout(), str(start), 0)
        loaded = {p.name.split(".", 1)[1]: p.asnumpy() for p in net.get_parameters()}
        for name in ("score.weight", "model.layers.0.attention.wq.weight"):
            np.testing.assert_array_equal(loaded[name], expected[name], err_msg=f"{start}: {name}")


def assert_exports_as_sequence_classification(step, model_yaml, folder):
    """`convert_weight.py --reverse --net critic` of the reward model's step folder: a folder transformers loads as
    a one-label *ForSequenceClassification whose scores of a few answers are mindrlhf's (`ResponseScores`)."""
    import mindspore as ms
    import torch
    from support.tools import run_convert_weight
    from transformers import AutoModelForSequenceClassification

    from mindrlhf.algorithms.policy_cells import ResponseScores
    from mindrlhf.checkpoint.step import CRITIC_PREFIX
    from mindrlhf.checkpoint.weights import load_value_model, read_weights
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForValue
    from mindrlhf.parallel.layout import Layout

    done = run_convert_weight("--reverse", "--net", "critic", "--mindspore_ckpt_path", step, "--torch_ckpt_dir",
                              folder, "--config_path", model_yaml)
    assert done.returncode == 0, done.stderr
    hf = AutoModelForSequenceClassification.from_pretrained(folder, torch_dtype=torch.float32).eval()
    net = Qwen2ForValue(Qwen2Config.from_yaml(model_yaml))
    net.update_parameters_name(CRITIC_PREFIX)
    load_value_model(net, Layout(), read_weights(str(step), "critic"), str(step), CRITIC_PREFIX, "the test")
    rng = np.random.default_rng(0)
    prompts, answers = rng.integers(1, 600, (2, 7)), rng.integers(1, 600, (2, 5))
    ones = np.ones_like(answers, dtype=np.int32)
    ours = ResponseScores(net)(*(ms.Tensor(a.astype(np.int32)) for a in (prompts, np.ones_like(prompts), answers,
                                                                        ones))).asnumpy()
    with torch.no_grad():
        theirs = hf(input_ids=torch.tensor(np.concatenate([prompts, answers], axis=1))).logits[:, 0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.msrun
def test_dpo_raises_the_implicit_rewards_of_the_chosen_answers_and_resumes_exactly(pair_runs):
    logs, straight, resumed = pair_runs["dpo"]
    records = metrics(straight)
    assert_documented(records)
    steps = records[1:]
    for m in steps:
        assert {"dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected"} <= set(m)
        assert m["rewards/margins"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-5)
    # the first update starts at the reference: every implicit reward is 0, the loss log 2
    assert steps[0]["dpo/loss"] == pytest.approx(np.log(2), rel=1e-4)
    assert steps[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    # the policy moves off the reference towards the chosen answers
    assert steps[-1]["rewards/margins"] > 0.5 and steps[-1]["dpo/loss"] < np.log(2) - 0.1
    assert steps[-1]["rewards/accuracies"] > 0.5
    assert last_line("held-out accuracy", records) in logs
    assert_resumes_exactly(straight, resumed, "actor")


def test_bad_sft_data_ends_the_job_in_one_line(tmp_path, capsys):
    """A prompt MindRecord (the RL job's) given to the SFT job: one line naming the file and what it lacks."""
    from mindrlhf.cli import prepare_data, stages

    prompts = tmp_path / "prompts.mindrecord"
    assert prepare_data.main(["--tokenizer_dir", str(TOKENIZER_DIR), "--file_path",
                              str(TUTORIAL_DATA / "arithmetic_heldout.jsonl"), "--output_path", str(prompts)]) == 0
    capsys.readouterr()
    code = stages.main("sft", stage_args(prompts, TINY / "model.yaml", tmp_path / "out"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: {prompts}: MindRecord has no field(s) ['input_ids', 'loss_mask'] (fields: ['columns', "
                   "'prompt', 'prompt_ids', 'prompt_length', 'solution']); expected the output of rlhf_data.py "
                   "--kind sft"]
    for flag in ("--plan", "--only_save_strategy"):  # the RL job's: refused, not run as a stage would
        assert stages.main("dpo", stage_args(prompts, TINY / "model.yaml", tmp_path / "out2") + [flag]) == 2
        assert capsys.readouterr().err.strip() == f"error: {flag} applies to the RL job only, not to --stage dpo"


def moments_of(step_dir, rank_file):
    """The parameter names rank 0's AdamW moments of a step folder cover (what the optimizer trains)."""
    from mindrlhf.checkpoint.step import is_optimizer_state, rank_dir, read_arrays

    names = read_arrays(str(step_dir / rank_dir("", 0) / rank_file), keep=is_optimizer_state)
    return {name.split(".", 1)[1] for name in names if name.split(".", 1)[0].endswith("adam_m")}


@pytest.fixture(scope="module")
def lora_stage_runs(tmp_path_factory):
    """In one process, from the tiny SFT policy with rank-4 adapters on q_proj, v_proj and down_proj (alpha 8): an
    SFT job of 2 steps (a step folder each), the same job resumed from its step 1, and a reward-model job and a DPO
    job of 2 steps on pairs."""
    import mindspore as ms
    from support.paths import TINY_SFT_CKPT

    from mindrlhf.cli import stages

    ms.set_context(mode=ms.GRAPH_MODE)
    folder = tmp_path_factory.mktemp("lora_stages")
    one = layout_yaml(folder, "one.yaml", 1, 1)
    lora = ("--lora_rank", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj", "down_proj",
            "--load_sft_checkpoint_train", str(TINY_SFT_CKPT), "--save_interval", "1", "--eval_interval", "1")
    sft, pairs = stage_data(folder, "sft"), stage_data(folder, "pairwise")
    assert stages.main("sft", stage_args(sft, one, folder / "sft", steps=2, extra=lora)) == 0
    resumed = folder / "sft_resumed"
    shutil.copytree(folder / "sft" / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001")
    assert stages.main("sft", stage_args(sft, one, resumed, steps=2, extra=(*lora, "--resume", "auto"))) == 0
    assert stages.main("reward", stage_args(pairs, one, folder / "reward", steps=2, extra=lora)) == 0
    assert stages.main("dpo", stage_args(pairs, one, folder / "dpo", steps=2, extra=lora)) == 0
    return folder, one, TINY_SFT_CKPT


@pytest.mark.slow
def test_a_lora_sft_job_trains_the_adapters_alone_resumes_exactly_and_its_policy_loads_merged(lora_stage_runs):
    """LoRA SFT: the optimizer's moments cover the adapters alone, every base weight is the starting checkpoint's bit
    for bit, the held-out loss falls, the resumed run's step 2 is the straight run's; its step folder exports as a
    PEFT folder (alpha from the folder) and loads into a net without adapters as the merged policy: the logits of the
    net with the trained adapters."""
    import mindspore as ms
    from support.jobs import without_timing
    from support.tools import run_convert_weight

    from mindrlhf.checkpoint.step import TRAIN_CKPT
    from mindrlhf.checkpoint.weights import load_weights, read_weights
    from mindrlhf.configs.base import ConfigError
    from mindrlhf.configs.lora import LoraConfig, is_adapter
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.qwen2.peft_files import merged_weights
    from mindrlhf.parallel.layers import load_full_state
    from mindrlhf.parallel.layout import Layout

    folder, one, start = lora_stage_runs
    step = folder / "sft" / "checkpoints" / "step_000002"
    saved, base = read_weights(str(step)), read_weights(str(start))
    adapters = sorted(name for name in saved if is_adapter(name))
    assert len(adapters) == 2 * 3 * 2 and moments_of(step, TRAIN_CKPT) == set(adapters)
    for name, value in base.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=f"{name} moved")
    assert min(np.abs(saved[n]).max() for n in adapters if n.endswith(".lora_b")) > 0  # B started at 0
    records = metrics(folder / "sft")
    assert records[-1]["eval/loss"] < records[0]["eval/loss"]
    resumed = [without_timing(m) for m in metrics(folder / "sft_resumed")]
    assert resumed == [without_timing(m) for m in records if m["step"] == 2]
    again = read_weights(str(folder / "sft_resumed" / "checkpoints" / "step_000002"))
    for name in adapters:
        np.testing.assert_array_equal(again[name], saved[name], err_msg=name)
    # loaded into a net without adapters (a full RL job's start, or its reference): the merged weights, whose logits
    # are the adapted net's
    cfg = Qwen2Config.from_yaml(str(one))
    full, adapted = Qwen2ForCausalLM(cfg), Qwen2ForCausalLM(dataclasses.replace(cfg, lora=LoraConfig(
        lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj", "v_proj", "down_proj"))))
    load_weights(full, Layout(), str(step))
    load_full_state(adapted, saved)
    merged = merged_weights(saved, 8.0)
    for param in full.get_parameters():
        np.testing.assert_array_equal(param.asnumpy(), merged[param.name], err_msg=param.name)
    assert np.abs(merged["model.layers.0.attention.wq.weight"] - base["model.layers.0.attention.wq.weight"]).max() > 0
    ids = ms.Tensor(np.random.default_rng(0).integers(3, 600, (2, 9)).astype(np.int32))
    np.testing.assert_allclose(full(ids).asnumpy(), adapted(ids).asnumpy(), atol=1e-4)
    # a .ckpt holding adapters says nothing of their alpha: one line, not a guess
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(v)} for n, v in saved.items()], str(folder / "lora.ckpt"))
    with pytest.raises(ConfigError, match=r"lora\.ckpt: holds LoRA adapters but not their lora_alpha"):
        load_weights(Qwen2ForCausalLM(cfg), Layout(), str(folder / "lora.ckpt"))
    done = run_convert_weight("--reverse", "--mindspore_ckpt_path", step, "--torch_ckpt_dir", folder / "peft",
                              "--config_path", one)
    assert done.returncode == 0, done.stderr
    assert json.loads((folder / "peft" / "adapter_config.json").read_text())["lora_alpha"] == 8.0


@pytest.mark.slow
def test_a_lora_reward_model_trains_its_adapters_and_head_and_exports_merged(lora_stage_runs):
    """A LoRA reward model: the moments cover the adapters and the value head, the backbone stays the starting
    policy's bit for bit, the loss falls from log 2; its step folder exports as a *ForSequenceClassification of the
    merged weights whose scores are those of mindrlhf's reward model loading the folder (merged as well)."""
    from mindrlhf.checkpoint.step import CRITIC_CKPT
    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.configs.lora import is_adapter

    folder, one, start = lora_stage_runs
    step = folder / "reward" / "checkpoints" / "step_000002"
    saved, base = read_weights(str(step), "critic"), read_weights(str(start))
    trained = moments_of(step, CRITIC_CKPT)
    assert {name.split(".", 1)[1] for name in trained} == {n for n in saved if is_adapter(n)} | {"score.weight"}
    for name, value in base.items():
        if name.startswith("model."):
            np.testing.assert_array_equal(saved[name], value, err_msg=f"{name} moved")
    assert np.abs(saved["score.weight"]).max() > 0
    steps = metrics(folder / "reward")[1:]
    assert steps[0]["reward_model/loss"] == pytest.approx(np.log(2), abs=1e-4)  # a zero head scores every answer 0
    assert steps[-1]["reward_model/loss"] < steps[0]["reward_model/loss"]
    assert_exports_as_sequence_classification(step, one, folder / "hf_rm")


@pytest.mark.slow
def test_lora_dpo_starts_at_its_reference_and_moves_the_adapters_alone(lora_stage_runs):
    """LoRA DPO: with B = 0 the policy is the starting checkpoint, whose log-probs are the reference's, so step 1's
    loss is log 2 and its margins 0; the moments cover the adapters alone, the base stays the start's bit for bit, and
    the second step's margins have moved."""
    from mindrlhf.checkpoint.step import TRAIN_CKPT
    from mindrlhf.checkpoint.weights import read_weights
    from mindrlhf.configs.lora import is_adapter

    folder, _, start = lora_stage_runs
    step = folder / "dpo" / "checkpoints" / "step_000002"
    saved, base = read_weights(str(step)), read_weights(str(start))
    assert moments_of(step, TRAIN_CKPT) == {n for n in saved if is_adapter(n)}
    for name, value in base.items():
        np.testing.assert_array_equal(saved[name], value, err_msg=f"{name} moved")
    steps = metrics(folder / "dpo")[1:]
    assert steps[0]["dpo/loss"] == pytest.approx(np.log(2), rel=1e-4)
    assert steps[0]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert abs(steps[1]["rewards/margins"]) > 1e-4 and steps[1]["dpo/loss"] != steps[0]["dpo/loss"]
