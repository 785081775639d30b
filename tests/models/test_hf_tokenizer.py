"""`load_tokenizer` and `HFTokenizer` (tokenizer.json folders) against transformers' AutoTokenizer."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from support import paths
from support.tokenizer_texts import CONVERSATIONS, PARITY_TEXTS

from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer
from mindrlhf.models.tokenizer import HFTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TINY_DIR = str(paths.TOKENIZER)

LLAMA_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] | trim + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen_json_dir(qwen_dir, tmp_path_factory) -> str:
    """A Qwen folder as transformers 5 saves it: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    folder = tmp_path_factory.mktemp("qwen_json")
    transformers.AutoTokenizer.from_pretrained(qwen_dir).save_pretrained(folder)
    assert sorted(os.listdir(folder)) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    return str(folder)


@pytest.fixture(scope="module")
def llama_style_dir(tmp_path_factory) -> str:
    """A SmolLM2-like folder: only tokenizer.json (BPE with a BOS post-processor) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(PARITY_TEXTS * 20, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 0)])
    folder = tmp_path_factory.mktemp("llama_style")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "chat_template": LLAMA_STYLE_TEMPLATE}), encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}), encoding="utf-8")
    return str(folder)


@pytest.mark.slow
def test_load_tokenizer_picks_the_class_by_files(qwen_json_dir, tmp_path):
    assert isinstance(load_tokenizer(qwen_json_dir), HFTokenizer)
    assert isinstance(load_tokenizer(TINY_DIR), Qwen2Tokenizer)
    assert isinstance(load_tokenizer(vocab_path=os.path.join(TINY_DIR, "vocab.json"),
                                     merges_file_path=os.path.join(TINY_DIR, "merges.txt")), Qwen2Tokenizer)
    with pytest.raises(ValueError, match=f"{tmp_path}: no tokenizer files"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="nowhere: tokenizer folder not found"):
        load_tokenizer("nowhere")
    with pytest.raises(ValueError, match="both a vocab.json and a merges.txt"):
        load_tokenizer(vocab_path="vocab.json")


@pytest.mark.slow
def test_qwen_tokenizer_json_matches_transformers(qwen_json_dir):
    ours, reference = load_tokenizer(qwen_json_dir), transformers.AutoTokenizer.from_pretrained(qwen_json_dir)
    for text in PARITY_TEXTS:
        ids = reference(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.eos_token_id == reference.eos_token_id and ours.pad_token_id == reference.pad_token_id
    assert len(ours) == len(reference)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected


def test_llama_style_tokenizer_matches_transformers(llama_style_dir):
    ours, reference = load_tokenizer(llama_style_dir), transformers.AutoTokenizer.from_pretrained(llama_style_dir)
    for text in PARITY_TEXTS:
        assert ours.encode(text, add_special_tokens=True) == reference(text)["input_ids"], text
        assert ours.encode(text) == reference(text, add_special_tokens=False)["input_ids"], text
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "What is 2 + 3?"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected and expected.startswith("<s><|system|>")
    expected_ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected_ids = expected_ids["input_ids"] if hasattr(expected_ids, "keys") else expected_ids
    assert ours.apply_chat_template(messages, tokenize=True) == list(expected_ids)
    # eos from the config, stops also from generation_config.json; no pad token -> the eos token pads
    assert (ours.eos_token_id, ours.stop_token_ids, ours.pad_token_id) == (1, [1, 3], 1)
    with pytest.raises(ValueError, match="apply_chat_template: tool messages are not supported"):
        ours.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_bad_tokenizer_folders_name_the_file(llama_style_dir, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(llama_style_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps({**config, "eos_token": "<|nosuch|>"}), encoding="utf-8")
    with pytest.raises(ValueError, match=f"{config_path}: eos_token '<\\|nosuch\\|>' is not in"):
        HFTokenizer(folder)
    config_path.write_text(json.dumps({**config, "chat_template": "{% if %}"}), encoding="utf-8")
    with pytest.raises(ValueError, match=f"{config_path}: chat template does not compile"):
        HFTokenizer(folder)
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}), encoding="utf-8")
    with pytest.raises(ValueError, match="has no chat template"):
        HFTokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    (folder / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{folder / 'tokenizer.json'}: cannot load tokenizer"):
        load_tokenizer(folder)


def multiply(a: float, b: float) -> float:
    """Multiplies two numbers.

    Args:
        a: The first number.
        b: The second number (choices: [1, 2, 3])
    """
    return a * b


def test_tools_render_as_transformers_renders_them(qwen_dir, llama_style_dir):
    """The Qwen template with `tools=` (our schemas; transformers makes its own from the same functions), a call in
    the assistant's turn and the tool's answers as `tool` turns: the text transformers renders; a template that
    never reads `tools` and a vocab/merges tokenizer refuse tools in one line."""
    from mindrlhf.tool_use import calculator, function_schema

    ours, reference = HFTokenizer(qwen_dir), transformers.AutoTokenizer.from_pretrained(qwen_dir)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1234 * 5678"}}}
    conversations = [
        [{"role": "user", "content": "What is 1234 * 5678?"}],
        [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 1234 * 5678?"},
         {"role": "assistant", "content": "Let me compute.", "tool_calls": [call, call]},
         {"role": "tool", "content": "7006652"}, {"role": "tool", "content": "7006652"},
         {"role": "assistant", "content": "<answer>7006652</answer>"}],
    ]
    assert ours.supports_tools
    for messages in conversations:
        expected = reference.apply_chat_template(messages, tools=[calculator, multiply], tokenize=False,
                                                 add_generation_prompt=True)
        rendered = ours.apply_chat_template(messages, tools=[function_schema(calculator), function_schema(multiply)])
        assert rendered == expected and '"enum": [1, 2, 3]' in rendered
        assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                                   add_generation_prompt=True)
    assert "<tools>" in expected and "<tool_response>\n7006652\n</tool_response>" in expected
    llama = HFTokenizer(llama_style_dir)
    assert not llama.supports_tools
    with pytest.raises(ValueError, match="the chat template does not render tools"):
        llama.apply_chat_template(conversations[0], tools=[function_schema(calculator)])
    tiny = load_tokenizer(TINY_DIR)
    assert not tiny.supports_tools
    with pytest.raises(ValueError, match="a vocab.json \\+ merges.txt tokenizer renders no tools"):
        tiny.apply_chat_template(conversations[0], tools=[function_schema(calculator)])
