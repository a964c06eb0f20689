#!/usr/bin/env bash
# The SmolLM2 GGUF on a device machine, staged in three parts: a call carries the working tree
# and one part, under the call's 64 MiB (the tree holds the shipped drafts, ~25 MB).
#
#   here: split -n 3 -d -a 2 SmolLM2-135M-Instruct.Q4_1.gguf .stage/smol.part.
#         sha256sum SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1 > .stage/smol.sha256
#
# Every call runs it: the parts it carries go to /tmp (they stay on the machine between
# calls); the call that also carries .stage/smol.sha256 (with the last part) assembles
# /tmp/SmolLM2-135M-Instruct.Q4_1.gguf and checks it (exit 3 when it does not match).
set -u
cd "$(dirname "$0")/.."
cp .stage/smol.part.* /tmp/ 2>/dev/null || true
[ -f .stage/smol.sha256 ] || exit 0
G=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/smol.part.* > "$G"
echo "$(cat .stage/smol.sha256)  $G" | sha256sum -c - > /dev/null || {
  echo "stage_gguf: $G does not match .stage/smol.sha256 (a part missing?)"; exit 3; }
echo "stage_gguf: $G assembled and checked"
