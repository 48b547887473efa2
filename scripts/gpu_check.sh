#!/usr/bin/env bash
# The GPU check in one command: gpu-marked tests, greedy engine vs the dense decoder on the
# device, and the kernel, rollout, sync, step (tiny and 1B shapes), scale and generation
# benchmarks. Every result lands in one dated JSON file (default
# docs/results/gpu_check_YYYY-MM-DD.json; or the path in GPU_CHECK_OUT), with the device, date
# and versions; a failing part is recorded with its output tail and the others still run.
#
# Uses .venv/bin/python when it exists, else PYTHON (default python3) with this checkout
# on PYTHONPATH: a GPU host with jax[cuda] and the project's requirements needs no setup.
# BUDGET_S (default: none) bounds the whole check: each part gets at most what is left of it
# (and at most PART_TIMEOUT_S), a part with under 20 s left is recorded as skipped, and the
# JSON is still written: time on a GPU host is often short.
# QUICK=1 runs the parts that fit in about 6 minutes of device time (BUDGET_S 360 unless
# given): decode % of the HBM roofline at 64 and 256 slots (1B and SmolLM2 shapes, with a
# per-kernel profile), the kernels' % of HBM peak, an RL-sized 1B GRPO step's MFU by phase
# (32,768 train tokens) with plan's prediction of that same step on this GPU beside it,
# phase by phase (step_1b's `plan`), the Tinker service's forward_backward tokens/s with 4
# concurrent adapters against 4 in turn (SmolLM2-135M), and, if time is left, 1B decode
# at 256 slots with cascade attention (32 prompts x 8 samples).
# Usage: bash scripts/gpu_check.sh            PARTS="tests greedy kernels" bash scripts/gpu_check.sh
#        QUICK=1 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=${PYTHON:-python3}; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_FILE=${GPU_CHECK_OUT:-docs/results/gpu_check_$(date +%F).json}
if [[ -n "${QUICK:-}" ]]; then
  PARTS=${PARTS:-"decode kernels step_1b serve decode_cascade"}; BUDGET=${BUDGET_S:-360}
  SLOTS=${DECODE_SLOTS:-64,256}
else
  SLOTS=${DECODE_SLOTS:-64,256,512}
  PARTS=${PARTS:-"tests greedy decode decode_cascade kernels rollout sync step step_1b step_1b_8x8 serve scale generate plan plan_1b"}
  BUDGET=${BUDGET_S:-0}
fi
LIMIT=${PART_TIMEOUT_S:-900}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

part() {  # part NAME CMD...: runs CMD, keeps its last stdout line (the JSON) and its log.
  local name=$1; shift
  [[ " $PARTS " == *" $name "* ]] || return 0
  local limit=$LIMIT
  if (( BUDGET > 0 )); then
    local left=$((BUDGET - SECONDS))
    if (( left < 20 )); then echo "== $name: skipped, ${left} s of the budget left" >&2
      echo "out of budget" >"$WORK/$name.skipped"; return 0; fi
    (( left < limit )) && limit=$left
  fi
  echo "== $name (at most $limit s): $*" >&2
  local start=$SECONDS
  timeout "$limit" "$@" >"$WORK/$name.out" 2>"$WORK/$name.log"
  echo $? >"$WORK/$name.rc"
  echo $((SECONDS - start)) >"$WORK/$name.s"
  echo "   rc=$(cat "$WORK/$name.rc") in $(cat "$WORK/$name.s") s" >&2
}

# Only the files that hold gpu-marked tests: collecting the whole suite imports its test-only
# dependencies, which a GPU host need not have.
part tests "$PY" -m pytest -q -m gpu $(grep -rl --include='test_*.py' "mark.gpu" tests) \
  -p no:cacheprovider --junitxml="$WORK/junit.xml"
part greedy "$PY" scripts/check_greedy.py --json ${GREEDY_ARGS:-}
# Decode at RL batch sizes: % of the HBM roofline at 64, 256 and (not QUICK) 512 slots for
# the 1B and SmolLM2 shapes (bf16, random weights), each with a per-kernel profile of one
# decode call.
part decode "$PY" scripts/bench_rollout.py --decode-only --slots "$SLOTS" \
  --models llama3.2-1b,smollm2-135m --profile --json
