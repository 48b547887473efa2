#!/usr/bin/env bash
# Runs the test suite on the CPU (8 fake devices); sets up .venv first if needed.
# Usage: bash scripts/test.sh [pytest args...]     e.g. bash scripts/test.sh -m "not slow"
# By default the `sweep` cases (more parametrizations of what the run already covers) are
# left out; `bash scripts/test.sh -m sweep` runs them (a later -m replaces the default).
# Tests run in JAXRL_TEST_WORKERS processes (default: the cores, at least 2 and at most 4;
# 0 runs them in this one). Much of a test is single-threaded compilation and subprocesses
# starting, which a second process overlaps even on two cores (a third, measured, did not
# shorten the run, and each test's time counts against its file's budget). A test still running after
# JAXRL_TEST_TIMEOUT seconds (default 900) fails with its stacks, so a hang costs minutes.
# A test file whose tests together take longer than tests/suite_health.FILE_BUDGET_S fails
# the run (unless its long tests say why with slow(reason=...)); the suite's wall time and
# its 25 slowest tests are printed at the end. Files whose module fixture is a whole run
# carry an xdist_group mark, so one worker builds it (--dist loadgroup) instead of each.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The report's browser test (-m browser) opens it in Debian's chromium: installed here where
# it can be (root with apt-get), quietly; elsewhere that test is skipped and says why.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
    >/dev/null 2>&1 || echo "test: chromium not installed; the browser test will be skipped" >&2
fi
# The suite's processes cache the bytecode of what they import (the test extras, which
# setup.sh leaves uncompiled; the checkout's modules): where PYTHONDONTWRITEBYTECODE is set,
# each of the hundreds of processes the suite starts (training runs, verifier workers) would
# otherwise parse them from source (0.2 s a process for the training command's imports).
unset PYTHONDONTWRITEBYTECODE
cores=$(nproc 2>/dev/null || echo 2)
workers=${JAXRL_TEST_WORKERS:-$(( cores < 2 ? 2 : (cores > 4 ? 4 : cores) ))}
start=$(date +%s)
rc=0
.venv/bin/python -m pytest -q -n "$workers" --dist loadgroup --durations=25 \
  --timeout="${JAXRL_TEST_TIMEOUT:-900}" \
  -m "not sweep" "$@" || rc=$?
echo "test: the suite took $(( $(date +%s) - start )) s of wall time on $workers workers"
exit "$rc"
