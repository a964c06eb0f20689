#!/usr/bin/env bash
# A short check of engine changes on a fresh GPU machine (torch's CUDA graphs, or csrc's pool
# with EXT=1), in two calls like dev/gpu_run.sh:
#   call 1: PART=1 bash dev/gpu_quick.sh  carry .stage/smol.part.00 .whl        (GPU step tests)
#   call 1b: bash dev/stage_gguf.sh       carry .stage/smol.part.01             (the GGUF's parts:
#           dev/stage_gguf.sh says how they are made)
#   call 2: PART=2 bash dev/gpu_quick.sh  carry .stage/smol.part.02 .stage/HumanEval.jsonl.gz
#           .stage/smol.sha256 [.snap]      (the benches named in BENCHES on the SmolLM2 pair)
#   later:  PART=3 (the GGUF is already in /tmp): BENCHES only.
# BENCHES: space-separated presets, default "b1": b1 (b = 1, K = 3, AR / SD / SSD), b8 (b = 8,
# 16 prompts), t07 (b = 1, T = 0.7), compile (b = 1 with --no-compile), fp32 (greedy equality),
# b1var (b = 1: AR, SD, SSD and SSD variants: fan-out budget 32, K = 4), b1h (b = 1 with
# SSDLIB_HOST_TIMES=1), b1fan (SD, SSD, SSD with a
# fan-out budget of 32, SSD at K = 4), tp2 (AR and SD at
# TP 2, b = 1), tp2fp32 (TP 2 fp32 greedy tokens == TP 1's; after fp32),
# prof / prof8 / prof07 (SSDLIB_PROFILE: the leader's timed call and a window of the
# speculator's rounds; AR + SSD at b = 1 into $OUT/p1, SSD at b = 8 into $OUT/p8, SSD at
# T = 0.7 into $OUT/p07; read them with dev/trace_report.py).
# cmp / cmp07: b = 1 greedy / T = 0.7, each mode with (the default) and without
# torch.compile inside the captured steps (MODE:compile=0), in one invocation; cmp1: AR and SD
# only (one GPU is enough).
# qab07: T = 0.7, b = 1, SD and SSD with the speculator on a rank of its own without and with
# SSDLIB_Q_AFTER_BUILD=1 (q sent after the cache build's launch; the stream placement has no
# such send, so the experiment acts in the rank placement only), in one invocation.
# cands / cands07: b = 1 greedy / T = 0.7, AR, SD, SSD and SD, SSD with each draft in CANDS
# (directories; default: the candidates gpu_draft.sh packed on this machine) in one invocation.
# steps: dev/step_times.py (each hot-path step's GPU time eager / one graph; the builds' and
# the draw's kernels). sd1 / sd07: AR and SD only, b = 1, greedy / T = 0.7 (one GPU is enough);
# sd8: b = 8 AR and SD, compiled and not (one GPU).
# chat1 / chat07: b = 1 greedy / T = 0.7 on the 24 held-out chat prompts
# (tools/distill/heldout_chat.jsonl, never trained on): AR (chat1 only), SD, and SD with each
# draft in CANDS (one GPU; CANDS="$PWD/.stage/cand/v4", carried, compares the previous default).
# chain1 / chain07: b = 1, 16 prompts, AR / SD / SSD greedy / T = 0.7 (the SSD on one GPU
# targets; chain07 adds SSD with greedy-only chains); chain8: b = 8 greedy; chain8x: b = 8, SD,
# SSD, SSD with chains up to 4 rows (larger batches through the host) and with a fan-out budget
# of 8; chain087: b = 8, T = 0.7, SD and SSD; chain074: T = 0.7 at
# b = 4, SD and SSD; chainfp32: fp32 greedy AR, SSD with the stream placement and with the rank one.
# vocab1 / vocab8: b = 1 / b = 8 greedy, SD and SSD with the full vocabulary (the GPU's default)
# and with the draft's 16,384 tokens (--draft-vocab), in one invocation. vocabchat: the same at
# b = 1 on the 24 held-out chat prompts, with the feature draft too. k5warm: K = 5 (the
# default), captured_in_run per mode.
# kinds1: b = 1, SSD with the miss model's two kinds of lookup against every lookup pooled
# (SSDLIB_FANOUT_KINDS=0). budget8: b = 8, AR, SSD, SSD with the throughput budget rule
# (SSDLIB_BUDGET_THROUGHPUT=1) and SSD with pooled lookups, in one invocation.
# feat1: b = 1 on the 24 held-out chat prompts, SD / SSD with both drafts (the feature draft's
# layers compiled too). exact1: fp32 greedy AR / SD / SSD equality (one GPU is enough; SSD then shares it).
# Compiling is per decoder layer: ready s is 11-20 s at b = 1, 26-31 s at b = 8 on an H200.
# DRAFT=path benchmarks another draft. Runs from .snap (a `git archive` of HEAD, see
# gpu_run.sh) when it travels, so that work in progress in the checkout stays out.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"; ROOT=$(pwd); export PYTHONUNBUFFERED=1
# EXT=1 (both calls): build ssdlib._C in call 1 (the README's GPU install) and use it; without
# it SSDLIB_SKIP_EXT=1 and torch's CUDA graphs serve.
if [ "${EXT:-}" = 1 ]; then unset SSDLIB_SKIP_EXT; else export SSDLIB_SKIP_EXT=1; fi
if [ "${PART:-1}" = 1 ]; then
  bash dev/stage_gguf.sh
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  T="tests/engine/runner/test_step_graphs.py tests/distributed/test_spec_cache_protocol.py
     tests/ops/test_prefill_attention_cuda.py tests/distributed/test_tp_cuda.py
     tests/engine/test_round_timer.py"
  if [ "${EXT:-}" = 1 ]; then
    python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
    tail -2 "$OUT/install.log"; PYTHONPATH=$ROOT:/tmp/site python3 -m ssdlib.ops.check_ext 2>&1 | tail -6
    T="$T tests/ops/test_graph_pool.py tests/ops/test_extension_status.py tests/ops/test_tree_mask.py"
  fi
  PYTHONPATH=$ROOT:/tmp/site timeout 240 python3 -m pytest $T -q 2>&1 | tail -5
  # the CUDA cases of the engine's other GPU tests (stream placement, feature draft, warm-up)
  # (the kernels' quick cases first; the warm-up's and the sampled chains' law test, slow, last)
  X="tests/ops/test_row_top.py tests/ops/test_slot_attention.py
     tests/distributed/test_stream_placement.py tests/engine/test_feature_draft_ssd.py
     tests/engine/test_feature_draft_sd.py tests/engine/test_draft_vocab_exact.py
     tests/engine/runner/test_warm_up.py tests/engine/test_chained_sampling.py"
  [ -n "${GPU_TESTS_X:-1}" ] && PYTHONPATH=$ROOT:/tmp/site timeout 300 python3 -m pytest $X -v \
      -k "cuda or gpu or triton" > "$OUT/xtests.log" 2>&1
  grep -c PASSED "$OUT/xtests.log"; grep -E "FAILED|ERROR" "$OUT/xtests.log" | head; tail -1 "$OUT/xtests.log"
  exit 0
