#!/usr/bin/env bash
# SSD on one GPU: the speculator on its own CUDA stream in the leader's process (stream placement).
#   launch/ssd_1gpu.sh --chat --prompt "Hello"
exec python -m ssdlib.generate --mode ssd --speculator-placement stream --device cuda \
    --target "${TARGET:-smollm2-135m}" "$@"
