"""MindRLHF's tutorial path of the data tool (JSON, JSONL or Parquet problems -> the prompt MindRecord):
`mindrlhf-prepare-data`, whose code and `--help` are in mindrlhf/cli/prepare_data.py."""
import sys

from mindrlhf.cli.prepare_data import main

if __name__ == "__main__":
    sys.exit(main())
