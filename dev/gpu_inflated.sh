#!/usr/bin/env bash
# The inflated pair (tools/inflate.py: SmolLM2's function at 8B / 1B cost) on a GPU machine, after
# dev/gpu_run.sh's first two parts on the same machine (they leave the GGUF in /tmp, the gguf wheel in /tmp/site, ssdlib._C in .snap):
#
#   call 3: STEP=make  bash dev/gpu_inflated.sh   carry .snap .stage/HumanEval.jsonl.gz
#           (inflate to the 8B / 1B shapes in bf16 and fp32; fp32: greedy inflated == original,
#            and SD / SSD == AR on the inflated pair)
#   call 4: STEP=bench bash dev/gpu_inflated.sh   carry .snap .stage/HumanEval.jsonl.gz
#           (bf16: b = 1 and b = 8, greedy and T = 0.7, AR / SD / SSD, per-round breakdown)
#   or, in one call: STEP=quick bash dev/gpu_inflated.sh (the bf16 pair only, then b = 1 greedy
#           AR / SD / SSD on N_PROMPTS prompts)
#
# The checkpoints are written to /tmp/inflated on the device and never come back.
set -uo pipefail
OUT=${OUT:-gpu-out}; STEP=${STEP:-make}; N=${N_PROMPTS:-4}; K=${K:-3}
ROOT=$(pwd); W=/tmp/inflated
mkdir -p "$OUT" "$W"
cp ssdlib/assets/smollm2-135m-draft/model.safetensors .snap/ssdlib/assets/smollm2-135m-draft/
cp ssdlib/_C*.so .snap/ssdlib/
export PYTHONUNBUFFERED=1 SSDLIB_MODEL_DIRS=/tmp PYTHONPATH=$ROOT/.snap:/tmp/site
cd .snap
[ -f COMMIT ] && export SSDLIB_COMMIT=$(cat COMMIT)
F="grep -v ^\[rank\|WARN"
if [ "$STEP" = quick ]; then
  python3 tools/inflate.py smollm2-135m $W/t8b --like llama-3.1-8b --device cuda --dtype bfloat16 2>&1 | grep -v "it/s\]\|B/s\]" | tail -2
  python3 tools/inflate.py smollm2-135m-draft $W/d1b --target smollm2-135m --like llama-3.2-1b --device cuda --dtype bfloat16 2>&1 | grep -v "it/s\]\|B/s\]" | tail -2
  timeout 300 python3 tools/bench.py --target $W/t8b --draft $W/d1b --device cuda --humaneval $ROOT/.stage/HumanEval.jsonl.gz \
      --max-new-tokens 256 --k $K --modes ar,sd,ssd --n-prompts $N --json "$OUT/infl_quick.json" 2>&1 | $F | tail -16
  exit 0
fi
if [ "$STEP" = make ]; then
  df -h /tmp | tail -1
  for dt in bfloat16 float32; do
    sfx=$([ $dt = float32 ] && echo -fp32)
    /usr/bin/time -f "%e s" python3 tools/inflate.py smollm2-135m $W/t8b$sfx --like llama-3.1-8b --device cuda --dtype $dt 2>&1 | grep -v "it/s\]\|B/s\]" | tail -3
    /usr/bin/time -f "%e s" python3 tools/inflate.py smollm2-135m-draft $W/d1b$sfx --target smollm2-135m --like llama-3.2-1b --device cuda --dtype $dt 2>&1 | grep -v "it/s\]\|B/s\]" | tail -3
  done
  echo "== fp32: greedy of the inflated target == the original's (AR, 2 prompts, 64 tokens)"
  timeout 200 python3 - <<'PY' 2>&1 | $F | tail -3
from ssdlib import Generator, SamplingParams
p = SamplingParams(max_new_tokens=64)
prompts = ["def fibonacci(n):", "Write a function that checks whether a number is prime."]
runs = {}
for name, t in (("orig", "smollm2-135m"), ("inflated", "/tmp/inflated/t8b-fp32")):
    with Generator(t, device="cuda", dtype="float32") as g:
        runs[name] = [o.token_ids for o in g.generate(prompts, p, chat=True)]
print("greedy inflated == original:", runs["orig"] == runs["inflated"], [len(r) for r in runs["inflated"]])
PY
  echo "== fp32 inflated pair: SD / SSD greedy == AR"
  timeout 240 python3 tools/bench.py --target $W/t8b-fp32 --draft $W/d1b-fp32 --device cuda --dtype float32 \
      --n-prompts 2 --max-new-tokens 64 --k $K --humaneval $ROOT/.stage/HumanEval.jsonl.gz \
      --json "$OUT/infl_fp32.json" 2>&1 | $F | tail -9
  exit 0
fi
B="python3 tools/bench.py --target $W/t8b --draft $W/d1b --device cuda --humaneval $ROOT/.stage/HumanEval.jsonl.gz --max-new-tokens 256 --k $K"
echo "== inflated b1 greedy K=$K"; timeout 150 $B --n-prompts $N --json "$OUT/infl_b1.json" 2>&1 | $F | tail -9
echo "== inflated b8 greedy K=$K"; timeout 120 $B --n-prompts 8 --batch 8 --json "$OUT/infl_b8.json" 2>&1 | $F | tail -9
echo "== inflated b1 T=0.7 K=$K"; timeout 150 $B --n-prompts $N --temperature 0.7 --json "$OUT/infl_t07_b1.json" 2>&1 | $F | tail -9
echo "== inflated b8 T=0.7 K=$K"; timeout 120 $B --n-prompts 8 --batch 8 --temperature 0.7 --json "$OUT/infl_t07_b8.json" 2>&1 | $F | tail -9
