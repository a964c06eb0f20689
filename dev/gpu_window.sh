#!/usr/bin/env bash
# The draft's acceptance by prompt length with and without its sliding window, on one GPU:
# tools.distill.evaluate (K = 5, 128 tokens, T = 0 and 0.7; the held-out chat set, HumanEval and
# code prompts of <= 512 / 2k / 6k tokens) for the default draft as shipped and for the same
# weights with the window removed (/tmp/draft-nowindow). Run from a checkout whose smollm2-135m
# resolves (SSDLIB_MODEL_DIRS):  HUMANEVAL=.stage/HumanEval.jsonl.gz bash dev/gpu_window.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
HUMANEVAL=${HUMANEVAL:?HUMANEVAL=path of HumanEval.jsonl.gz}
N=${N_PROMPTS:-8}; LN=${LENGTH_PROMPTS:-4}
export PYTHONUNBUFFERED=1
D=ssdlib/assets/smollm2-135m-draft
NOWIN=/tmp/draft-nowindow
rm -rf "$NOWIN" && cp -r "$D" "$NOWIN"
python3 - "$NOWIN/config.json" <<'EOF2'
import json, sys
c = json.load(open(sys.argv[1]))
c.pop("sliding_window", None)
c.update(model_type="llama", architectures=["LlamaForCausalLM"])
json.dump(c, open(sys.argv[1], "w"), indent=2)
EOF2
for name in window:$D nowindow:$NOWIN; do
  echo "== ${name%%:*}" | tee -a "$OUT/window.log"
  timeout ${EVAL_TIMEOUT:-240} python3 -m tools.distill.evaluate --draft "${name#*:}" --target smollm2-135m \
      --device cuda --humaneval "$HUMANEVAL" --n-prompts "$N" --k 5 --max-new-tokens 128 \
      --lengths 512,2048,6144 --length-prompts "$LN" 2>&1 | grep -v "^\[rank\|WARN" | tail -16 | tee -a "$OUT/window.log"
done
