#!/usr/bin/env bash
# A feature draft (EAGLE-style) for SmolLM2-135M on one GPU, in one call of <= 10 minutes:
# train it (tools/distill_feature_draft.py) on data made earlier by tools/distill_data.py gen
# (DATA: a data.safetensors or .gz), measure its acceptance offline (with the target's features and
# self-conditioned), in the engine (tools.distill.evaluate: held-out chat set and HumanEval, K = 5)
# and SD against the default draft (tools/bench.py, one invocation, b = 1).
#
#   SSDLIB_MODEL_DIRS=/tmp DATA=.stage/data.safetensors.gz HUMANEVAL=.stage/HumanEval.jsonl.gz \
#       bash dev/gpu_feature.sh     (smollm2-135m resolving to the GGUF staged in /tmp)
# Output: $OUT/feature.log, $OUT/feature_draft.tar (the trained draft), JSON of the bench.
# TRAIN_FLAGS="... --features fused" trains a draft on three target layers (EAGLE-3) instead.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
TARGET=${TARGET:-smollm2-135m}
DATA=${DATA:?DATA=a data.safetensors (or .gz) of tools/distill_data.py gen}
HUMANEVAL=${HUMANEVAL:?HUMANEVAL=path of HumanEval.jsonl.gz}
STEPS=${STEPS:-2000}
TRAIN_FLAGS=${TRAIN_FLAGS:-"--layers 1 --token-gain auto --init-layer-from-target 29 --ttt-steps 3 --batch 16 --seq-len 512 --lr 2e-3 --warmup 200 --long-seq-len 4096 --long-every 4"}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-300}
# RUN_BUDGET=S (> TRAIN_TIMEOUT - 30): one schedule of S seconds over several calls; this call
# stops before its timeout with the run's state in $FD.work, RESUME=1 in the next call goes on
RUN_BUDGET=${RUN_BUDGET:-$((TRAIN_TIMEOUT - 30))}
FD=${FD:-/tmp/feature-draft}
DEVICE=${DEVICE:-cuda}  # (cpu: a dry run of the script's commands on a tiny target)
N_CHAT=${N_CHAT:-24}
MAX_NEW=${MAX_NEW:-256}
POSITIONS=${POSITIONS:-256}
MODES=${MODES:-"ar,sd,sd:draft=$FD"}  # the bench's rows: AR, SD with the default draft, with this one
LOG=$OUT/feature.log
export PYTHONUNBUFFERED=1
case "$DATA" in *.gz) gunzip -c "$DATA" > /tmp/feature_data.safetensors; DATA=/tmp/feature_data.safetensors ;; esac
say() { echo "[gpu_feature $(date +%T)] $*" | tee -a "$LOG"; }
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
if [ "${RESUME:-0}" = 1 ]; then say "train: the run stopped in $FD.work goes on"
else say "train: $STEPS steps, $TRAIN_FLAGS"; fi
# shellcheck disable=SC2086
if [ "${RESUME:-0}" = 1 ]; then
  TRAIN_CMD=(--resume --work-dir "$FD.work" --out "$FD" --device "$DEVICE")
else
  # shellcheck disable=SC2206
  TRAIN_CMD=(--target "$TARGET" --out "$FD" --data-from "$DATA" --steps "$STEPS" --device "$DEVICE"
             --max-mb 16 --eval-every 500 --train-budget "$RUN_BUDGET" $TRAIN_FLAGS)
fi
# a schedule longer than this call (or the rest of one) stops in time, its state kept
STOP=()
[ "${RESUME:-0}" = 1 ] || [ "$RUN_BUDGET" -gt $((TRAIN_TIMEOUT - 30)) ] \
  && STOP=(--stop-after $((TRAIN_TIMEOUT - 35)))
timeout "$TRAIN_TIMEOUT" python3 tools/distill_feature_draft.py "${TRAIN_CMD[@]}" "${STOP[@]}" \
    2>&1 | tr '\r' '\n' | grep -v '%|' | grep -v '^\s*$' | tail -15 | tee -a "$LOG"
fi
[ -s "$FD/model.safetensors" ] || { say "no draft written"; exit 1; }
[ "${SKIP_TRAIN:-0}" = 1 ] || tar -cf "$OUT/feature_draft.tar" -C "$FD" .
# TRAIN_ONLY=1: stop here (a later call evaluates the carried draft: FD=its directory, SKIP_TRAIN=1)
[ "${TRAIN_ONLY:-0}" = 1 ] && { say "trained (TRAIN_ONLY)"; exit 0; }
say "offline acceptance (K = 5): the target's features, and self-conditioned"
timeout 90 python3 -m tools.distill.feature_eval --draft "$FD" --target "$TARGET" --data-from "$DATA" \
    --k 5 --positions "$POSITIONS" --device "$DEVICE" 2>&1 | tail -8 | tee -a "$LOG"
say "engine acceptance (K = 5, 128 tokens; held-out chat set and 24 HumanEval prompts)"
timeout 120 python3 -m tools.distill.evaluate --draft "$FD" --target "$TARGET" --device "$DEVICE" \
    --humaneval "$HUMANEVAL" --n-prompts "$N_CHAT" --k 5 --max-new-tokens 128 2>&1 | grep '^|' \
    | tee -a "$LOG"
say "SD with the feature draft against the default draft, b = 1 (24 held-out chat prompts)"
python3 - > /tmp/chat24.jsonl <<'EOF2'
import json
for line in open("tools/distill/heldout_chat.jsonl"):
    if line.strip():
        print(json.dumps({"messages": json.loads(line)["messages"]}))
EOF2
timeout "${BENCH_TIMEOUT:-150}" python3 tools/bench.py --device "$DEVICE" --target "$TARGET" --prompts-file /tmp/chat24.jsonl \
    --chat --modes "$MODES" --max-new-tokens "$MAX_NEW" --k 3 --n-prompts "$N_CHAT" \
    --json "$OUT/bench_feature.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -16 | tee -a "$LOG"
