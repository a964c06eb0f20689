#!/usr/bin/env bash
# TP 1 verifier (GPU 0) + speculator (GPU 1). Extra arguments pass through.
set -euo pipefail
exec torchrun --standalone --nproc_per_node 2 -m ssdlib.generate \
    --mode ssd --tp 1 --device cuda --target "${TARGET:-smollm2-135m}" "$@"
