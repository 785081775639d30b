"""Qwen2Tokenizer: parity with Hugging Face's Qwen2 tokenizer on the real Qwen vocabulary, the Qwen2.5 chat
template, file errors, and the tiny bundled tokenizer."""
from __future__ import annotations

import json
import os
import random
import shutil
import unicodedata

import pytest
from support import paths
from support.tokenizer_texts import CONVERSATIONS, PARITY_TEXTS
from support.tools import tool_module

from mindrlhf.models.qwen2.tokenizer import QWEN25_DEFAULT_SYSTEM_PROMPT, Qwen2Tokenizer, load_merges, render_qwen_chat

ROOT = str(paths.ROOT)
TINY_DIR = str(paths.TOKENIZER)

# The Qwen2.5-Instruct chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct) without its `tools`
# branch and assistant tool_calls, which Qwen2Tokenizer does not support.
QWEN25_CHAT_TEMPLATE = r"""
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}""".strip()  # noqa: E501 (verbatim)


def _random_text(rng: random.Random) -> str:
    """A random string mixing the character classes the pre-tokenizer regex distinguishes."""
    pools = ["abcXYZ", "0123456789", " ", "\t\n\r", ".,;:!?'\"()[]{}<>|-_=+*/\\#$%&",
             "中文字符测试", "éàüñçÅ", "\u0301\u0308", "😀🚀👍🏽\u200d❤️", "αβγ", "ـــ"]
    return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(0, 40)))


@pytest.fixture(scope="module")
def ours(qwen_dir) -> Qwen2Tokenizer:
    return Qwen2Tokenizer(os.path.join(qwen_dir, "vocab.json"), os.path.join(qwen_dir, "merges.txt"))


@pytest.fixture(scope="module")
def reference(qwen_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen_dir)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    return tokenizer


@pytest.fixture(scope="module")
def tiny() -> Qwen2Tokenizer:
    return Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), os.path.join(TINY_DIR, "merges.txt"))


# ---------------------------------------------------------------- parity with transformers, real Qwen vocab

def test_special_token_ids_match_qwen(ours, reference):
    assert ours.vocab_size == len(reference) == 151669  # 151643 BPE tokens + the folder's 26 added tokens
    assert [ours.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]
    assert ours.eos_token_id == reference.eos_token_id == 151645
    assert ours.pad_token_id == reference.pad_token_id == 151643
    assert ours.stop_token_ids == [151645, 151643]
    assert ours.token_to_id("Ġthe") == reference.convert_tokens_to_ids("Ġthe")


@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_encode_decode_match_transformers(ours, reference, text):
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == reference.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == unicodedata.normalize("NFC", text)


def test_special_tokens_in_text_are_single_ids(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 151644 and ids[-1] == 151645
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_added_tokens_of_the_folder_match_transformers(ours, reference):
    # The folder's tokenizer_config.json adds <think>, <tool_call>, <|fim_prefix|>, ... after the chat tokens.
    text = "<think>\nreasoning\n</think>\n<tool_call>{}</tool_call><|fim_prefix|>x"
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ids[0] == 151667 and ours.vocab_size == len(reference)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_without_a_tokenizer_config_only_the_chat_tokens_are_added(tmp_path, qwen_dir):
    import shutil
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(qwen_dir, name), tmp_path / name)
    plain = Qwen2Tokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert plain.vocab_size == 151646 and plain.tokenizer_config_path is None
    ids = plain.encode("<think>hi<|im_end|>")
    assert max(ids[:-1]) < 151643 and ids[-1] == 151645


def test_added_tokens_with_a_gap_are_rejected(tmp_path):
    vocab = {chr(c): i for i, c in enumerate(range(97, 100))}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"5": {"content": "<|endoftext|>", "special": True}}}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json: added token id 5 .* should be 3"):
        Qwen2Tokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_random_strings_match_transformers(ours, reference):
    rng = random.Random(0)
    texts = [_random_text(rng) for _ in range(300)]
    expected = [reference.encode(t, add_special_tokens=False) for t in texts]
    assert ours.batch_encode(texts) == expected
    assert ours.batch_decode(expected) == [reference.decode(ids) for ids in expected]


