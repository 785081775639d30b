"""Hugging Face folder <-> MindSpore `.ckpt` conversion: `mindrlhf-convert-weight`, whose code and `--help` are in
mindrlhf/cli/convert_weight.py."""
import sys

from mindrlhf.cli.convert_weight import main

if __name__ == "__main__":
    sys.exit(main())
