"""Prompt data: the input files (`sources`: a JSON list, JSONL or Parquet file or a folder of them, read into
records), their conversion to MindRecord (`mindrecord`), prompt templates (`templates`), the MindRecord prompt
reader (`reader`) and the parsing of numeric answers (`answers`, pure Python, shared with the reward functions).
Import the names from their modules."""
