#!/usr/bin/env bash
# OpenAI-compatible HTTP server (needs: pip install -e ".[serve]"); engine flags as ssdlib.generate.
# Example: launch/serve.sh --mode sd --port 8000 [--api-key KEY] [--host 0.0.0.0]
set -euo pipefail
exec python -m ssdlib.serve "$@"
