"""One self-contained HTML report of a run: `python -m jaxrl_post.report WORKDIR [--out FILE]`.

The file needs no server and no network: the plotting script (telemetry/report.js, a few
hundred lines of SVG drawing) and the data are inlined. It reads `metrics.jsonl` (a run in
progress too: a torn last line is skipped), `config.gin` / `config.json` and, where
present, `trace.json`, and shows: reward and held-out curves (pass@k and maj@k where logged); KL,
entropy and clip fraction; per-role seconds per step, stacked; the importance-ratio
histogram; tokens per second and MFU; memory per role; the alarms that fired, on the
timeline; the run's config.

Long runs are downsampled, never cut: a curve of more than `MAX_POINTS` steps is split
into equal buckets of steps, each drawn by its minimum and maximum (so a spike stays
visible), and the stacked role times by their bucket means (so the stack still adds up to
the mean step time). Every step is in some bucket.

Default output: `<workdir>/report.html`. The training command writes it at the end of a run.
"""

from __future__ import annotations

import argparse
import datetime
import html
import json
import math
import os
import sys
from typing import Any, Iterable, Optional, Sequence

from jaxrl_post.errors import UserError
from jaxrl_post.telemetry.alarms import ALARMS
from jaxrl_post.telemetry.writers import METRICS_FILE, read_metrics

REPORT_FILE = "report.html"
MAX_POINTS = 1000  # Per curve; longer curves are bucketed by min and max.
# The ratio histogram's bins (rl/trainer.py: 17 bins of 1/16 from 15/32, outer bins open).
RATIO_HIST = {"lo": 15 / 32, "hi": 49 / 32, "bins": 17}
ROLE_ORDER = ("rollout", "reward", "advantage", "pack", "train", "sync", "waiting")
_SCRIPT = os.path.join(os.path.dirname(__file__), "telemetry", "report.js")


# --------------------------------------------------------------------------- data


def _number(value: Any) -> Optional[float]:
  """A plottable float (non-finite strings and non-numbers: None)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  value = float(value)
  return value if math.isfinite(value) else None


def series(records: Sequence[dict], name: str) -> list[list[float]]:
  """[[step, value], ...] of one metric, over the lines that have a finite value."""
  out = []
  for r in records:
    v = _number(r.get(name))
    if v is not None:
      out.append([r["step"], v])
  return out


def downsample(points: list[list[float]], max_points: int = MAX_POINTS) -> dict:
  """{"points": ..., "of": n}: at most `max_points` points; over that, each bucket of steps
  as its minimum and maximum, in step order (so nothing is dropped unseen)."""
  n = len(points)
  if n <= max_points:
    return {"points": points, "of": n}
  buckets = max_points // 2
  out = []
  for b in range(buckets):
    chunk = points[b * n // buckets:(b + 1) * n // buckets]
    if not chunk:
      continue
    lo = min(chunk, key=lambda p: p[1])
    hi = max(chunk, key=lambda p: p[1])
    out.extend(sorted([lo, hi], key=lambda p: p[0]) if lo is not hi else [lo])
  return {"points": out, "of": n}


def bucket_means(records: Sequence[dict], names: Sequence[str],
                 max_points: int = MAX_POINTS) -> dict:
  """{"steps": [...], "values": {name: [...]}, "of": n}: per step (or per bucket of steps,
  its mean step and mean values) for the lines that have the first name; missing values
  count as 0."""
  rows = [r for r in records if _number(r.get(names[0])) is not None] if names else []
  n = len(rows)
  buckets = min(n, max_points)
  steps, values = [], {name: [] for name in names}
  for b in range(buckets):
    chunk = rows[b * n // buckets:(b + 1) * n // buckets]
    steps.append(sum(r["step"] for r in chunk) / len(chunk))
    for name in names:
      values[name].append(sum(_number(r.get(name)) or 0.0 for r in chunk) / len(chunk))
  return {"steps": steps, "values": values, "of": n}


def _names(records: Sequence[dict], prefix: str = "", suffix: str = "",
           contains: str = "") -> list[str]:
  found = dict.fromkeys(k for r in records for k in r
                        if k.startswith(prefix) and k.endswith(suffix) and contains in k)
  return sorted(found)


def _lines(records, names: Iterable[str], labels: Optional[dict] = None) -> list[dict]:
  out = []
  for name in names:
    s = downsample(series(records, name))
    if s["points"]:
      out.append({"name": (labels or {}).get(name, name), **s})
  return out


def _clip_fraction(records) -> list[dict]:
  total = [{"step": r["step"], "clip": (_number(r.get("train/clip_frac_low")) or 0.0)
            + (_number(r.get("train/clip_frac_high")) or 0.0)}
           for r in records if "train/clip_frac_low" in r or "train/clip_frac_high" in r]
  s = downsample(series(total, "clip"))
  return [{"name": "clip fraction (low + high)", **s}] if s["points"] else []


def ratio_histogram(records: Sequence[dict]) -> dict:
  """The importance-ratio histogram summed over the run, and the last step's."""
  hists = [(r["step"], r["train/ratio/hist"]) for r in records
           if isinstance(r.get("train/ratio/hist"), list)]
  if not hists:
    return {"bars": [], **RATIO_HIST}
  bins = len(hists[-1][1])
  total = [0.0] * bins
  for _, h in hists:
    for i, v in enumerate(h[:bins]):
      total[i] += _number(v) or 0.0
  return {"bars": [{"name": f"all {len(hists)} steps", "values": total},
                   {"name": f"step {hists[-1][0]}", "values": hists[-1][1]}],
          "lo": RATIO_HIST["lo"], "hi": RATIO_HIST["hi"], "bins": bins}


