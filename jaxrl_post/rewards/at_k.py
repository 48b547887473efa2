"""pass@k and maj@k of n sampled completions per problem.

pass@k is the chance that at least one of k samples solves the problem, estimated without
bias from n >= k samples of which c solve it: 1 - C(n - c, k) / C(n, k) (the estimator of
the HumanEval paper), averaged over problems. maj@k takes the answer most of the first k
samples commit to (ties: the one seen first) and counts the problem solved if that answer
is right; it needs the task to say what a completion's final answer is (`final_answer`).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem: n samples, c of them correct, k <= n."""
  if not 0 < k <= n or not 0 <= c <= n:
    raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_solves(answers: Sequence[Optional[str]], solved: Sequence[bool]) -> bool:
  """Whether the most common answer among `answers` (None: no answer, never counted) is
  one that solved the problem."""
  counts = Counter(a for a in answers if a is not None)
  if not counts:
    return False
  top = max(counts.values())
  winner = next(a for a in answers if a is not None and counts[a] == top)
  return any(s for a, s in zip(answers, solved) if a == winner)


def final_answer(task, completion: str) -> Optional[str]:
  """The answer `completion` commits to, as a string equal answers share; None where it
  gives none or the task (or the task a ComposedTask shapes) cannot say."""
  inner = getattr(task, "task", None)
  method = getattr(task, "final_answer", None) or getattr(inner, "final_answer", None)
  return None if method is None else method(completion)


def ks_for(n: int) -> list[int]:
  """The k reported for n samples: powers of two below n, and n."""
  out, k = [], 1
  while k < n:
    out.append(k)
    k *= 2
  return out + [n]


def metrics(solved: np.ndarray, answers: Sequence[Sequence[Optional[str]]]) -> dict[str, float]:
  """eval/pass@k for every k of ks_for(n), and eval/maj@k where any answer is known.

  solved [problems, n] bool; answers [problems][n] each sample's final answer (None: none).
  """
  n = solved.shape[1]
  out: dict[str, float] = {"eval/k_samples": n}
  for k in ks_for(n):
    out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, int(row.sum()), k) for row in solved]))
  if any(a is not None for row in answers for a in row):  # The task says what answers are.
    for k in ks_for(n):
      out[f"eval/maj@{k}"] = float(np.mean([majority_solves(row[:k], list(s[:k]))
                                            for row, s in zip(answers, solved)]))
  return out
