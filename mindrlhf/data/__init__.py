"""Prompt data: JSON/JSONL -> MindRecord conversion, prompt templates, the MindRecord prompt reader, and the
parsing of numeric answers (`mindrlhf.data.answers`, shared with the reward functions).

The names are imported lazily, so that `mindrlhf.data.answers` (pure Python) can be used without loading the
tokenizer and MindSpore.
"""
import importlib

_EXPORTS = {
    "ConversionStats": "mindrecord", "DataError": "mindrecord", "convert_to_mindrecord": "mindrecord",
    "read_problems": "mindrecord",
    "PromptDataset": "reader", "bucket_length": "reader", "pad_rows": "reader", "read_prompt_records": "reader",
    "R1_THINK_SYSTEM_PROMPT": "templates", "TEMPLATE_NAMES": "templates", "build_prompt": "templates",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"mindrlhf.data.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
