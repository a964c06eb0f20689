#!/usr/bin/env bash
# One GPU measurement pass (used with the device tool; works on any CUDA machine):
#   reassemble the staged SmolLM2 GGUF (two parts + sha256) if given, install, run the GPU tests,
#   then AR / SD / SSD with the default pair: fp32 greedy equality, bf16 speed at b = 1 and 8,
#   greedy and T = 0.7. Results land in $OUT (default ./gpu-out) as JSON + logs.
# Usage: STAGE=.stage TP=1 bash tools/gpu_run.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; STAGE=${STAGE:-.stage}; TP=${TP:-1}; N=${N_PROMPTS:-8}
mkdir -p "$OUT"
if [ -f "$STAGE/smol.part.00" ]; then
  cat "$STAGE"/smol.part.0* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat "$STAGE/smol.sha256")  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
  export SSDLIB_MODEL_DIRS=/tmp
fi
if ! python3 -c "import gguf" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 -m pip install -v --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
python3 -m ssdlib.ops.check_ext 2>&1 | tee "$OUT/ext.log"  # ssdlib._C: imported? WITH_CUDA? GraphPool? else why
python3 -m pytest tests/ops tests/models -q 2>&1 | tail -3 | tee "$OUT/pytest.log"
HE=${HUMANEVAL:-$STAGE/HumanEval.jsonl.gz}
B="python3 tools/bench.py --device cuda --tp $TP --modes ar,sd,ssd --n-prompts $N --humaneval $HE"
$B --dtype float32 --max-new-tokens 128 --json "$OUT/fp32_greedy_b1.json" 2>&1 | grep -v "^\[rank" | tail -4
$B --max-new-tokens 256 --json "$OUT/bf16_greedy_b1.json" 2>&1 | grep -v "^\[rank" | tail -4
$B --max-new-tokens 256 --temperature 0.7 --json "$OUT/bf16_t07_b1.json" 2>&1 | grep -v "^\[rank" | tail -4
$B --max-new-tokens 256 --batch 8 --json "$OUT/bf16_greedy_b8.json" 2>&1 | grep -v "^\[rank" | tail -4
