"""Checkpoints and weights on disk: the trainer's step folders (`step`) and reading weights files into nets
(`weights`). Below the trainer, so that `tools/` can use it."""