def test_decode_of_partial_utf8_matches_transformers(ours, reference):
    # Prefixes that cut multi-byte characters in half: both must replace the broken bytes the same way.
    ids = ours.encode("👨‍👩‍👧‍👦 中文 🏳️‍🌈 𠮷𪚥🫠🦩")
    prefixes = [ours.decode(ids[:end]) for end in range(1, len(ids) + 1)]
    assert prefixes == [reference.decode(ids[:end]) for end in range(1, len(ids) + 1)]
    assert sum("\ufffd" in text for text in prefixes) >= 5  # the case under test does occur


def _folder_template_render(reference, messages, add_generation_prompt):
    return reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_qwen25_template(ours, reference, messages, add_generation_prompt):
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=QWEN25_CHAT_TEMPLATE)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_template_shipped_in_folder(ours, reference, messages):
    # The folder ships the Qwen3 template: no default system message (and <think> handling for assistant turns
    # after the last user turn, which prompts never have). Without the default system prompt it equals ours.
    default = None if messages[0]["role"] != "system" else QWEN25_DEFAULT_SYSTEM_PROMPT
    expected = _folder_template_render(reference, messages, True)
    assert ours.apply_chat_template(messages, default_system_prompt=default) == expected


def test_chat_template_tokenized_matches_transformers(ours, reference):
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends. 多少?"}]
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                             chat_template=QWEN25_CHAT_TEMPLATE)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert ours.apply_chat_template(messages, tokenize=True) == list(expected_ids)


def test_chat_template_default_system_and_generation_prompt():
    text = render_qwen_chat([{"role": "user", "content": "2+2?"}])
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages, fragment", [
    ([], "empty"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": 3}], "message 0"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{}]}], "tool_calls"),
])
def test_chat_template_rejects_bad_messages(messages, fragment):
    with pytest.raises(ValueError, match=fragment):
        render_qwen_chat(messages)


# ---------------------------------------------------------------- file errors

def test_missing_files_name_the_file(tmp_path):
    vocab, merges = os.path.join(TINY_DIR, "vocab.json"), os.path.join(TINY_DIR, "merges.txt")
    with pytest.raises(FileNotFoundError, match=r"nope\.json: vocab file not found"):
        Qwen2Tokenizer(str(tmp_path / "nope.json"), merges)
    with pytest.raises(FileNotFoundError, match=r"nope\.txt: merges file not found"):
        Qwen2Tokenizer(vocab, str(tmp_path / "nope.txt"))


def test_unreadable_files_name_the_file(tmp_path):
    merges = os.path.join(TINY_DIR, "merges.txt")
    bad_vocab = tmp_path / "vocab.json"
    bad_vocab.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{bad_vocab}: cannot read vocab file") as info:
        Qwen2Tokenizer(str(bad_vocab), merges)
    assert "\n" not in str(info.value)
    bad_vocab.write_text('{"a": "zero"}', encoding="utf-8")
    with pytest.raises(ValueError, match="non-negative integer"):
        Qwen2Tokenizer(str(bad_vocab), merges)
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree symbols here\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{bad_merges}:3: expected two symbols"):
        load_merges(bad_merges)
    bad_merges.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match=rf"{bad_merges}: cannot read merges file"):
        Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), str(bad_merges))


def test_merge_with_unknown_symbol_is_rejected(tmp_path):
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\nzz qq\n", encoding="utf-8")
    with pytest.raises(ValueError, match="missing from"):
        Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), str(merges))


# ---------------------------------------------------------------- tiny bundled tokenizer

