"""Qwen2/Qwen2.5 tokenizer (byte-level BPE from vocab.json + merges.txt) and the Qwen2.5 chat template.

Built on the Hugging Face `tokenizers` library with the same pipeline as Qwen's own `tokenizer.json`:
NFC normalisation, Qwen2's pre-tokenizer regex followed by the GPT-2 byte-to-unicode mapping, BPE
without unknown token, and the byte-level decoder. Added tokens come from the `tokenizer_config.json`
next to vocab.json (`added_tokens_decoder`, as Hugging Face folders ship it: 22 for Qwen2.5, e.g.
`<tool_call>` and `<|fim_prefix|>`); without one, the three chat tokens (`<|endoftext|>`,
`<|im_start|>`, `<|im_end|>`) are appended after the vocabulary. With the real Qwen vocabulary
(151643 entries) those three get the ids 151643, 151644 and 151645.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from mindrlhf.models.tokenizer_base import TokenizersBackend

# Qwen2's pre-tokenizer: like GPT-4's cl100k pattern, but digits are split one by one (\p{N}).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

QWEN25_DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHAT_ROLES = ("system", "user", "assistant", "tool")


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Qwen2's pre-tokenizer: regex split (isolated) then byte-level mapping without its own regex."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def load_vocab(vocab_path: str | os.PathLike) -> dict[str, int]:
    """Reads a GPT-2/Qwen style vocab.json ({token: id}); errors name the file and what is wrong."""
    vocab_path = os.fspath(vocab_path)
    if not os.path.isfile(vocab_path):
        raise FileNotFoundError(f"{vocab_path}: vocab file not found (expected a vocab.json)")
    try:
        with open(vocab_path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{vocab_path}: cannot read vocab file: {err}") from None
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{vocab_path}: vocab file must be a non-empty JSON object {{token: id}}")
    for token, token_id in vocab.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"{vocab_path}: id of token {token!r} must be a non-negative integer, got {token_id!r}")
    if len(set(vocab.values())) != len(vocab):
        raise ValueError(f"{vocab_path}: vocab file has duplicate ids")
    return vocab


def load_merges(merges_path: str | os.PathLike) -> list[tuple[str, str]]:
    """Reads a merges.txt (one `left right` pair a line, optional `#version` header) in rank order."""
    merges_path = os.fspath(merges_path)
    if not os.path.isfile(merges_path):
        raise FileNotFoundError(f"{merges_path}: merges file not found (expected a merges.txt)")
    try:
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{merges_path}: cannot read merges file: {err}") from None
    merges = []
    for line_no, line in enumerate(lines, start=1):
        line = line.rstrip("\r")
        if not line or (line_no == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"{merges_path}:{line_no}: expected two symbols separated by one space, got {line!r}")
        merges.append((parts[0], parts[1]))
    return merges


def render_qwen_chat(
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    default_system_prompt: str | None = QWEN25_DEFAULT_SYSTEM_PROMPT,
) -> str:
    """Renders messages with the Qwen2.5 chat template (ChatML), as its Jinja template does without tools.

    A conversation that does not start with a system message gets `default_system_prompt` (Qwen2.5's
    "You are Qwen, ..."); pass None for no system block. Consecutive `tool` messages are grouped into one
    user turn of `<tool_response>` blocks. Assistant tool calls are not supported.
    """
    if not messages:
        raise ValueError("apply_chat_template: messages is empty")
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"apply_chat_template: message {position} must be a mapping with string "
                             f"'role' and 'content', got {message!r}")
        if message["role"] not in CHAT_ROLES:
            raise ValueError(f"apply_chat_template: message {position} has role {message['role']!r}, "
                             f"expected one of {CHAT_ROLES}")
        if message.get("tool_calls"):
            raise ValueError(f"apply_chat_template: message {position} has tool_calls, which are not supported")
    parts = []
    if messages[0]["role"] == "system":
        parts.append(f"{IM_START}system\n{messages[0]['content']}{IM_END}\n")
    elif default_system_prompt is not None:
        parts.append(f"{IM_START}system\n{default_system_prompt}{IM_END}\n")
    for position, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system" and position == 0:
            continue
        if role == "tool":
            first_of_run = position == 0 or messages[position - 1]["role"] != "tool"
            last_of_run = position == len(messages) - 1 or messages[position + 1]["role"] != "tool"
            parts.append((f"{IM_START}user" if first_of_run else "")
                         + f"\n<tool_response>\n{content}\n</tool_response>"
                         + (f"{IM_END}\n" if last_of_run else ""))
        else:
            parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(f"{IM_START}assistant\n")
    return "".join(parts)


def load_added_tokens(config_path: str, vocab_size: int) -> list[AddedToken]:
    """Added tokens of a Hugging Face `tokenizer_config.json`, in id order, ids checked to follow the vocab."""
    try:
        with open(config_path, encoding="utf-8") as f:
            entries = json.load(f).get("added_tokens_decoder", {})
        entries = sorted((int(i), entry) for i, entry in entries.items())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, ValueError) as err:
        raise ValueError(f"{config_path}: cannot read added_tokens_decoder: {err}") from None
    tokens = []
    for expected_id, (token_id, entry) in enumerate(entries, start=vocab_size):
        if token_id != expected_id or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{config_path}: added token id {token_id} ({entry!r}) should be {expected_id}: added "
                             "tokens must follow the vocabulary without gaps, each with a 'content' string")
        tokens.append(AddedToken(entry["content"], special=bool(entry.get("special", False)),
                                 normalized=bool(entry.get("normalized", False)),
                                 lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                                 single_word=bool(entry.get("single_word", False))))
    return tokens


class Qwen2Tokenizer(TokenizersBackend):
    """Qwen2/Qwen2.5 byte-level BPE tokenizer from `vocab.json` and `merges.txt`.

    Ids match Hugging Face's Qwen2 tokenizer of the same folder, added tokens included. `tokenizer_config_path`
    defaults to the `tokenizer_config.json` beside `vocab_path` when there is one. `eos_token_id` is
    `<|im_end|>` (end of a chat turn); generation should stop on any of
    `stop_token_ids` (`<|im_end|>` and `<|endoftext|>`); `pad_token_id` is `<|endoftext|>`.
    """

    def __init__(self, vocab_path: str | os.PathLike, merges_file_path: str | os.PathLike,
                 tokenizer_config_path: str | os.PathLike | None = None):
        self.vocab_path = os.fspath(vocab_path)
        self.source = self.vocab_path  # what errors about this tokenizer name
        self.merges_file_path = os.fspath(merges_file_path)
        vocab = load_vocab(self.vocab_path)
        merges = load_merges(self.merges_file_path)
        for line_index, (left, right) in enumerate(merges):
            if left not in vocab or right not in vocab or left + right not in vocab:
                raise ValueError(f"{self.merges_file_path}: merge {left!r} {right!r} (rule {line_index + 1}) "
                                 f"uses a symbol missing from {self.vocab_path}")
        model = BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                    end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
        tokenizer = Tokenizer(model)
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = qwen2_pre_tokenizer()
        tokenizer.decoder = decoders.ByteLevel()
        if tokenizer_config_path is None:
            sibling = os.path.join(os.path.dirname(os.path.abspath(self.vocab_path)), "tokenizer_config.json")
            tokenizer_config_path = sibling if os.path.isfile(sibling) else None
        self.tokenizer_config_path = None if tokenizer_config_path is None else os.fspath(tokenizer_config_path)
        added = (load_added_tokens(self.tokenizer_config_path, len(vocab)) if self.tokenizer_config_path
                 else [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
        for token in added:  # one at a time, in id order, so that each gets the next id
            (tokenizer.add_special_tokens if token.special else tokenizer.add_tokens)([token])
        self._tokenizer = tokenizer
        self.endoftext_token_id = self._require_id(ENDOFTEXT)
        self.im_start_token_id = self._require_id(IM_START)
        self.im_end_token_id = self._require_id(IM_END)

    def _require_id(self, token: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.tokenizer_config_path or self.vocab_path}: special token {token} is not defined")
        return token_id

    @property
    def eos_token_id(self) -> int:
        """`<|im_end|>`: ends an assistant turn (Qwen2.5-Instruct's generation_config eos)."""
        return self.im_end_token_id

    @property
    def pad_token_id(self) -> int:
        """`<|endoftext|>`, as in Qwen's tokenizer_config.json."""
        return self.endoftext_token_id

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: `<|im_end|>` and `<|endoftext|>`."""
        return [self.im_end_token_id, self.endoftext_token_id]

    supports_tools = False

    @property
    def special_token_ids(self) -> list[int]:
        """Ids of `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`."""
        return [self.endoftext_token_id, self.im_start_token_id, self.im_end_token_id]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        default_system_prompt: str | None = QWEN25_DEFAULT_SYSTEM_PROMPT,
        tools: Sequence[Mapping] | None = None,
    ) -> str | list[int]:
        """Qwen2.5 chat template (see `render_qwen_chat`); returns the text, or its ids if `tokenize`. Tools are
        rendered only by a tokenizer folder's own template (`HFTokenizer`)."""
        if tools:
            raise ValueError(f"{self.vocab_path}: a vocab.json + merges.txt tokenizer renders no tools; use a "
                             "tokenizer folder whose chat template supports tool calling")
        text = render_qwen_chat(messages, add_generation_prompt=add_generation_prompt,
                                default_system_prompt=default_system_prompt)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"Qwen2Tokenizer(vocab_path={self.vocab_path!r}, vocab_size={self.vocab_size})"
