#!/usr/bin/env bash
# The bundled tiny default, end to end and without downloads:
#   1. sets up .venv (first run only),
#   2. converts the bundled GSM8K-style sample to a MindRecord with the bundled tiny tokenizer,
#   3. runs GRPO steps in one process (CPU, GRAPH_MODE) from the bundled tiny policy, a 0.16M-parameter
#      Qwen2 briefly fine-tuned on the sample (tools/make_tiny_checkpoint.py rebuilds it).
# Extra arguments go to the GRPO script, e.g. `bash run_grpo.sh --steps 10 --num_samples 8`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bash "$ROOT/tools/bootstrap.sh"
PY="$ROOT/.venv/bin/python"
cd "$ROOT"
export GLOG_v="${GLOG_v:-3}"  # MindSpore: errors only
OUT="${MINDRLHF_OUTPUT:-$ROOT/output/tiny_grpo}"
mkdir -p "$OUT"
TOK="$ROOT/model_configs/tiny/tokenizer"
"$PY" examples/qwen_grpo_tutorial/rlhf_data.py --vocab_path "$TOK/vocab.json" --merges_file_path "$TOK/merges.txt" \
    --file_path examples/qwen_grpo_tutorial/data/gsm8k_sample.jsonl --output_path "$OUT/gsm8k_sample.mindrecord" \
    --template r1_think --max_prompt_length 256
"$PY" examples/qwen_grpo_tutorial/grpo_pipeline_demo.py --config model_configs/tiny/model.yaml \
    --vocab_path "$TOK/vocab.json" --merges_file_path "$TOK/merges.txt" --mindrecord "$OUT/gsm8k_sample.mindrecord" \
    --load_checkpoint model_configs/tiny/tiny_sft.ckpt --max_new_tokens 96 --steps 5 --batch_size 4 --num_samples 4 "$@"
