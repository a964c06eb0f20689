#!/usr/bin/env bash
# Interactive chat (streams answers; --metrics prints tok/s, acceptance, hit rate per answer).
set -euo pipefail
exec python -m ssdlib.chat "$@"
