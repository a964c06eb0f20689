#!/usr/bin/env bash
# One GPU measurement pass (any CUDA machine), in parts so that each part's carried files (the
# working tree plus one third of the SmolLM2 GGUF) stay under 64 MiB:
#
#   here:   the GGUF's parts and .stage/smol.sha256 (dev/stage_gguf.sh says how);
#           cp HumanEval.jsonl.gz floor_probe.py .stage/
#           rm -rf .snap && mkdir .snap && git archive HEAD ssdlib tools dev | tar -x -C .snap \
#               --exclude='ssdlib/assets/smollm2-135m-draft/model.safetensors'
#           git rev-parse HEAD > .snap/COMMIT   (the benches' JSON names it: SSDLIB_COMMIT)
#   call 1: PART=1 bash dev/gpu_run.sh   carry .stage/smol.part.00 .whl
#           (from a clean checkout: install, GPU tests; FLOOR=1 adds the floor probe)
#   call 1b: bash dev/stage_gguf.sh     carry .stage/smol.part.01
#   call 2: PART=2 bash dev/gpu_run.sh   carry .stage/smol.part.02 .stage/smol.sha256
#           .stage/HumanEval.jsonl.gz .snap
#           (the benchmarks; the GGUF stays in /tmp between parts)
#   call 3: PART=3 bash dev/gpu_run.sh   carry .stage/HumanEval.jsonl.gz .snap (--no-compile runs)
#
# The benchmarks run from .snap (a clean `git archive` of HEAD): other work in progress in the
# checkout cannot leak into the numbers. Results land in $OUT as JSON + logs.
set -uo pipefail
OUT=${OUT:-gpu-out}; STAGE=${STAGE:-.stage}; PART=${PART:-1}; N=${N_PROMPTS:-4}
ROOT=$(pwd)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$PART" = 1 ]; then
  bash dev/stage_gguf.sh  # the part it carries stays on the machine for part 2
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  # `python3 -m pip`: the image's bare `pip` belongs to another Python than the one with torch
  python3 -m pip install -v --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
  python3 -m ssdlib.ops.check_ext 2>&1 | tee "$OUT/ext.log"
  # the checkout itself (call 1 goes out from a clean tree: it is HEAD)
  PYTHONPATH=/tmp/site python3 -m pytest tests/ops tests/engine/runner/test_step_graphs.py \
      tests/engine/runner/test_tree_decode_reference.py -q 2>&1 | tail -5 | tee "$OUT/pytest.log"
  [ -n "${FLOOR:-}" ] && python3 "$STAGE/floor_probe.py" 2>&1 | tee "$OUT/floor.log"
  exit 0
fi
if [ "$PART" = 2 ]; then
  bash dev/stage_gguf.sh || exit 3
fi
# .snap travels anew with every call: the draft's weights (left out of the archive) and the
# extension built in call 1 (an ignored build output stays between calls) go into it again
cp ssdlib/assets/smollm2-135m-draft/model.safetensors .snap/ssdlib/assets/smollm2-135m-draft/
cp ssdlib/_C*.so .snap/ssdlib/
cd .snap
export SSDLIB_MODEL_DIRS=/tmp PYTHONPATH=$ROOT/.snap:/tmp/site
[ -f COMMIT ] && export SSDLIB_COMMIT=$(cat COMMIT)
B="python3 tools/bench.py --device cuda --humaneval $ROOT/$STAGE/HumanEval.jsonl.gz --max-new-tokens 256"
F="grep -v ^\[rank\|WARN"
if [ "$PART" = 2 ]; then
  echo "== b1 greedy K=3"; timeout 120 $B --n-prompts $N --k 3 --json "$OUT/b1_k3.json" 2>&1 | $F | tail -12
  echo "== b1 greedy K=5"; timeout 100 $B --n-prompts $N --k 5 --json "$OUT/b1_k5.json" 2>&1 | $F | tail -12
  echo "== b8 greedy K=3"; timeout 120 $B --n-prompts $((4 * N)) --batch 8 --k 3 --json "$OUT/b8_k3.json" 2>&1 | $F | tail -12
  echo "== b1 T=0.7 K=3"; timeout 120 $B --n-prompts $N --k 3 --temperature 0.7 --json "$OUT/t07_k3.json" 2>&1 | $F | tail -12
  echo "== host profile of AR"; timeout 60 python3 dev/profile_ar.py --top 45 > "$OUT/profile_ar.log" 2>&1; head -3 "$OUT/profile_ar.log"
  echo "== fp32 greedy equality"; timeout 100 $B --n-prompts 2 --max-new-tokens 128 --dtype float32 --k 3 --json "$OUT/fp32.json" 2>&1 | $F | tail -5
  exit 0
fi
# PART=3: without torch.compile inside the graphs (compiled is the default)
echo "== b1 greedy K=3 --no-compile"; timeout 290 $B --no-compile --n-prompts $N --k 3 --json "$OUT/b1_compile.json" 2>&1 | $F | tail -12
echo "== fp32 --no-compile greedy equality"; timeout 100 $B --no-compile --n-prompts 2 --max-new-tokens 64 --dtype float32 --k 3 --modes ar,sd --json "$OUT/fp32_compile.json" 2>&1 | $F | tail -5