part kernels "$PY" scripts/bench_kernels.py --json
part rollout "$PY" scripts/bench_rollout.py --json
part sync "$PY" scripts/bench_sync.py --json
part step "$PY" scripts/bench_step.py --json
# Llama-3.2-1B's shapes in bfloat16, an RL-sized step: 16 prompts x 16 samples of 64 + 64
# tokens, so the one minibatch trains on 32,768 tokens, with the activations' matmul
# outputs saved and the rest recomputed (remat "dots": no matmul runs twice, so the MFU
# counts no recomputation; the plan compiled for an H100 puts it at 57 GB, and at 0.45 s of
# train against 0.62 s saving everything in 4 micro-batches), its 128-token rows through
# the Triton attention kernels. The step's MFU by phase against the device's peak, and the
# planner's prediction of the same step beside it.
part step_1b "$PY" scripts/bench_step.py --json --model llama-1b --batch 16x16 \
  --prompt-tokens 64 --new-tokens 64 --remat dots --plan
# The 1B step of the first GPU runs (8 x 8 of 32 + 64 tokens), for comparison with them.
part step_1b_8x8 "$PY" scripts/bench_step.py --json --model llama-1b --plan
# The Tinker service on this GPU: one adapter and four, concurrent against in turn.
part serve "$PY" scripts/bench_serve.py --shapes smollm2-135m --adapters 1,4 --steps 3 \
  --repeats 2 --tokens 128
# 1B decode at 256 slots as a GRPO rollout decodes it: 32 prompts of 8 samples, cascade
# attention reading each prompt's KV once a step (after the parts above: in QUICK it runs
# if time is left).
part decode_cascade "$PY" scripts/bench_rollout.py --decode-only --slots 256 \
  --models llama3.2-1b --group-slots 8 --profile --json
part scale "$PY" scripts/bench_scale.py --json
part generate "$PY" scripts/bench_generate.py --json ${GENERATE_ARGS:-}
# The planner's predicted step on this GPU for the shipped configs (docs/BENCHMARKS.md
# "Planning"): the quickstart, and the 1B GSM8K config from its published config.json.
part plan "$PY" -m jaxrl_post.plan --gin_file=configs/quickstart.gin --json
part plan_1b "$PY" -m jaxrl_post.plan --gin_file=configs/tpu/llama3.2-1b_gsm8k_v5e-8.gin \
  --gin_param='rollout_mesh/MeshConfig.data = -1' --json

"$PY" - "$WORK" "$OUT_FILE" "$PARTS" <<'PYEOF'
import datetime, json, os, sys
import xml.etree.ElementTree as ET
work, out_file, parts = sys.argv[1], sys.argv[2], sys.argv[3].split()
report = {"date": datetime.date.today().isoformat(), "parts": {}}
try:
  import jax
  report.update(jax=jax.__version__, backend=jax.default_backend(),
                device=jax.devices()[0].device_kind, device_count=jax.device_count())
except Exception as e:  # The report still says what ran.
  report["jax_error"] = repr(e)
for name in parts:
  if os.path.exists(os.path.join(work, name + ".skipped")):
    report["parts"][name] = {"skipped": "out of BUDGET_S"}
  if not os.path.exists(os.path.join(work, name + ".rc")):
    continue
  read = lambda ext: open(os.path.join(work, name + ext)).read()
  entry = {"rc": int(read(".rc")), "seconds": int(read(".s"))}
  lines = [l for l in read(".out").splitlines() if l.strip()]
  try:
    entry["result"] = json.loads(lines[-1])
  except (IndexError, json.JSONDecodeError):
    entry["output_tail"] = "\n".join(lines[-20:])
  if entry["rc"] != 0:
    entry["log_tail"] = read(".log")[-4000:]
  if name == "tests" and os.path.exists(os.path.join(work, "junit.xml")):
    suite = ET.parse(os.path.join(work, "junit.xml")).getroot().iter("testsuite")
    s = next(suite)
    entry["result"] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    entry["failed"] = [c.get("classname") + "::" + c.get("name") for c in s.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
  report["parts"][name] = entry
os.makedirs(os.path.dirname(out_file) or ".", exist_ok=True)
with open(out_file, "w") as f:
  json.dump(report, f, indent=1)
failed = [n for n, e in report["parts"].items() if e.get("rc", 0) != 0]
skipped = [n for n, e in report["parts"].items() if "skipped" in e]
print(f"wrote {out_file}; failed parts: {', '.join(failed) or 'none'}"
      + (f"; skipped (out of BUDGET_S): {', '.join(skipped)}" if skipped else ""))
sys.exit(1 if failed else 0)
PYEOF