def test_tiny_tokenizer_layout(tiny):
    with open(os.path.join(TINY_DIR, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert 256 < len(vocab) <= 1000
    assert tiny.special_token_ids == [len(vocab), len(vocab) + 1, len(vocab) + 2]
    assert tiny.vocab_size == len(vocab) + 3
    with open(os.path.join(TINY_DIR, "merges.txt"), encoding="utf-8") as f:
        assert f.readline().startswith("#version")
    # All 256 byte symbols are present, so nothing is ever unknown.
    assert all(tiny.token_to_id(chr(c)) is not None for c in range(ord("!"), ord("~") + 1))
    assert tiny.token_to_id("Ġ") is not None and tiny.token_to_id("Ċ") is not None


def test_tiny_tokenizer_round_trip_is_lossless(tiny):
    rng = random.Random(7)
    texts = PARITY_TEXTS + [_random_text(rng) for _ in range(200)]
    # Arbitrary code points (no surrogates), including the astral planes.
    for _ in range(100):
        chars = []
        for _ in range(rng.randint(1, 30)):
            code = rng.randint(0, 0x10FFFF)
            chars.append(chr(code) if not 0xD800 <= code <= 0xDFFF else "x")
        texts.append("".join(chars))
    for text in texts:
        ids = tiny.encode(text)
        assert all(0 <= i < tiny.vocab_size for i in ids)
        assert tiny.decode(ids) == unicodedata.normalize("NFC", text)


def test_tiny_tokenizer_compresses_the_sample_prompts(tiny):
    text = "How much money does Natalia spend in total?"
    assert len(tiny.encode(text)) < len(text.encode("utf-8")) / 2


@pytest.mark.parametrize("data, vocab_size, folder", [
    ("gsm8k_sample.jsonl", 1000, TINY_DIR),
    ("arithmetic_train.jsonl", 600, os.path.join(ROOT, "model_configs", "arith", "policy"))])
def test_bundled_tokenizer_files_are_reproducible(tmp_path, data, vocab_size, folder):
    module = tool_module("make_tiny_tokenizer")
    data_path = os.path.join(ROOT, "examples", "qwen_grpo_tutorial", "data", data)
    vocab, merges = module.train_tiny_bpe(module.corpus_texts(data_path), vocab_size)
    module.write_tokenizer_files(vocab, merges, str(tmp_path))
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == open(os.path.join(folder, name), "rb").read(), \
            f"{folder}/{name} is stale: rerun tools/make_tiny_tokenizer.py"
    shutil.rmtree(tmp_path)


def test_bundled_tokenizer_gives_transformers_the_same_ids():
    """The folder's tokenizer_config.json declares the special tokens, so transformers splits the same way."""
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    ours = Qwen2Tokenizer(os.path.join(TINY_DIR, "vocab.json"), os.path.join(TINY_DIR, "merges.txt"))
    text = "<|im_start|>user\nTom has 3 apples and buys 12 more.<|im_end|>\n<|im_start|>assistant\n"
    assert reference.encode(text) == ours.encode(text)
    assert ours.encode(text)[0] == ours.im_start_token_id
    assert reference.eos_token_id == ours.eos_token_id and reference.pad_token_id == ours.pad_token_id


def test_decode_masked_reads_each_rows_masked_tokens_only(ours):
    import numpy as np

    rows = [ours.encode("12 + 30 = 42<|im_end|>"), ours.encode("<answer>7</answer>")]
    width = max(len(r) for r in rows) + 2
    ids, mask = np.full((2, width), 5, np.int64), np.zeros((2, width), np.int64)
    for i, row in enumerate(rows):  # the first left-padded, the second right-padded
        start = width - len(row) if i == 0 else 0
        ids[i, start:start + len(row)], mask[i, start:start + len(row)] = row, 1
    assert ours.decode_masked(ids, mask, skip_special_tokens=False) == [ours.decode(r) for r in rows]
    assert ours.decode_masked(ids, mask, skip_special_tokens=True)[0] == "12 + 30 = 42"
    # the rewards' text: special tokens skipped, the same for one response and for masked rows
    assert ours.completions(ids, mask) == [ours.completion(r) for r in rows]
    assert ours.completion(rows[0]) == "12 + 30 = 42" != ours.decode(rows[0])
