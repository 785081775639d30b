"""What the tests share (importable as `support`: pytest.ini's pythonpath holds tests/, and the worker scripts get it
from tests/workers/worker_setup.py). Shared fixtures (`mindrecord`, `graph_mode`, `qwen_dir`, the
msrun jobs several modules read) are in tests/conftest.py.

- paths: the repository's paths (the one module that derives them from its own location)
- configs: the tiny Qwen2 config (`TINY_QWEN2`, `tiny_qwen2_config(**overrides)`)
- msrun: launching tests/workers scripts under msrun, running a job with a timeout, free ports, reading rank results
- cases: one launch per world size running several parametrised cases (each case's results in its own folder)
- processes: the session's tag on every process the tests start, and the end-of-session check for leftovers
- jobs: the tutorial's GRPO job on the tiny model, in this process or under msrun
- checkpoints: strategy files, trainer step folders and MindSpore's transforms as oracles
- tools: the tools/*.py scripts as modules or subprocesses
- hf_fixtures: tiny random Hugging Face models (the reference side of parity tests) and their safetensors bytes
- tolerances: weight tolerances after Adam(W) updates
- metrics_doc: docs/metrics.md's rows and `assert_documented`
- experience, fake_engines: a random rollout `Experience` and roles on stand-in train engines
- batches, cells: a small GRPO batch, a weighted NLL loss net and a gradient-applying cell (tests and workers)
- policies: a policy's greedy answers to R1-style prompts
- tokenizer_texts: the texts and conversations the tokenizer tests compare
"""
