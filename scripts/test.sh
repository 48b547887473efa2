#!/usr/bin/env bash
# Runs the test suite on the CPU (8 fake devices); sets up .venv first if needed.
# Usage: bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"
