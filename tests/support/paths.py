"""The repository's paths, the one place that derives them from this file: every test, helper and worker takes
them from here."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKERS_DIR = TESTS / "workers"  # scripts the tests launch (support.msrun.run_worker)

LIBRARY = ROOT / "mindrlhf"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RUN_GRPO = ROOT / "run_grpo.sh"
TOOLS = ROOT / "tools"
BENCHMARKS = ROOT / "benchmarks"
EXAMPLES = ROOT / "examples"

MODEL_CONFIGS = ROOT / "model_configs"
TINY = MODEL_CONFIGS / "tiny"  # the tiny model the trainer tests run
TOKENIZER = TINY / "tokenizer"
TINY_SFT_CKPT = TINY / "tiny_sft.ckpt"  # the tiny SFT policy (tools/sft_policy.py built it)
ARITH = MODEL_CONFIGS / "arith"  # run_grpo.sh's default model

TUTORIAL = EXAMPLES / "qwen_grpo_tutorial"
GRPO_SCRIPT = TUTORIAL / "grpo_one_stage.py"
TUTORIAL_DATA = TUTORIAL / "data"
GSM8K_SAMPLE = TUTORIAL_DATA / "gsm8k_sample.jsonl"  # the tutorial's data file
