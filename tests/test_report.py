"""jaxrl_post.report: one self-contained HTML file from a run's workdir."""

import json
import re

import pytest

from jaxrl_post import report
from jaxrl_post.errors import UserError
from tests.report_fixture import write_run


def _plots(data):
  return {p["id"]: p for p in data["plots"]}


def test_every_plot_has_data_and_the_page_fetches_nothing(tmp_path):
  write_run(tmp_path, steps=40, spike_at=20)
  data = report.collect(str(tmp_path))
  plots = _plots(data)
  assert list(plots) == ["reward", "kl", "entropy", "clip", "roles", "ratio", "tokens", "mfu",
                         "memory", "alarms"]
  for pid in ("reward", "kl", "entropy", "clip", "tokens", "mfu", "memory"):
    assert plots[pid]["series"] and all(s["points"] for s in plots[pid]["series"]), pid
  assert [s["name"] for s in plots["reward"]["series"]] == ["training reward (mean)",
                                                           "held-out accuracy"]
  assert len(plots["roles"]["stack"]["steps"]) == 40
  assert plots["roles"]["labels"] == ["rollout", "reward", "advantage", "pack", "train", "sync",
                                      "waiting"]
  assert plots["ratio"]["hist"]["bars"][0]["values"][8] == 40 * 40.0
  alarms = {a["name"]: a["episodes"] for a in plots["alarms"]["timeline"]["alarms"]}
  assert alarms["step_time"] == [[20, 21]] and alarms["kl_spike"] == []
  assert data["fired"] == [{"step": 20, "alarm": "step_time"}]

  out = tmp_path / "out" / "r.html"
  assert report.main([str(tmp_path), "--out", str(out)]) == 0
  page = out.read_text()
  # Self-contained: no external script, style, image or font, nothing fetched.
  assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
  assert "<script src" not in page and "@import" not in page
  assert "&lt;b&gt;not markup&lt;/b&gt;" in page  # The config is shown as text.
  payload = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page,
                      re.S).group(1)
  assert json.loads(payload.replace("<\\/", "</"))["steps_done"] == 40


def test_a_run_in_progress_with_a_torn_last_line(tmp_path):
  write_run(tmp_path, steps=12, total=300, torn=True)
  data = report.collect(str(tmp_path))
  assert data["in_progress"] and data["steps_done"] == 12 and data["steps_total"] == 300
  assert "step 12 of 300, in progress" in report.render(data)


def test_thousands_of_steps_are_bucketed_not_dropped(tmp_path):
  write_run(tmp_path, steps=5000, spike_at=3333, eval_every=50)
  plots = _plots(report.collect(str(tmp_path)))
  roles = plots["roles"]["stack"]
  assert len(roles["steps"]) == report.MAX_POINTS and roles["of"] == 5000
  # The stack's bucket means keep every step's time: the spike's 2 x 50 s are in there.
  assert abs(sum(sum(v) for v in roles["values"].values()) * 5 -
             sum(sum(v) for v in report.bucket_means(
                 report.read_metrics(str(tmp_path / "metrics.jsonl")),
                 list(roles["values"]), max_points=10 ** 9)["values"].values())) < 1e-6 * 5e5
  tokens = plots["tokens"]["series"][0]
  assert tokens["of"] == 5000 and len(tokens["points"]) <= report.MAX_POINTS
  # Min and max per bucket: the first and last steps' extremes are drawn.
  values = [v for _, v in tokens["points"]]
  assert min(values) == 1001.0 and max(values) == 6000.0
  alarms = {a["name"]: a["episodes"] for a in plots["alarms"]["timeline"]["alarms"]}
  assert alarms["step_time"] == [[3333, 3334]]


def test_downsample_keeps_each_buckets_extremes_in_step_order():
  points = [[s, float((s * 7919) % 101)] for s in range(1, 10001)]
  points[4321][1] = 1e9
  out = report.downsample(points, max_points=100)
  assert out["of"] == 10000 and len(out["points"]) <= 100
  assert [1e9] == [v for _, v in out["points"] if v > 1000]
  steps = [s for s, _ in out["points"]]
  assert steps == sorted(steps)


def test_not_a_workdir_is_a_one_line_error(tmp_path, capsys):
  with pytest.raises(UserError, match="no metrics.jsonl"):
    report.collect(str(tmp_path))
  assert report.main([str(tmp_path)]) == 2
  assert capsys.readouterr().err.startswith("error: ")
