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
#           (wheels, the extension built in place; GPU_TESTS=1: the GPU test suite)
#   call 2: PART=2 ...   carry .snap .stage/smol3.part.01
#   call 3: PART=3 ...   carry .snap .stage/smol3.part.02 .stage/smol.sha256 .stage/HumanEval.jsonl.gz
#           (the one-prompt CLI cold and warm, 40 prompts with the batch tool, the server cold and
#           warm: ready, first request, 40 in a row, SIGTERM with 4 streams; bench SD b = 1)
#           knobs: PROBE=0 (skip dev/warm_probe.py), SERVE_ENV="VAR=VALUE ..." (the server's
#           environment), B8_MODES="..." (a bench at b = 8 too), CLI_ONLY=1 (the CLI pair and
#           the bench only), B1_MODES="..." (the b = 1 bench's modes)
# (SD against AR by prompt length: dev/gpu_lengths.sh, once the GGUF is in /tmp)
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
  [ -z "${GPU_TESTS:-}" ] && exit 0
  timeout "${GPU_TESTS_TIMEOUT:-420}" python3 -m pytest tests -m gpu -q -p no:cacheprovider ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tail -15 | tee "$OUT/pytest_gpu.log"
  exit 0
fi
if [ "$PART" = 2 ]; then
  cp "$STAGE/smol3.part.01" /tmp/
  [ -z "${GPU_TESTS:-}" ] && exit 0
  SSDLIB_SKIP_EXT=1 timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/pytest_gpu_noext.log"
  exit 0
fi
cat /tmp/smol3.part.00 /tmp/smol3.part.01 "$STAGE/smol3.part.02" > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat "$STAGE/smol.sha256")  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
LOG=$OUT/startup.log
run() {  # name, cache dir (cold: empty, triton's cache in it too), command...: wall and key lines
  local name=$1 cache=$2; shift 2
  local t0=$(python3 -c 'import time;print(time.time())')
  SSDLIB_CACHE_DIR=$cache TRITON_CACHE_DIR=$cache/triton "$@" > /tmp/$name.log 2>&1; local rc=$?
  local wall=$(python3 -c "import time;print(round(time.time()-$t0,1))")
  { echo "== $name rc=$rc wall_s=$wall"; grep -E "loaded in|warm-up|ready_s|decode_tok_s|captured|tok_s" /tmp/$name.log | tail -5; } | tee -a "$LOG"
}
PROMPT="Write a Python function that checks whether a number is prime."
run cli_cold /tmp/cache_cli python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128
run cli_warm /tmp/cache_cli python3 -m ssdlib.generate --mode sd --chat --prompt "$PROMPT" --max-new-tokens 128
if [ "${CLI_ONLY:-0}" != 1 ]; then
# 40 chat prompts: the held-out chat set (24) and 16 HumanEval tasks as chat messages
python3 - "$STAGE/HumanEval.jsonl.gz" > /tmp/prompts40.jsonl <<'EOF2'
import gzip, json, sys
rows = [json.loads(l) for l in open("tools/distill/heldout_chat.jsonl") if l.strip()]
he = [json.loads(l) for l in gzip.open(sys.argv[1], "rt")][:40 - len(rows)]
rows += [{"messages": [{"role": "user", "content": "Complete this Python function:\n" + t["prompt"]}]} for t in he]
for i, r in enumerate(rows):
    print(json.dumps({"id": i, "messages": r["messages"], "max_new_tokens": 256}))
EOF2
run batch40_cold /tmp/cache_batch python3 tools/batch_generate.py --input /tmp/prompts40.jsonl --output /tmp/out40.jsonl --mode sd --max-batch 8 --summary-json "$OUT/batch40.json"
# the server's engine (work unknown: compiles), its first requests, and where its start goes
# (PROBE=0 skips this pair)
if [ "${PROBE:-1}" = 1 ]; then
run probe_cold /tmp/cache_probe python3 dev/warm_probe.py --mode sd --max-batch 8 --runs 3 --json "$OUT/warm_probe_cold.json"
run probe_warm /tmp/cache_probe python3 dev/warm_probe.py --mode sd --max-batch 8 --runs 2 --profile-start 45
grep -A60 "Ordered by" /tmp/probe_warm.log | head -62 >> "$LOG"
python3 -c "import json;r=json.load(open('$OUT/warm_probe_cold.json'));print('probe cold', {k:r[k] for k in ('start_s','load_s','warm_up_s','warm_up_captures')}); [print(' run',x) for x in r['runs']]" | tee -a "$LOG"
fi
# SERVE_ENV="NAME=VALUE ...": the server runs with these set (e.g. SSDLIB_COMPILE_DYNAMIC=1)
echo "== serve with: ${SERVE_ENV:-defaults}" | tee -a "$LOG"
for w in cold warm; do
  env ${SERVE_ENV:-} SSDLIB_CACHE_DIR=/tmp/cache_serve TRITON_CACHE_DIR=/tmp/cache_serve/triton python3 dev/startup_probe.py --json "$OUT/serve_$w.json" --log /tmp/serve_$w.log -- --mode sd --max-batch 8 > /dev/null 2>&1
  { echo "== serve $w"; python3 -c "import json;r=json.load(open('$OUT/serve_$w.json'));print({k:r.get(k) for k in ('ready_s','first_request','sequential','first_over_p50','first_prompt_again_s','first_over_again')});print({k:v for k,v in r['sigterm'].items() if k!='streams'});print([(s.get('done'),s.get('finish_reason'),s.get('error')) for s in r['sigterm']['streams']])"; grep -E "loaded in|warm-up|captured" /tmp/serve_$w.log; } | tee -a "$LOG"
done
fi  # CLI_ONLY
B1_MODES=${B1_MODES:-ar,sd,ssd:placement=stream}
echo "== bench b=1 (16 HumanEval chat prompts): $B1_MODES" | tee -a "$LOG"
timeout ${B1_TIMEOUT:-240} python3 tools/bench.py --device cuda --humaneval "$STAGE/HumanEval.jsonl.gz" --max-new-tokens 256 --k 3 --n-prompts 16 --modes "$B1_MODES" --json "$OUT/bench_b1.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -30 | tee -a "$LOG"
# B8_MODES: a bench at b = 8 too (e.g. "ar,ar:env=SSDLIB_COMPILE_DYNAMIC=1,sd,sd:env=SSDLIB_COMPILE_DYNAMIC=1")
if [ -n "${B8_MODES:-}" ]; then
  echo "== bench b=8 (16 HumanEval chat prompts): $B8_MODES" | tee -a "$LOG"
  timeout 240 python3 tools/bench.py --device cuda --humaneval "$STAGE/HumanEval.jsonl.gz" --max-new-tokens 256 --k 3 --n-prompts 16 --batch 8 --modes "$B8_MODES" --json "$OUT/bench_b8.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -20 | tee -a "$LOG"
fi
