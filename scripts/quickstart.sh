#!/usr/bin/env bash
# The main job on the embedded default model: chat with SmolLM2-135M-Instruct.
# Sets up .venv first if needed. Extra arguments go to python -m jaxrl_post.generate.
# Usage: bash scripts/quickstart.sh [--prompt TEXT] [--temperature T] [--json] ...
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
has_prompt=0
for a in "${args[@]}"; do [ "$a" = "--prompt" ] && has_prompt=1; done
[ "$has_prompt" = 1 ] || args+=(--prompt "What is the capital of France? Answer in one sentence.")
exec .venv/bin/python -m jaxrl_post.generate --model smollm2-135m-instruct --chat \
  --max-new-tokens 64 "${args[@]}"
