#!/usr/bin/env bash
# The main job: the quickstart RL run. A tiny character-level transformer gets a short
# supervised warm-up on two-digit addition, then GRPO; prints held-out accuracy at the
# start and the end (about 6 minutes on 2 quiet CPU cores). Sets up .venv first if needed.
# Rerunning resumes from the last checkpoint in the workdir (runs/quickstart).
# Extra arguments go to python -m jaxrl_post.train, e.g. --workdir=DIR or
# --gin_param='Experiment.steps = 20'.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m jaxrl_post.train --gin_file=configs/quickstart.gin \
  --workdir=runs/quickstart "$@"