fi
if [ "${PART}" = 2 ]; then
  bash dev/stage_gguf.sh || exit 3
fi
SRC=$ROOT
if [ -d .snap ]; then
  cp ssdlib/assets/smollm2-135m-draft/model.safetensors .snap/ssdlib/assets/smollm2-135m-draft/
  [ "${EXT:-}" = 1 ] && cp ssdlib/_C*.so .snap/ssdlib/
  SRC=$ROOT/.snap; export SSDLIB_COMMIT=$(cat .snap/COMMIT)
fi
cd "$SRC"
export SSDLIB_MODEL_DIRS=/tmp PYTHONPATH=$SRC:/tmp/site
B="python3 tools/bench.py --device cuda --humaneval $ROOT/.stage/HumanEval.jsonl.gz --max-new-tokens 256"
[ -n "${DRAFT:-}" ] && B="$B --draft $ROOT/$DRAFT"
F="grep -v ^\[rank\|WARN"
CANDS=${CANDS:-$(ls -d /tmp/distill/packed/*/ 2>/dev/null | sed 's:/$::' | tr '\n' ' ')}
cand_modes() {  # cand_modes MODE...: MODE:draft=DIR for each DIR in CANDS
  local m d out=""; for d in $CANDS; do for m in "$@"; do out="$out,$m:draft=$d"; done; done
  echo "$out"
}
# everything below also goes to $OUT/quick.log as it is printed: a call cut by its time limit
# still brings back the tables of the presets that finished (the run's output tail may not)
exec > >(tee -a "$OUT/quick.log") 2>&1
for b in ${BENCHES:-b1}; do
  echo "== $b"
  case $b in
    b1) timeout 150 $B --n-prompts 4 --k 3 --json "$OUT/b1_k3.json" 2>&1 | $F | tail -14 ;;
    b1h)  # b = 1 greedy with both ranks' host-clock segments (h_*, spec.h_*)
      SSDLIB_HOST_TIMES=1 timeout 200 $B --modes ar,sd,ssd --n-prompts 4 --k 3 --json "$OUT/b1h.json" 2>&1 | $F | tail -16 ;;
    b1fan) timeout 240 $B --modes sd,ssd,ssd:fan_out_budget=32,ssd:k=4 --n-prompts 4 --k 3 --json "$OUT/b1fan.json" 2>&1 | $F | tail -16 ;;
    b1var) timeout 290 $B --modes ar,sd,ssd,ssd:fan_out_budget=32,ssd:k=4 --n-prompts 4 --k 3 --json "$OUT/b1_var.json" 2>&1 | $F | tail -18 ;;
    cmp) timeout 540 $B --modes ar,sd,ssd,ar:compile=0,sd:compile=0,ssd:compile=0 --n-prompts 4 --k 3 --json "$OUT/cmp.json" 2>&1 | $F | tail -24 ;;
    cmp1)  # one GPU: AR and SD with (the default) and without torch.compile of the layers
      timeout 420 $B --modes ar,sd,ar:compile=0,sd:compile=0 --n-prompts 4 --k 3 --json "$OUT/cmp1.json" 2>&1 | $F | tail -16 ;;
    cmp07) timeout 540 $B --modes sd,ssd,sd:compile=0,ssd:compile=0 --n-prompts 4 --k 3 --temperature 0.7 --json "$OUT/cmp07.json" 2>&1 | $F | tail -20 ;;
    qab07) timeout 240 $B --modes sd,ssd:placement=rank,ssd:placement=rank:env=SSDLIB_Q_AFTER_BUILD=1 --n-prompts 4 --k 3 --temperature 0.7 --json "$OUT/qab07.json" 2>&1 | $F | tail -16 ;;
    cands) timeout 420 $B --modes "ar,sd,ssd$(cand_modes sd ssd)" --n-prompts 4 --k 3 --json "$OUT/cands.json" 2>&1 | $F | tail -30 ;;
    cands07) timeout 300 $B --modes "sd,ssd$(cand_modes ssd)" --n-prompts 4 --k 3 --temperature 0.7 --json "$OUT/cands07.json" 2>&1 | $F | tail -24 ;;
    steps)  # each hot-path step's GPU time, eager and as one graph, and the builds' kernels
      timeout 300 python3 dev/step_times.py --profile "build, sampled,draw,speculator round" \
          --json "$OUT/steps.json" 2>&1 | $F | tail -60 ;;
    exact1)  # fp32 greedy AR / SD / SSD token equality on any GPU count (one GPU: SSD's
      # speculator shares it through a gloo link, a correctness run, not SSD's speed)
      timeout 150 $B --modes ar,sd,ssd --n-prompts 2 --max-new-tokens 128 --dtype float32 --k 3 \
          --json "$OUT/exact1.json" 2>&1 | $F | tail -6 ;;
    chain1) timeout 240 $B --modes ar,sd,ssd --n-prompts 16 --k 3 --json "$OUT/chain1.json" 2>&1 | $F | tail -16 ;;
    vocab1) timeout 300 $B --modes ar,sd,sd:draft_vocab=16384,ssd,ssd:draft_vocab=16384 --n-prompts 16 --k 3 --json "$OUT/vocab1.json" 2>&1 | $F | tail -18 ;;
    vocabchat)  # b = 1 greedy, the 24 held-out chat prompts: both drafts, full vocabulary and 16,384
      timeout 560 $B --prompts-file "$SRC/tools/distill/heldout_chat.jsonl" --n-prompts 24 --k 3 \
          --modes "ar,sd,sd:draft_vocab=16384,ssd,ssd:draft_vocab=16384,sd:draft=smollm2-135m-eagle,sd:draft=smollm2-135m-eagle:draft_vocab=16384,ssd:draft=smollm2-135m-eagle:draft_vocab=16384" \
          --json "$OUT/vocabchat.json" 2>&1 | $F | tail -30 ;;
    feat1)  # b = 1 greedy, the 24 held-out chat prompts: SD and SSD with both drafts, and SSD with
      # the feature draft's layers compiled (SSDLIB_FEATURE_COMPILE=1)
      timeout 560 $B --prompts-file "$SRC/tools/distill/heldout_chat.jsonl" --n-prompts 24 --k 3 \
          --modes "ar,sd,ssd,sd:draft=smollm2-135m-eagle,ssd:draft=smollm2-135m-eagle,ssd:draft=smollm2-135m-eagle:env=SSDLIB_FEATURE_COMPILE=1" \
          --json "$OUT/feat1.json" 2>&1 | $F | tail -24 ;;
    k5warm)  # the default K = 5: AR / SD / SSD, nothing captured inside the timed call
      timeout 200 $B --modes ar,sd,ssd --n-prompts 4 --k 5 --json "$OUT/k5warm.json" 2>&1 | $F | tail -14
      python3 -c "import json; print('captured_in_run', {r['mode']: r.get('captured_in_run') for r in json.load(open('$OUT/k5warm.json'))['rows']})" ;;
    vocab8) timeout 300 $B --modes ar,sd,sd:draft_vocab=16384,ssd,ssd:draft_vocab=16384 --n-prompts 16 --batch 8 --k 3 --json "$OUT/vocab8.json" 2>&1 | $F | tail -18 ;;
    chain07) timeout 300 $B --modes ar,sd,ssd,ssd:env=SSDLIB_CHAIN_SAMPLED=0 --n-prompts 16 --k 3 --temperature 0.7 --json "$OUT/chain07.json" 2>&1 | $F | tail -18 ;;
    chain8) timeout 240 $B --modes ar,sd,ssd --n-prompts 16 --batch 8 --k 3 --json "$OUT/chain8.json" 2>&1 | $F | tail -16 ;;
    kinds1) timeout 300 $B --modes sd,ssd,ssd:env=SSDLIB_FANOUT_KINDS=0 --n-prompts 16 --k 3 --json "$OUT/kinds1.json" 2>&1 | $F | tail -16 ;;
    budget8) timeout 300 $B --modes ar,ssd,ssd:env=SSDLIB_BUDGET_THROUGHPUT=1,ssd:env=SSDLIB_FANOUT_KINDS=0 --n-prompts 16 --batch 8 --k 3 --json "$OUT/budget8.json" 2>&1 | $F | tail -18 ;;
    chain8x) timeout 300 $B --modes sd,ssd,ssd:env=SSDLIB_CHAIN_MAX_ROWS=4,ssd:fan_out_budget=8 --n-prompts 16 --batch 8 --k 3 --json "$OUT/chain8x.json" 2>&1 | $F | tail -20 ;;
    chain087) timeout 240 $B --modes sd,ssd --n-prompts 16 --batch 8 --k 3 --temperature 0.7 --json "$OUT/chain087.json" 2>&1 | $F | tail -16 ;;
    chain074) timeout 240 $B --modes sd,ssd --n-prompts 16 --batch 4 --k 3 --temperature 0.7 --json "$OUT/chain074.json" 2>&1 | $F | tail -14 ;;
    chainfp32) timeout 200 $B --modes ar,ssd,ssd:placement=rank --n-prompts 4 --max-new-tokens 128 --dtype float32 --k 3 \
          --json "$OUT/chainfp32.json" 2>&1 | $F | tail -8 ;;
    sd1) timeout 150 $B --modes ar,sd --n-prompts 4 --k 3 --json "$OUT/sd1.json" 2>&1 | $F | tail -10 ;;
    chat1) timeout 240 $B --prompts-file "$SRC/tools/distill/heldout_chat.jsonl" --modes "ar,sd$(cand_modes sd)" --n-prompts 24 --k 3 --json "$OUT/chat1.json" 2>&1 | $F | tail -12 ;;
    chat07) timeout 240 $B --prompts-file "$SRC/tools/distill/heldout_chat.jsonl" --modes "sd$(cand_modes sd)" --n-prompts 24 --k 3 --temperature 0.7 --json "$OUT/chat07.json" 2>&1 | $F | tail -12 ;;
    sd07) timeout 150 $B --modes ar,sd --n-prompts 4 --k 3 --temperature 0.7 --json "$OUT/sd07.json" 2>&1 | $F | tail -10 ;;
    b8) timeout 150 $B --n-prompts 16 --batch 8 --k 3 --json "$OUT/b8_k3.json" 2>&1 | $F | tail -14 ;;
    sd8)  # one GPU: b = 8 AR and SD, compiled (the default) and not
      timeout 300 $B --modes ar,sd,ar:compile=0,sd:compile=0 --n-prompts 16 --batch 8 --k 3 --json "$OUT/sd8.json" 2>&1 | $F | tail -14 ;;
    t07) timeout 150 $B --n-prompts 4 --k 3 --temperature 0.7 --json "$OUT/t07_k3.json" 2>&1 | $F | tail -14 ;;
    compile) timeout 290 $B --no-compile --n-prompts 4 --k 3 --json "$OUT/b1_compile.json" 2>&1 | $F | tail -14 ;;
    prof) SSDLIB_PROFILE=$OUT/p1 timeout 150 $B --modes ar,ssd --n-prompts 4 --k 3 2>&1 | $F | tail -8 ;;
    prof8) SSDLIB_PROFILE=$OUT/p8 timeout 150 $B --modes ssd --n-prompts 16 --batch 8 --k 3 2>&1 | $F | tail -8 ;;
    prof07) SSDLIB_PROFILE=$OUT/p07 timeout 150 $B --modes ssd --n-prompts 4 --k 3 --temperature 0.7 2>&1 | $F | tail -8 ;;
    fp32) timeout 100 $B --n-prompts 2 --max-new-tokens 128 --dtype float32 --k 3 --json-token-ids --json "$OUT/fp32.json" 2>&1 | $F | tail -6 ;;
    tp2) timeout 150 $B --tp 2 --modes ar,sd --n-prompts 4 --k 3 --json "$OUT/tp2.json" 2>&1 | $F | tail -10 ;;
    tp2fp32)  # TP 2's fp32 greedy tokens against TP 1's (run fp32 first)
      timeout 100 $B --tp 2 --modes ar,sd --n-prompts 2 --max-new-tokens 128 --dtype float32 --k 3 \
          --json-token-ids --json "$OUT/tp2_fp32.json" 2>&1 | $F | tail -5
      python3 -c "import json,sys; r=lambda p: {x['mode']: x['token_ids'] for x in json.load(open(p))['rows']}
a, b = r('$OUT/fp32.json'), r('$OUT/tp2_fp32.json'); print('TP2 fp32 == TP1 AR:', {m: t == a['ar'] for m, t in b.items()})" ;;
    *) echo "unknown preset $b" ;;
  esac
done
