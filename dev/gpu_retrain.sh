#!/usr/bin/env bash
# Both SmolLM2 drafts continued on fresh data on one GPU, measured against the shipped ones, in
# back-to-back calls on one machine (each <= 10 minutes; /tmp persists between them):
#   PART=tests   carry .stage/smol.part.00 .whl      GPU tests of the speculative engine
#                (TEST_FILES="..." a subset of the files, TEST_K the -k expression, TEST_S seconds)
#   (then)       bash dev/stage_gguf.sh, carry .stage/smol.part.01
#   PART=data    carry .stage/smol.part.02 .stage/smol.sha256 .stage/HumanEval.jsonl.gz
#                fresh data (dev/gpu_draft.sh STEP=data, seed $SEED) into /tmp/distill;
#                EXTRA_DATA="a.safetensors.gz ..." (sets of earlier seeds, carried) are merged
#                in (tools/distill_data.py merge: held-out documents stay unseen);
#                GEN_EXTRA="--greedy-answers 0.5": more flags of tools/distill_data.py gen;
#                TESTS_BG=1: the GPU tests of PART=tests beside the sampling (TEST_FILES, TEST_K)
#   PART=merge   no sampling: the sets carried so far (.stage/data*.safetensors.gz, any call
#                may carry one: every call keeps them in /tmp/distill/sets) merged into
#                /tmp/distill/data.safetensors, the training set of PART=train. A set (~7.7 MB)
#                and a GGUF part (~32.8 MB) with the tree (~26.5 MB) pass a call's 64 MiB:
#                carry the sets in a call of their own (two fit, with .whl), e.g. the first
#   PART=train   the default draft continued with long rows (tools/distill_draft.py
#                --long-seq-len, its window kept) and the feature draft continued
#                (tools/distill_feature_draft.py), side by side on the GPU; FD_ONLY=1: the
#                feature draft alone; with RUN_BUDGET=S (> TRAIN_S - 30) its schedule spans
#                several calls: PART=resume goes on with it (same optimizer, no fresh warm-up)
#   PART=fdeval  the new feature draft and the shipped one side by side: acceptance in the
#                engine (tools.distill.evaluate, chat and HumanEval, K = 5) and offline
#   PART=eval    acceptance of both against the shipped ones: chat, HumanEval, by prompt length
#                (default draft); offline both ways and in the engine (feature draft; its
#                script's bench is cut: the evaluations share the GPU)
#   PART=lengths AR / SD / SSD by prompt length with the shipped and the new default draft
#   PART=chat    b = 1 on the 24 held-out chat prompts: AR, SD and SSD with each draft
# Results under $OUT; the new drafts as $OUT/*/cand_long.tar and $OUT/fd/feature_draft.tar.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export SSDLIB_SKIP_EXT=${SSDLIB_SKIP_EXT:-1} PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site SSDLIB_MODEL_DIRS=/tmp
SEED=${SEED:-11}
TRAIN_S=${TRAIN_S:-360}
HE=$PWD/.stage/HumanEval.jsonl.gz
[ -f "$HE" ] && cp "$HE" /tmp/HumanEval.jsonl.gz
HE=/tmp/HumanEval.jsonl.gz
NEW=/tmp/distill/packed/long
FD=/tmp/fd_new
LONG_FLAGS="--init-from ssdlib/assets/smollm2-135m-draft --loss tvd --lr ${LONG_LR:-2e-4} --warmup 50"
LONG_FLAGS="$LONG_FLAGS --long-seq-len 4096 --long-batch 4 --long-every 4"
FD_FLAGS="--init-from ssdlib/assets/smollm2-135m-eagle --ttt-steps 3 --batch 16 --seq-len 512"
FD_FLAGS="$FD_FLAGS --lr ${FD_LR:-8e-4} --warmup 100 --long-seq-len 4096 --long-every 4 --token-gain auto"
# FD_EXTRA: more flags for the feature draft, after these (a later flag wins: "--warmup 500")
FD_FLAGS="$FD_FLAGS ${FD_EXTRA:-}"
F="grep -v ^\[rank\|WARN"
# data sets carried by this call stay on the machine for PART=merge
mkdir -p /tmp/distill/sets && cp .stage/data*.safetensors.gz /tmp/distill/sets/ 2>/dev/null
# merge_sets OUT SET...: the sets (a .gz unpacked once into /tmp/distill/sets) merged into OUT
merge_sets() {
  local out=$1 f u; shift; local sets=()
  for f in "$@"; do
    case "$f" in
      *.gz) u=/tmp/distill/sets/$(basename "$f" .gz); [ -f "$u" ] || gunzip -c "$f" > "$u"; sets+=("$u") ;;
      *) sets+=("$f") ;;
    esac
  done
  python3 tools/distill_data.py merge --out "$out" "${sets[@]}" 2>&1 | tail -8
}
case "${PART:?PART=tests|data|merge|train|resume|fdeval|eval|lengths|chat}" in
  tests)
    bash dev/stage_gguf.sh
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
    # TEST_FILES: a subset (the whole list outlasts one call's limit)
    # shellcheck disable=SC2086
    timeout "${TEST_S:-420}" python3 -m pytest -q -p no:logging -k "${TEST_K:-cuda}" \
      ${TEST_FILES:-tests/engine/test_feature_draft_ssd.py tests/engine/test_feature_draft_sd.py \
      tests/distributed/test_stream_placement.py tests/engine/test_chained_sampling.py \
      tests/engine/runner/test_step_graphs.py} --durations 12 2>&1 | $F | tail -30 ;;
  data)
    bash dev/stage_gguf.sh || exit 3
    if [ "${TESTS_BG:-0}" = 1 ]; then
      # shellcheck disable=SC2086
      ( timeout "${TEST_S:-300}" python3 -m pytest -q -p no:logging -k "${TEST_K:-cuda}" \
          ${TEST_FILES:-tests/engine/test_feature_draft_ssd.py tests/engine/test_feature_draft_sd.py} \
          > "$OUT/tests_bg.log" 2>&1 ) &
    fi
    STEP=data DATA_BUDGET=${DATA_BUDGET:-220} DATA_TIMEOUT=${DATA_TIMEOUT:-320} \
      DATA_EXTRA="--seed $SEED ${GEN_EXTRA:-}" OUT=$OUT/data bash dev/gpu_draft.sh 2>&1 | tail -25
    if [ -n "${EXTRA_DATA:-}" ]; then
      # shellcheck disable=SC2086
      merge_sets /tmp/distill/merged.safetensors /tmp/distill/data.safetensors $EXTRA_DATA \
        && mv /tmp/distill/merged.safetensors /tmp/distill/data.safetensors
    fi
    if [ "${TESTS_BG:-0}" = 1 ]; then
      wait; echo "== GPU tests"; grep -E "passed|failed|FAILED|ERROR" "$OUT/tests_bg.log" | tail -8
    fi ;;
  merge)
    bash dev/stage_gguf.sh || exit 3
    carried=(/tmp/distill/sets/*.safetensors.gz)
    [ -e "${carried[0]}" ] || { echo "merge: no data set carried (.stage/data*.safetensors.gz)"; exit 2; }
    merge_sets /tmp/distill/data.safetensors "${carried[@]}" ;;
  train)
    if [ "${FD_ONLY:-0}" = 1 ]; then
      OUT=$OUT/fd TARGET=smollm2-135m DATA=/tmp/distill/data.safetensors HUMANEVAL=$HE FD=$FD \
        STEPS=40000 TRAIN_TIMEOUT=$TRAIN_S TRAIN_ONLY=1 TRAIN_FLAGS="$FD_FLAGS" \
        bash dev/gpu_feature.sh 2>&1 | tail -12
      exit 0
    fi
    ( OUT=$OUT/fd TARGET=smollm2-135m DATA=/tmp/distill/data.safetensors HUMANEVAL=$HE FD=$FD \
        STEPS=20000 TRAIN_TIMEOUT=$TRAIN_S TRAIN_ONLY=1 TRAIN_FLAGS="$FD_FLAGS" \
        bash dev/gpu_feature.sh > /tmp/fd_train.log 2>&1 ) &
    STEP=train TRAIN_ONLY=1 TRAIN_TIMEOUT=$TRAIN_S STEPS=20000 CANDIDATES="long|$LONG_FLAGS" \
      OUT=$OUT/d bash dev/gpu_draft.sh 2>&1 | tail -22
    wait; tail -12 /tmp/fd_train.log ;;
  resume)
    OUT=$OUT/fd TARGET=smollm2-135m DATA=/tmp/distill/data.safetensors HUMANEVAL=$HE FD=$FD \
      TRAIN_TIMEOUT=$TRAIN_S TRAIN_ONLY=1 RESUME=1 bash dev/gpu_feature.sh 2>&1 | tail -12 ;;
  eval)
    ( OUT=$OUT/fd TARGET=smollm2-135m DATA=/tmp/distill/data.safetensors HUMANEVAL=$HE FD=$FD \
        SKIP_TRAIN=1 BENCH_TIMEOUT=1 \
        bash dev/gpu_feature.sh > /tmp/fd_eval.log 2>&1 ) &
    STEP=eval CANDIDATES="long|$LONG_FLAGS" HUMANEVAL=$HE EVAL_PROMPTS=24 EVAL_LENGTHS=512,2048,6144 \
      OUT=$OUT/d bash dev/gpu_draft.sh 2>&1 | grep -E '^\s*\[(long|base)\]|eval|rc' | tail -40
    wait; grep -v '^\s*$' /tmp/fd_eval.log | tail -30 ;;
  fdeval)
    # both drafts at once (acceptance does not depend on the other's load on the GPU)
    for d in ssdlib/assets/smollm2-135m-eagle $FD; do
      n=$(basename "$d")
      ( timeout 400 python3 -m tools.distill.evaluate --draft "$d" --target smollm2-135m \
          --device cuda --humaneval "$HE" --n-prompts 24 --k 5 --max-new-tokens 128 \
          > "$OUT/evaluate_$n.log" 2>&1
        timeout 150 python3 -m tools.distill.feature_eval --draft "$d" --target smollm2-135m \
          --data-from /tmp/distill/data.safetensors --k 5 --positions "${POSITIONS:-192}" \
          --self-conditioned 1,6 --device cuda > "$OUT/feature_eval_$n.log" 2>&1 ) &
    done
    wait
    for n in smollm2-135m-eagle "$(basename "$FD")"; do
      echo "== $n"; grep '^|' "$OUT/evaluate_$n.log"; grep -v '^\[rank\|WARN' "$OUT/feature_eval_$n.log" | tail -8
    done ;;
  lengths)
    HUMANEVAL=$HE B8=${B8:-0} LENGTHS=${LENGTHS:-"512 2048 6144"} \
      MODES=${MODES:-"ar,sd,sd:draft=$NEW,ssd:draft=$NEW"} bash dev/gpu_lengths.sh 2>&1 | tail -80 ;;
  chat)
    python3 - > /tmp/chat24.jsonl <<'EOF2'
import json
for line in open("tools/distill/heldout_chat.jsonl"):
    if line.strip():
        print(json.dumps({"messages": json.loads(line)["messages"]}))
EOF2
    timeout 540 python3 tools/bench.py --device cuda --target smollm2-135m --prompts-file /tmp/chat24.jsonl \
      --chat --modes "${MODES:-ar,sd,sd:draft=$NEW,ssd:draft=$NEW,sd:draft=$FD,ssd:draft=$FD}" \
      --max-new-tokens 256 --k 3 --n-prompts 24 --json "$OUT/chat.json" 2>&1 | $F | tail -40 ;;
  *) echo "PART must be tests, data, merge, train, resume, fdeval, eval, lengths or chat"; exit 2 ;;
esac
