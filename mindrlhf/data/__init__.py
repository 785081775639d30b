"""Prompt data: JSON/JSONL -> MindRecord conversion (`mindrecord`), prompt templates (`templates`), the MindRecord
prompt reader (`reader`) and the parsing of numeric answers (`answers`, pure Python, shared with the reward
functions). Import the names from their modules."""
