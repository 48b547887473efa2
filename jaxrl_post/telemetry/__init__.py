"""Training telemetry: per-role step timers, metrics files and a progress display.

A leaf package: it imports neither jax nor other jaxrl_post modules (besides `errors`), so
it can be used from tools that only read a run's output.
"""

from jaxrl_post.telemetry.progress import ProgressBar
from jaxrl_post.telemetry.timers import StepTimer
from jaxrl_post.telemetry.writers import (DiscardMetrics, MetricsWriter, read_metrics,
                                          truncate_jsonl)

__all__ = ["DiscardMetrics", "MetricsWriter", "ProgressBar", "StepTimer", "read_metrics",
           "truncate_jsonl"]
