#!/usr/bin/env bash
# Batch offline generation: launch/batch.sh --input in.jsonl --output out.jsonl [flags]
set -euo pipefail
exec python "$(dirname "$0")/../tools/batch_generate.py" "$@"
