"""Offline checkpoint transform between parallel layouts: `mindrlhf-transform-checkpoint`, whose code and `--help`
are in mindrlhf/cli/transform_checkpoint.py."""
import sys

from mindrlhf.cli.transform_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
