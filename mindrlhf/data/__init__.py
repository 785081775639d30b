"""Prompt data: JSON/JSONL -> MindRecord conversion, prompt templates, and the MindRecord prompt reader."""
from mindrlhf.data.mindrecord import ConversionStats, DataError, convert_to_mindrecord, read_problems
from mindrlhf.data.reader import PromptDataset, bucket_length, pad_rows, read_prompt_records
from mindrlhf.data.templates import R1_THINK_SYSTEM_PROMPT, TEMPLATE_NAMES, build_prompt

__all__ = [
    "ConversionStats", "DataError", "PromptDataset", "R1_THINK_SYSTEM_PROMPT", "TEMPLATE_NAMES", "build_prompt",
    "bucket_length", "convert_to_mindrecord", "pad_rows", "read_problems", "read_prompt_records",
]
