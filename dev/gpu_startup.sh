#!/usr/bin/env bash
# Start-up as a user meets it on a GPU machine (cold and warm), in parts whose carried files (the
# working tree plus one third of the SmolLM2 GGUF) stay small:
#
#   here:   split -n 3 -d SmolLM2-135M-Instruct.Q4_1.gguf .stage/smol3.part.   (+ smol.sha256)
#           rm -rf .snap && mkdir .snap && git archive HEAD ssdlib tools dev tests setup.py csrc \
#               pyproject.toml | tar -x -C .snap \
#               --exclude='ssdlib/assets/smollm2-135m-draft/model.safetensors'
#           git rev-parse --short HEAD > .snap/COMMIT
#   call 1: PART=1 bash .snap/dev/gpu_startup.sh   carry .whl .snap .stage/smol3.part.00
#           (wheels, the extension built in place, the GPU test suite)
#   call 2: PART=2 ...   carry .snap .stage/smol3.part.01
#   call 3: PART=3 ...   carry .snap .stage/smol3.part.02 .stage/smol.sha256 .stage/HumanEval.jsonl.gz
#           (the one-prompt CLI cold and warm, 40 prompts with the batch tool, the server cold and
#           warm: ready, first request, 40 in a row, SIGTERM with 4 streams; bench SD b = 1)
# Every measurement starts from an empty cache directory unless it says warm.
set -uo pipefail
OUT=${OUT:-gpu-out}; PART=${PART:-1}
ROOT=$(pwd); SNAP=$ROOT/.snap; STAGE=$ROOT/.stage
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
cp "$ROOT/ssdlib/assets/smollm2-135m-draft/model.safetensors" "$SNAP/ssdlib/assets/smollm2-135m-draft/"
if [ "$PART" = 1 ]; then
  cp "$STAGE/smol3.part.00" /tmp/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl
  # the extension, built in place in the checkout (an ignored output: it stays between calls)
  ( cd "$ROOT" && python3 setup.py build_ext --inplace > "$OUT/build_ext.log" 2>&1 ); tail -3 "$OUT/build_ext.log"
fi
cp "$ROOT"/ssdlib/_C*.so "$SNAP/ssdlib/" 2>/dev/null || echo "no ssdlib._C built"
cd "$SNAP"
export PYTHONPATH=$SNAP:/tmp/site SSDLIB_MODEL_DIRS=/tmp SSDLIB_COMMIT=$(cat COMMIT)
python3 -m ssdlib.ops.check_ext 2>&1 | tail -2
if [ "$PART" = 1 ]; then
  timeout 420 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
  exit 0
fi
if [ "$PART" = 2 ]; then
  cp "$STAGE/smol3.part.01" /tmp/
  SSDLIB_SKIP_EXT=1 timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest_gpu_noext.log"
  exit 0
fi
cat /tmp/smol3.part.00 /tmp/smol3.part.01 "$STAGE/smol3.part.02" > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat "$STAGE/smol.sha256")  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
run() {  # name, cache dir, command...: wall time and the last lines
  local name=$1 cache=$2; shift 2
  local t0=$(date +%s.%N)
  SSDLIB_CACHE_DIR=$cache "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc wall_s=$(echo "$(date +%s.%N) - $t0" | bc)"
  grep -E "ready|tok/s|decode_tok_s|captured|compile" "$OUT/$name.log" | tail -4
}
PROMPT="Write a Python function that checks whether a number is prime."
run cli_cold /tmp/cache_cli timeout 120 python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128
run cli_warm /tmp/cache_cli timeout 120 python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128
run cli_warm_compile_on /tmp/cache_cli2 timeout 120 python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128 --compile on
run cli_warm_compile_on2 /tmp/cache_cli2 timeout 120 python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128 --compile on
# 40 chat prompts: the held-out chat set (24) and 16 HumanEval tasks as chat messages
python3 - "$STAGE/HumanEval.jsonl.gz" > /tmp/prompts40.jsonl <<'EOF'
import gzip, json, sys
rows = [json.loads(l) for l in open("tools/distill/heldout_chat.jsonl") if l.strip()]
he = [json.loads(l) for l in gzip.open(sys.argv[1], "rt")][:40 - len(rows)]
rows += [{"messages": [{"role": "user", "content": "Complete this Python function:\n" + t["prompt"]}]} for t in he]
for i, r in enumerate(rows):
    print(json.dumps({"id": i, "messages": r["messages"], "max_new_tokens": 256}))
EOF
run batch40_cold /tmp/cache_batch timeout 200 python3 tools/batch_generate.py --input /tmp/prompts40.jsonl --output /tmp/out40.jsonl --mode sd --max-batch 8 --summary-json "$OUT/batch40.json"
rm -f /tmp/out40.jsonl
SSDLIB_CACHE_DIR=/tmp/cache_serve python3 dev/startup_probe.py --json "$OUT/serve_cold.json" --log "$OUT/serve_cold.log" -- --mode sd --max-batch 8 > /dev/null 2>&1
echo "== serve cold"; python3 -c "import json;r=json.load(open('$OUT/serve_cold.json'));print({k:r.get(k) for k in ('ready_s','first_request','sequential','first_over_p50')});print({k:v for k,v in r['sigterm'].items() if k!='streams'});print([ (s.get('done'),s.get('finish_reason'),s.get('error')) for s in r['sigterm']['streams']])"
SSDLIB_CACHE_DIR=/tmp/cache_serve python3 dev/startup_probe.py --json "$OUT/serve_warm.json" --log "$OUT/serve_warm.log" -- --mode sd --max-batch 8 > /dev/null 2>&1
echo "== serve warm"; python3 -c "import json;r=json.load(open('$OUT/serve_warm.json'));print({k:r.get(k) for k in ('ready_s','first_request','sequential','first_over_p50')});print({k:v for k,v in r['sigterm'].items() if k!='streams'})"
echo "== bench SD b=1 (the CLI's reference)"
timeout 150 python3 tools/bench.py --device cuda --humaneval "$STAGE/HumanEval.jsonl.gz" --max-new-tokens 256 --k 3 --n-prompts 8 --modes sd --json "$OUT/bench_sd.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -8
