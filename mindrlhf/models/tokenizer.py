"""Tokenizers of Hugging Face model folders, and `load_tokenizer` choosing the right one for the files given.

A folder with `tokenizer.json` (Llama-architecture models such as SmolLM2 ship only that) is read with the
`tokenizers` library; `tokenizer_config.json` supplies the special tokens and the chat template (also read
from `chat_template.jinja`, where transformers 5 saves it) and `generation_config.json` the extra stop ids.
A folder with only `vocab.json` + `merges.txt` is a Qwen2 byte-level BPE (`Qwen2Tokenizer`).
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from mindrlhf.models.qwen2.tokenizer import Qwen2Tokenizer
from mindrlhf.models.tokenizer_base import TokenizersBackend

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: cannot read: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template_of(folder: str, config: dict, config_path: str) -> str | None:
    jinja_path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_path}: chat_template must be a string or a list of named templates")
    return template


def compile_chat_template(template: str, source: str):
    """Compiles a Jinja chat template the way transformers does (sandboxed, trim/lstrip blocks, loop controls)."""
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except TemplateError as err:
        raise ValueError(f"{source}: chat template does not compile: {err}") from None


class HFTokenizer(TokenizersBackend):
    """Tokenizer of a Hugging Face folder with `tokenizer.json`, with transformers' ids, decoding and chat template.

    `eos_token_id` is the config's eos token; generation stops on it and on the ids of
    `generation_config.json`'s `eos_token_id`; `pad_token_id` is the pad token, else the eos token.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)
        self.source = os.path.join(self.folder, "tokenizer.json")
        try:
            self._tokenizer = Tokenizer.from_file(self.source)
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise ValueError(f"{self.source}: cannot load tokenizer: {err}") from None
        config_path = os.path.join(self.folder, "tokenizer_config.json")
        config = _read_json(config_path) if os.path.isfile(config_path) else {}
        self.special_tokens = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        for key, token in self.special_tokens.items():
            if token is not None and self._tokenizer.token_to_id(token) is None:
                raise ValueError(f"{config_path}: {key} {token!r} is not in {self.source}")
        if self.special_tokens["eos_token"] is None:
            raise ValueError(f"{config_path}: eos_token is not set (generation needs an end-of-sequence token)")
        template = _chat_template_of(self.folder, config, config_path)
        self._template_source = template
        self._chat_template = None if template is None else compile_chat_template(template, config_path)
        self.eos_token_id = self._tokenizer.token_to_id(self.special_tokens["eos_token"])
        pad = self.special_tokens["pad_token"] or self.special_tokens["eos_token"]
        self.pad_token_id = self._tokenizer.token_to_id(pad)
        stops = [self.eos_token_id]
        generation_path = os.path.join(self.folder, "generation_config.json")
        if os.path.isfile(generation_path):
            extra = _read_json(generation_path).get("eos_token_id")
            for token_id in extra if isinstance(extra, list) else [extra]:
                if isinstance(token_id, int) and token_id not in stops:
                    stops.append(token_id)
        self.stop_token_ids = stops

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools=` list (it reads the `tools` variable); parsed when asked."""
        return self._chat_template is not None and "tools" in meta.find_undeclared_variables(
            self._chat_template.environment.parse(self._template_source))

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            tokenize: bool = False, tools: Sequence[Mapping] | None = None) -> str | list[int]:
        """Renders `messages` with the folder's chat template (as transformers does), `tools` (JSON schemas, as
        `tool_use.function_schema` writes them) offered to the model; its ids if `tokenize`."""
        if self._chat_template is None:
            raise ValueError(f"{self.folder}: the tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template' or chat_template.jinja); use the 'raw' prompt template")
        if tools and not self.supports_tools:
            raise ValueError(f"{self.folder}: the chat template does not render tools (it never reads `tools`); "
                             "use a tokenizer whose template supports tool calling")
        tokens = {key: value for key, value in self.special_tokens.items() if value is not None}
        extra = {"tools": [dict(t) for t in tools]} if tools else {}
        try:
            text = self._chat_template.render(messages=[dict(m) for m in messages],
                                              add_generation_prompt=add_generation_prompt, **tokens, **extra)
        except TemplateError as err:
            raise ValueError(f"apply_chat_template: {err}") from None
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"HFTokenizer(folder={self.folder!r}, vocab_size={self.vocab_size})"


def load_tokenizer(tokenizer_dir: str | os.PathLike | None = None, vocab_path: str | os.PathLike | None = None,
                   merges_file_path: str | os.PathLike | None = None) -> HFTokenizer | Qwen2Tokenizer:
    """The tokenizer of a Hugging Face folder (`tokenizer.json`, else `vocab.json` + `merges.txt`), or of the
    explicit Qwen `vocab_path` + `merges_file_path`. Errors name the folder or file and what is missing."""
    if tokenizer_dir is None:
        if vocab_path is None or merges_file_path is None:
            raise ValueError("tokenizer: give a tokenizer folder, or both a vocab.json and a merges.txt path")
        return Qwen2Tokenizer(vocab_path, merges_file_path)
    folder = os.fspath(tokenizer_dir)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: tokenizer folder not found")
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return Qwen2Tokenizer(vocab, merges)
    raise ValueError(f"{folder}: no tokenizer files (expected tokenizer.json, or vocab.json and merges.txt)")
