#!/usr/bin/env bash
# Multi-node example: run on every node with the same MASTER_ADDR/PORT; NNODES nodes of
# NPROC ranks each; the world size must equal tp (+1 for a speculator rank in mode ssd; tp alone
# puts the speculator on its own stream on rank 0's GPU).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 NPROC=4 launch/multinode.sh --mode ar --tp 8 ...
set -euo pipefail
exec torchrun --nnodes "${NNODES:?}" --node_rank "${NODE_RANK:?}" --nproc_per_node "${NPROC:?}" \
    --rdzv_backend c10d --rdzv_endpoint "${MASTER_ADDR:?}:${MASTER_PORT:-29500}" \
    -m ssdlib.generate --device cuda "$@"
