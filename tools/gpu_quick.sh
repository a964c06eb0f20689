#!/usr/bin/env bash
# A short check of one engine change on a fresh GPU machine, without building the extension
# (torch's CUDA graphs serve instead of csrc's pool), in two calls like tools/gpu_run.sh:
#   call 1: PART=1 bash tools/gpu_quick.sh  carry .stage/smol.part.00 .whl        (GPU step tests)
#   call 2: PART=2 bash tools/gpu_quick.sh  carry .stage/smol.part.01 .stage/HumanEval.jsonl.gz .stage/smol.sha256
#           (b = 1, K = 3: AR / SD / SSD on the SmolLM2 pair)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd):/tmp/site
if [ "${PART:-1}" = 1 ]; then
  cp .stage/smol.part.00 /tmp/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  SSDLIB_SKIP_EXT=1 timeout 200 python3 -m pytest tests/engine/test_step_graphs.py -q 2>&1 | tail -4
  exit 0
fi
cat /tmp/smol.part.00 .stage/smol.part.01 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .stage/smol.sha256)  /tmp/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c - || exit 3
SSDLIB_MODEL_DIRS=/tmp timeout 150 python3 tools/bench.py --device cuda --humaneval .stage/HumanEval.jsonl.gz \
  --max-new-tokens 256 --n-prompts 4 --k 3 --json "$OUT/b1_k3.json" 2>&1 | grep -v "^\[rank\|WARN" | tail -9
