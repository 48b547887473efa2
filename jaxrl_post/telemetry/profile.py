"""What a run records about itself beyond its metrics: the role timeline and a profiler window.

`ProfileSpec.steps = (10, 12)` captures steps 10, 11 and 12 (both ends included) with
jax.profiler into `<workdir>/profile/` (TensorBoard's profile plugin, XProf or Perfetto read
it: `plugins/profile/<date>/*.xplane.pb` and `*.trace.json.gz`). Leave it empty to capture
nothing: a capture slows the steps it covers.

jax is imported when a capture starts, so the module stays a leaf that tools reading a
run's files can import without it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

from jaxrl_post.errors import UserError

PROFILE_DIR = "profile"


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
  """Attributes:
    steps: (first, last) RL steps to capture with jax.profiler, both included; () for none.
    trace: write the role timeline, `<workdir>/trace.json` (Chrome / Perfetto).
    trace_calls: also put the rollout engine's prefill and decode calls, evaluation and
      checkpoint saves on it (a few slices per call; off keeps long runs' files small).
    memory_poll_s: how often device memory is read while a role runs, for its peak
      (only on backends that report memory; 0 reads it at role ends only).
  """

  steps: tuple = ()
  trace: bool = True
  trace_calls: bool = True
  memory_poll_s: float = 0.005

  def __post_init__(self):
    steps = tuple(self.steps)
    if steps and (len(steps) != 2 or not all(_integer(s) for s in steps)
                  or not 1 <= steps[0] <= steps[1]):
      raise UserError(f"profile spec: steps must be () or (first, last) with "
                      f"1 <= first <= last, got {self.steps!r}")
    object.__setattr__(self, "steps", steps)
    for name in ("trace", "trace_calls"):
      if not isinstance(getattr(self, name), bool):
        raise UserError(f"profile spec: {name} must be True or False, "
                        f"got {getattr(self, name)!r}")
    if not isinstance(self.memory_poll_s, (int, float)) or not 0 <= self.memory_poll_s < 10:
      raise UserError(f"profile spec: memory_poll_s must be a number in [0, 10), "
                      f"got {self.memory_poll_s!r}")


class ProfileWindow:
  """Starts jax.profiler before the window's first step and stops it after its last."""

  def __init__(self, spec: ProfileSpec, workdir: str, log: Callable[[str], None] = print):
    self.spec, self.log = spec, log
    self.directory = os.path.join(os.fspath(workdir), PROFILE_DIR)
    self._on = False

  def before(self, step: int) -> None:
    if self.spec.steps and step == self.spec.steps[0] and not self._on:
      import jax

      os.makedirs(self.directory, exist_ok=True)
      jax.profiler.start_trace(self.directory)
      self._on = True

  def after(self, step: int) -> Optional[str]:
    """Stops the capture after the window's last step; the message it logged, if any."""
    if self._on and step >= self.spec.steps[1]:
      self.close()
      message = (f"profile of steps {self.spec.steps[0]}-{self.spec.steps[1]} in "
                 f"{self.directory}")
      self.log(message)
      return message
    return None

  def close(self) -> None:
    if self._on:
      import jax

      self._on = False
      jax.profiler.stop_trace()


def _integer(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)