def alarm_timeline(records: Sequence[dict]) -> dict:
  """Per alarm: its episodes [[first step, last step], ...]; and the steps judged."""
  names = list(ALARMS) + [n[len("alarm/"):] for n in _names(records, "alarm/")
                          if n[len("alarm/"):] not in ALARMS]
  judged = [r["step"] for r in records if any(k.startswith("alarm/") for k in r)]
  rows = []
  for name in names:
    episodes, start, last = [], None, None
    for r in records:
      on = _number(r.get(f"alarm/{name}"))
      if on is None:
        continue
      if on and start is None:
        start = r["step"]
      if not on and start is not None:
        episodes.append([start, last])
        start = None
      last = r["step"]
    if start is not None:
      episodes.append([start, last])
    rows.append({"name": name, "episodes": episodes})
  return {"alarms": rows, "steps": [judged[0], judged[-1]] if judged else [],
          "judged": len(judged)}


def _memory(records) -> list[dict]:
  names = _names(records, "memory/", "_bytes")
  names = [n for n in names if n != "memory/bytes_limit"]
  return _lines(records, names, {n: n[len("memory/"):] for n in names})


def _plots(records: Sequence[dict]) -> list[dict]:
  roles = [n for n in _names(records, "time/") if n != "time/step"]
  roles.sort(key=lambda n: (ROLE_ORDER.index(n[5:]) if n[5:] in ROLE_ORDER else 99, n))
  eval_names = (["eval/accuracy"] + _names(records, "eval/", contains="pass@")
                + _names(records, "eval/", contains="maj@"))
  kl = [n for n in ("train/kl/reference", "train/kl/behaviour") if any(n in r for r in records)]
  mfu = _names(records, "perf/train_mfu") + _names(records, "perf/decode_hbm_util")
  return [
      {"id": "reward", "title": "Reward and held-out accuracy", "kind": "lines", "y": "",
       "alarms": ["reward_vs_heldout", "verifier_failures"],
       "series": _lines(records, ["reward/mean"] + eval_names,
                        {"reward/mean": "training reward (mean)",
                         "eval/accuracy": "held-out accuracy"})},
      {"id": "kl", "title": "KL", "kind": "lines", "series": _lines(records, kl),
       "alarms": ["kl_spike", "logprob_mismatch"]},
      {"id": "entropy", "title": "Entropy (nats per token)", "kind": "lines",
       "series": _lines(records, ["train/entropy"])},
      {"id": "clip", "title": "Clip fraction", "kind": "lines",
       "series": _clip_fraction(records), "alarms": ["clip_fraction"]},
      {"id": "roles", "title": "Seconds per step, by role", "kind": "stacked",
       "alarms": ["step_time"],
       "stack": bucket_means(records, roles), "labels": [n[5:] for n in roles]},
      {"id": "ratio", "title": "Importance ratio (token counts)", "kind": "bars",
       "hist": ratio_histogram(records)},
      {"id": "tokens", "title": "Tokens per second", "kind": "lines",
       "series": _lines(records, ["rollout/tokens_per_s", "train/tokens_per_s"],
                        {"rollout/tokens_per_s": "rollout (completion tokens)",
                         "train/tokens_per_s": "training (prompt + completion)"})},
      {"id": "mfu", "title": "MFU and decode bandwidth utilisation", "kind": "lines",
       "series": _lines(records, mfu, {n: n[len("perf/"):] for n in mfu})},
      {"id": "memory", "title": "Device memory per role (bytes per device)", "kind": "lines",
       "bytes": True, "series": _memory(records)},
      {"id": "alarms", "title": "Alarms", "kind": "alarms", "timeline": alarm_timeline(records)},
  ]


