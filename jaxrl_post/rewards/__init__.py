"""Tasks with verifiable rewards, and the verifier pools that score completions for them.

A leaf package: it must not import jax, because verifiers run in worker processes that never
touch an accelerator (and on CPU worker threads).
"""

from jaxrl_post.rewards.arithmetic import ArithmeticTask
from jaxrl_post.rewards.base import Problem, Task
from jaxrl_post.rewards.compose import (ComponentScorer, ComposedTask, FormatReward,
                                        LengthPenalty, RewardComponent, reward_metrics,
                                        score_with_parts)
from jaxrl_post.rewards.countdown import CountdownTask
from jaxrl_post.rewards.dispatch import ScoreStats, score_batch
from jaxrl_post.rewards.humaneval import HumanEvalTask
from jaxrl_post.rewards.math_data import JsonlTask
from jaxrl_post.rewards.pool import VerifierPool, VerifierStats, default_workers

# Name -> task class, for configs that pick a task by string.
TASKS: dict[str, type] = {
    ArithmeticTask.name: ArithmeticTask,
    CountdownTask.name: CountdownTask,
    HumanEvalTask.name: HumanEvalTask,
    JsonlTask.name: JsonlTask,
}

__all__ = ["ArithmeticTask", "ComponentScorer", "ComposedTask", "CountdownTask", "FormatReward",
           "HumanEvalTask", "JsonlTask", "LengthPenalty", "Problem", "RewardComponent",
           "ScoreStats", "TASKS", "Task", "VerifierPool", "VerifierStats", "default_workers",
           "reward_metrics", "score_batch", "score_with_parts"]
