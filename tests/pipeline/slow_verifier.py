"""A task whose verifier outlasts any timeout: on every problem in processes started with
JAXRL_TEST_SLOW_VERIFIER set (a verifier that times out on one host and not on another),
and on the problem ids listed in JAXRL_TEST_SLOW_PROBLEMS (comma-separated) elsewhere.

Imported by a gin file (`import tests.pipeline.slow_verifier`); jaxrl_post.register makes the
task the configurable `SlowArithmeticTask`. Its verifier workers import it too (PYTHONPATH
holds the repository).
"""

import dataclasses
import os
import time

import jaxrl_post
from jaxrl_post.rewards import ArithmeticTask


@jaxrl_post.register
@dataclasses.dataclass(frozen=True)
class SlowArithmeticTask(ArithmeticTask):
  def score(self, problem, completion):
    listed = os.environ.get("JAXRL_TEST_SLOW_PROBLEMS", "").split(",")
    if os.environ.get("JAXRL_TEST_SLOW_VERIFIER") or problem.id in listed:
      time.sleep(120)  # Killed at RewardSpec.timeout_s.
    return super().score(problem, completion)
