"""A synthetic run workdir for the report's tests: every metric the report plots, written
the way the training loop writes it, without running anything."""

import json
import math
import os

ROLES = ("rollout", "reward", "advantage", "pack", "train", "sync", "waiting")


def write_run(workdir, steps: int = 40, total: int | None = None, spike_at: int | None = None,
              eval_every: int = 10, torn: bool = False) -> None:
  """metrics.jsonl (and config files) of a run `steps` steps in (`total` configured)."""
  os.makedirs(workdir, exist_ok=True)
  lines = [{"step": 0, "eval/accuracy": 0.2}]
  for s in range(1, steps + 1):
    roles = {f"time/{r}": 0.1 * (i + 1) * (1 + 0.1 * math.sin(s)) for i, r in enumerate(ROLES)}
    m = {"step": s, **roles, "time/step": sum(roles.values()),
         "reward/mean": 0.3 + 0.4 * s / steps, "train/kl/reference": 0.001 * (1 + s % 3),
         "train/kl/behaviour": 1e-6, "train/entropy": 2.0 - s / steps,
         "train/clip_frac_low": 0.01, "train/clip_frac_high": 0.02,
         "train/ratio/hist": [0.0] * 7 + [5.0, 40.0, 6.0] + [0.0] * 7,
         "rollout/tokens_per_s": 1000.0 + s, "train/tokens_per_s": 3000.0 + s,
         "perf/train_mfu_vs_cpu_measured_matmul": 0.2, "perf/decode_hbm_util_vs_cpu_measured_copy": 0.3,
         "memory/train_program/peak_bytes": 5e7, "memory/train/peak_bytes": 4e7 + s,
         "memory/rollout/peak_bytes": 3e7}
    for name in ("step_time", "clip_fraction", "logprob_mismatch", "kl_spike",
                 "reward_vs_heldout", "verifier_failures"):
      m[f"alarm/{name}"] = 0.0
    if spike_at is not None and s in (spike_at, spike_at + 1):
      m["time/train"] = 50.0
      m["time/step"] += 50.0
      m["alarm/step_time"] = 1.0
    if s % eval_every == 0:
      m["eval/accuracy"] = 0.2 + 0.3 * s / steps
    lines.append(m)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(m) + "\n" for m in lines)
    if torn:
      f.write('{"step": %d, "reward/me' % (steps + 1))  # Being written right now.
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump({"__class__": "Experiment", "steps": total or steps, "seed": 0}, f)
  with open(os.path.join(workdir, "config.gin"), "w") as f:
    f.write("Experiment.steps = %d\nRolloutSpec.group_size = 8  # <b>not markup</b>\n"
            % (total or steps))
