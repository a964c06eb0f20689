#!/usr/bin/env bash
# Speculation against AR by prompt length on one GPU (issue: speculation must never lose to AR):
# b = 1, greedy, K = 3, 128 tokens past EOS, prompts of <= 512, 2k and 6k tokens of HumanEval code
# in "Here is some Python code: ... Write a short summary"; one tools/bench.py invocation a
# length, so each row's ratio is within one run. Rows: AR; SD with a fixed K and adaptive K
# (the default draft); SD with a random-weights draft of the default shape; SSD; and, with
# NEW_DRAFT=DIR, SD (fixed and adaptive K) and SSD with that draft. Then b = 8 on 16 prompts of
# 2k tokens.
#
#   run from a checkout whose smollm2-135m resolves (SSDLIB_MODEL_DIRS), e.g. after
#   dev/gpu_startup.sh's staging:  HUMANEVAL=.stage/HumanEval.jsonl.gz bash dev/gpu_lengths.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
HUMANEVAL=${HUMANEVAL:?HUMANEVAL=path of HumanEval.jsonl.gz}
LENGTHS=${LENGTHS:-512 2048 6144}
NEW_DRAFT=${NEW_DRAFT:-}
# PASSES=N: each row is the median of N timed passes over its prompts (tools/bench.py --passes;
# default auto: passes until they add up to 2 s)
B8=${B8:-1}
export PYTHONUNBUFFERED=1
RND=/tmp/random-draft
python3 dev/random_draft.py --out "$RND"
prompts() {  # length n -> /tmp/long_<length>_<n>.jsonl
  python3 - "$HUMANEVAL" "$1" "$2" > "/tmp/long_$1_$2.jsonl" <<'EOF3'
import json, sys
from ssdlib.loading import load_checkpoint
from tools.distill.evaluate import humaneval_code, length_prompts
tok = load_checkpoint("smollm2-135m").tokenizer
for p in length_prompts(tok, humaneval_code(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])):
    print(json.dumps(p))
EOF3
}
DEFAULT_MODES="ar,sd:adaptive_k=0,sd,sd:draft=$RND,ssd"
[ -n "$NEW_DRAFT" ] && DEFAULT_MODES="$DEFAULT_MODES,sd:draft=$NEW_DRAFT:adaptive_k=0,sd:draft=$NEW_DRAFT,ssd:draft=$NEW_DRAFT"
MODES=${MODES:-$DEFAULT_MODES}  # RND and NEW_DRAFT may be named in a MODES given
for L in $LENGTHS; do
  prompts "$L" 2
  echo "== prompts of <= $L tokens, b = 1" | tee -a "$OUT/lengths.log"
  timeout ${BENCH_TIMEOUT:-200} python3 tools/bench.py --device cuda --prompts-file "/tmp/long_${L}_2.jsonl" --chat \
      --modes "$MODES" --max-new-tokens 128 --ignore-eos --max-len 8192 --n-prompts 2 --k 3 \
      --passes "${PASSES:-auto}" --json "$OUT/len_$L.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -24 | tee -a "$OUT/lengths.log"
done
if [ "$B8" = 1 ]; then
  prompts 2048 16
  B8MODES=${B8MODES:-ar,sd:adaptive_k=0,sd}
  [ -n "$NEW_DRAFT" ] && B8MODES="$B8MODES,sd:draft=$NEW_DRAFT"
  echo "== 16 prompts of <= 2048 tokens, b = 8" | tee -a "$OUT/lengths.log"
  timeout ${B8_TIMEOUT:-200} python3 tools/bench.py --device cuda --prompts-file /tmp/long_2048_16.jsonl --chat \
      --modes "$B8MODES" --max-new-tokens 128 --ignore-eos --max-len 2304 --n-prompts 16 --k 3 \
      --batch 8 --json "$OUT/len_2048_b8.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -20 | tee -a "$OUT/lengths.log"
fi
