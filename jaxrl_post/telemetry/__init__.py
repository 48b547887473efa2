"""Training telemetry: per-role step timers, metrics files and a progress display; the role
timeline (trace), the profiler window, device memory and peak rates (resources, peaks),
alarms, and the report's plotting script (report.js).

A leaf package: it imports no other jaxrl_post modules (besides `errors`), and jax only
inside the functions that need a device (resources, profile) and in `dispatch`, so it can be
used from tools that only read a run's output (python -m jaxrl_post.report).
"""

from jaxrl_post.telemetry.progress import ProgressBar
from jaxrl_post.telemetry.timers import StepTimer
from jaxrl_post.telemetry.writers import (DiscardMetrics, MetricsWriter, read_metrics,
                                          truncate_jsonl)

__all__ = ["DiscardMetrics", "MetricsWriter", "ProgressBar", "StepTimer", "read_metrics",
           "truncate_jsonl"]