def _read_text(path: str) -> Optional[str]:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except OSError:
    return None


def _trace_summary(workdir: str) -> Optional[dict]:
  path = os.path.join(workdir, "trace.json")
  if not os.path.exists(path):
    return None
  from jaxrl_post.telemetry.trace import read_trace

  events = read_trace(path)
  return {"events": len(events), "path": path}


def collect(workdir: str) -> dict:
  """Everything the page shows, as plain JSON-able data."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    raise UserError(f"{workdir}: no {METRICS_FILE} (is it a run's workdir?)")
  records = [r for r in read_metrics(path) if isinstance(r.get("step"), int)]
  config = _read_text(os.path.join(workdir, "config.json"))
  total = None
  if config:
    try:
      total = json.loads(config).get("steps")
    except ValueError:
      pass
  last = records[-1]["step"] if records else 0
  fired = [{"step": r["step"], "alarm": n[len("alarm/"):]} for r, prev in
           zip(records, [{}] + records[:-1]) for n in _names([r], "alarm/")
           if _number(r.get(n)) and not _number(prev.get(n))]
  return {"workdir": os.path.abspath(workdir), "steps_done": last, "steps_total": total,
          "in_progress": total is not None and last < total, "lines": len(records),
          "written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "plots": _plots(records), "fired": fired,
          "config_gin": _read_text(os.path.join(workdir, "config.gin")) or "",
          "config_json": config or "", "trace": _trace_summary(workdir),
          "profile": os.path.isdir(os.path.join(workdir, "profile"))}


# --------------------------------------------------------------------------- page


def render(data: dict) -> str:
  """The HTML page: data and script inline, nothing fetched."""
  with open(_SCRIPT, encoding="utf-8") as f:
    script = f.read()
  payload = json.dumps(data, separators=(",", ":"), allow_nan=False)
  payload = payload.replace("</", "<\\/").replace("<!--", "<\\!--")
  title = f"jaxrl_post run report: {os.path.basename(data['workdir'])}"
  status = (f"step {data['steps_done']} of {data['steps_total']}, in progress"
            if data["in_progress"] else f"{data['steps_done']} steps")
  extras = []
  if data["trace"]:
    extras.append(f"role timeline: <code>{html.escape(data['trace']['path'])}</code> "
                  f"({data['trace']['events']} events; open it at ui.perfetto.dev)")
  if data["profile"]:
    extras.append(f"profiler capture: <code>{html.escape(os.path.join(data['workdir'], 'profile'))}"
                  f"</code>")
  plots = "\n".join(
      f'<section class="card" id="card-{p["id"]}"><h2>{html.escape(p["title"])}</h2>'
      f'<div class="plot" id="plot-{p["id"]}" data-plot="{p["id"]}" data-points="0"></div>'
      f'</section>' for p in data["plots"])
  return _PAGE.format(
      title=html.escape(title), workdir=html.escape(data["workdir"]), status=status,
      written=data["written"], lines=data["lines"],
      extras="".join(f"<li>{e}</li>" for e in extras), plots=plots,
      config_gin=html.escape(data["config_gin"]) or "(no config.gin)",
      config_json=html.escape(data["config_json"]) or "(no config.json)",
      payload=payload, script=script)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }}
header {{ padding: 14px 22px; background: #1d2330; color: #fff; }}
header h1 {{ font-size: 18px; margin: 0 0 4px; }}
header p, header ul {{ margin: 2px 0; color: #c9d1e0; font-size: 13px; }}
header code {{ color: #fff; }}
main {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr));
        gap: 14px; padding: 14px 22px; }}
.card {{ background: #fff; border: 1px solid #dde2ea; border-radius: 6px; padding: 8px 12px; }}
.card h2 {{ font-size: 14px; margin: 2px 0 6px; }}
.plot svg {{ width: 100%; height: auto; display: block; }}
.plot .note {{ color: #6b7484; font-size: 12px; margin-top: 2px; }}
.legend {{ font-size: 12px; margin-top: 4px; }}
.legend span {{ margin-right: 12px; white-space: nowrap; }}
.legend i {{ display: inline-block; width: 10px; height: 10px; margin-right: 4px;
             border-radius: 2px; vertical-align: -1px; }}
.wide {{ grid-column: 1 / -1; }}
pre {{ background: #f0f2f5; padding: 8px; overflow: auto; max-height: 420px; font-size: 12px; }}
details summary {{ cursor: pointer; font-weight: 600; }}
table.fired {{ border-collapse: collapse; font-size: 12px; margin-top: 6px; display: block;
               max-height: 220px; overflow: auto; }}
table.fired td, table.fired th {{ border-bottom: 1px solid #e4e7ec; padding: 2px 8px;
                                   text-align: left; }}
.tip {{ position: fixed; pointer-events: none; background: #1d2330; color: #fff;
        padding: 4px 7px; border-radius: 4px; font-size: 12px; display: none; z-index: 9; }}
</style></head>
<body>
<header><h1>{title}</h1>
<p><code>{workdir}</code> &middot; {status} &middot; {lines} metric lines &middot;
written {written}</p><ul>{extras}</ul></header>
<main>
{plots}
<section class="card wide" id="card-config"><h2>Config</h2>
<details open><summary>config.gin (the bindings as parsed)</summary><pre>{config_gin}</pre>
</details>
<details><summary>config.json (every resolved field)</summary><pre>{config_json}</pre>
</details></section>
</main>
<div class="tip" id="tip"></div>
<script type="application/json" id="report-data">{payload}</script>
<script>
{script}
</script>
</body></html>
"""


def write(workdir: str, out: Optional[str] = None) -> str:
  """Writes the report (atomically: a reader never sees half a page); returns its path."""
  out = out or os.path.join(workdir, REPORT_FILE)
  page = render(collect(workdir))
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  tmp = out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(page)
  os.replace(tmp, out)
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.report",
                              description="Write one self-contained HTML report of a run.")
  p.add_argument("workdir", help="the run's directory (with metrics.jsonl)")
  p.add_argument("--out", default=None, help=f"output file (default: WORKDIR/{REPORT_FILE})")
  args = p.parse_args(argv)
  try:
    path = write(args.workdir, args.out)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
