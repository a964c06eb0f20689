#!/usr/bin/env bash
# TP 4 verifier (GPUs 0-3) + speculator (GPU 4). Extra arguments pass through, e.g.
#   launch/ssd_5gpu.sh --draft DRAFT --chat --prompt "Hello"
set -euo pipefail
exec torchrun --standalone --nproc_per_node 5 -m ssdlib.generate \
    --mode ssd --tp 4 --device cuda --target "${TARGET:-smollm2-135m}" "$@"
