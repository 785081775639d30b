"""The command line: one module per command, each with `main(argv) -> exit code`, installed as console scripts
(setup.py) and reachable by the tutorial's paths, which are thin files calling the same `main`:

| command | module | tutorial path |
|---|---|---|
| `mindrlhf-train` | `train` | `examples/qwen_grpo_tutorial/grpo_one_stage.py` |
| `mindrlhf-prepare-data` | `prepare_data` | `examples/qwen_grpo_tutorial/rlhf_data.py` |
| `mindrlhf-convert-weight` | `convert_weight` | `tools/convert_weight.py` |
| `mindrlhf-transform-checkpoint` | `transform_checkpoint` | `tools/transform_checkpoint.py` |
"""
