"""Kept for benchmarks/model_forward.py, which puts tests/ on sys.path and imports `hf_fixtures`: the helpers live in
`support.hf_fixtures` (import them from there; this file goes once that script does)."""
from support.hf_fixtures import hf_logits, make_hf_model_dir  # noqa: F401
