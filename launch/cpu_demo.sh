#!/usr/bin/env bash
# CPU demo (gloo): the embedded default model, greedy AR; pass --mode sd/ssd --draft ... to compare.
set -euo pipefail
exec python -m ssdlib.generate --device cpu --chat \
    --prompt "${PROMPT:-Write a Python function that reverses a string.}" --max-new-tokens 64 "$@"
