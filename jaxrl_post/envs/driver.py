"""The multi-turn rollout driver: many episodes at once on one engine and scheduler.

Every episode starts as one of the K samples of its problem's prompt (prefilled once, its
pages shared). When a model turn ends, the scheduler keeps the sample's pages (a `Held`
sequence) and the environment answers the decoded reply; the observation's ids are
appended to the history and the next turn is queued with `Scheduler.resume`, which
prefills only the turn's last token and the observation after the pages already held.
Episodes end when the environment says so, after max_turns, or when the next turn would
pass max_tokens (every token after the prompt: the model's and the observations').

Environment steps run in killable worker processes (a rewards.VerifierPool of their own)
while the engine goes on decoding the other episodes: the turns that one scheduler step
finished are stepped during the next scheduler step, and their next turns are queued right
after it, whatever the workers' timing. Each step ships the episode to a worker and gets it
back with the Step, so no worker holds an episode between steps: a step past
`step_timeout_s` has its worker killed and replaced, and so does a worker whose interpreter
dies; either way, or when a step raises or answers something that is not a Step, that
episode alone ends with reward 0, counted by kind (`env_failures`) and written to the dead
letters with the episode's id. Nothing an environment does can hold the trainer past the
deadline or leak a thread. The order of device calls is then a function of the tokens alone, the
same on every process and in a resumed run. Each turn's random draws come from (seed,
prompt, sample, turn), so an episode's tokens do not depend on that order either.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import math
import numbers
from typing import Callable, Optional, Sequence

import numpy as np

from jaxrl_post.envs.base import Environment, Step, play
from jaxrl_post.envs.chat import TurnFormat
from jaxrl_post.errors import UserError
from jaxrl_post.models.moe import NO_EXPERT
from jaxrl_post.rewards.base import Problem
from jaxrl_post.rewards.pool import KINDS, VerifierPool, default_workers
from jaxrl_post.rollout import Engine, SamplingParams
from jaxrl_post.rollout.pages import cdiv
from jaxrl_post.rollout.scheduler import Completion, Scheduler, SchedulerConfig
from jaxrl_post.sharding import hosts


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Attributes:
    max_turns: model turns per episode (the environment's own limit also holds).
    max_tokens: tokens after the prompt, the model's and the observations'.
    reward: "sum" of the turns' rewards, or the "last" turn's, as the episode's reward.
    step_timeout_s: longest an environment step (tool calls included) may take once a
      worker has it; past it the worker is killed and replaced, and the episode ends with
      reward 0, counted as a timeout.
  """

  max_turns: int = 4
  max_tokens: int = 256
  reward: str = "sum"
  step_timeout_s: float = 60.0

  def __post_init__(self):
    for name in ("max_turns", "max_tokens"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise UserError(f"agent spec: {name} must be a positive integer, "
                        f"got {getattr(self, name)!r}")
    if self.reward not in ("sum", "last"):
      raise UserError(f"agent spec: reward={self.reward!r} is not one of 'sum', 'last'")
    if not isinstance(self.step_timeout_s, (int, float)) or not self.step_timeout_s > 0:
      raise UserError(f"agent spec: step_timeout_s must be a number > 0, "
                      f"got {self.step_timeout_s!r}")


@dataclasses.dataclass(frozen=True)
class Turn:
  """One model turn and the environment's answer."""

  completion: Completion
  reply: str
  observation: str
  observation_ids: tuple[int, ...]  # Appended after the turn (empty after the last).
  reward: float


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
  """A finished episode, shaped like a Completion for the loop: `tokens` is every id after
  the prompt, with `loss_mask` 1 on the model's and 0 on the observations'; `logprobs`,
  `versions` and `floors` cover every token (observations: 0, the turn's version, -inf)."""

  turns: tuple[Turn, ...]
  reward: float
  solved: bool
  ended: str  # "done", "max_turns", "max_tokens" or "failed" (a step failed: reward 0)

  @property
  def tokens(self) -> tuple[int, ...]:
    return tuple(t for turn in self.turns
                 for t in (*turn.completion.tokens, *turn.observation_ids))

  @property
  def loss_mask(self) -> tuple[int, ...]:
    return tuple(m for turn in self.turns
                 for m in (1,) * len(turn.completion.tokens) + (0,) * len(turn.observation_ids))

  @property
  def logprobs(self) -> tuple[float, ...]:
    return tuple(x for turn in self.turns
                 for x in (*turn.completion.logprobs, *(0.0,) * len(turn.observation_ids)))

  @property
  def versions(self) -> tuple[int, ...]:
    return tuple(v for turn in self.turns for v in (
        *turn.completion.versions, *(turn.completion.versions[-1],) * len(turn.observation_ids)))

  @property
  def floors(self) -> Optional[tuple[float, ...]]:
    if self.turns[0].completion.floors is None:
      return None
    return tuple(x for turn in self.turns for x in (
        *turn.completion.floors, *(-np.inf,) * len(turn.observation_ids)))

  @property
  def finish_reason(self) -> str:
    return self.turns[-1].completion.finish_reason

  @property
  def experts(self) -> Optional[np.ndarray]:
    """MoE models: [P + N - 1, L, k], the experts of every token the model was fed, for
    routing replay (as Completion.experts); None for a dense model. Each turn's record
    spans the sequence from its start, NO_EXPERT where that turn did not feed the token
    (a later turn prefills only the last turn's final token and the observation); an
    observation after the last turn was never fed and stays NO_EXPERT (routes itself)."""
    records = [turn.completion.experts for turn in self.turns]
    if records[0] is None:
      return None
    first = self.turns[0].completion
    prompt = len(records[0]) - len(first.tokens) + 1
    out = np.full((prompt + len(self.tokens) - 1, *records[0].shape[1:]), NO_EXPERT, np.int16)
    for record in records:
      part, fed = out[:len(record)], record[:len(out)] != NO_EXPERT
      part[fed] = record[:len(out)][fed]
    return out

  @property
  def weight_version(self) -> int:
    return min(self.versions)


@dataclasses.dataclass
class _Live:
  """An episode under way."""

  index: int  # Its prompt.
  sample: int
  problem: Problem
  episode: object  # The environment's Episode.
  history: list[int]
  turns: list[Turn] = dataclasses.field(default_factory=list)


class StepFailed(Exception):
  """An environment step that raised, hung, crashed its worker or answered garbage."""

  def __init__(self, kind: str, reason: Optional[str]):
    super().__init__(f"{kind}: {reason}")
    self.kind = kind


def _step_in_worker(episode, reply: str) -> tuple[object, Step]:
  """Runs in a pool worker: the step, and the episode as it stands after it (the trainer
  keeps the state, so killing a worker loses only the step it was on). A reply that is not
  a well-formed Step raises here, which the pool counts and dead-letters as an error."""
  step = episode.step(reply)
  _check_step(step)
  return episode, step


def _check_step(step) -> None:
  if not isinstance(step, Step):
    raise TypeError(f"step returned {type(step).__name__}, not a Step")
  if not isinstance(step.observation, str):
    raise TypeError(f"Step.observation is {type(step.observation).__name__}, not str")
  if (not isinstance(step.reward, numbers.Real) or isinstance(step.reward, bool)
      or not math.isfinite(step.reward)):
    raise TypeError(f"Step.reward={step.reward!r} is not a finite number")
  for name in ("done", "solved"):
    if not isinstance(getattr(step, name), (bool, np.bool_)):
      raise TypeError(f"Step.{name}={getattr(step, name)!r} is not a bool")


def turn_seed(seed: int, step: int, index: int, sample: int, turn: int) -> int:
  return int(np.random.SeedSequence([seed, step, index, sample, turn]).generate_state(1)[0])


class EpisodeRunner:
  """Runs episodes of one environment on one engine (see the module docstring)."""

  def __init__(self, engine: Engine, env: Environment, turns: TurnFormat,
               limits: EpisodeLimits, scheduler: SchedulerConfig = SchedulerConfig(),
               workers: Optional[int] = None, processes: bool = True,
               dead_letter: Optional[str] = None):
    """workers: environment steps run at once (default rewards.pool.default_workers());
    processes: False steps on threads of this process (for an environment that cannot be
    pickled; a hung step is then abandoned, not killed); dead_letter: JSONL file that gets
    one line per failed step."""
    self.engine, self.env, self.turns, self.limits = engine, env, turns, limits
    self.scheduler_cfg = scheduler
    self.max_turns = min(limits.max_turns, env.max_turns)
    workers = default_workers() if workers is None else workers
    self.pool = VerifierPool(env, workers=workers, timeout_s=limits.step_timeout_s,
                             processes=processes, dead_letter=dead_letter)
    # Each thread only waits on a pool call, which the pool ends by its deadline: no
    # thread outlives a step, so this many threads are all the driver ever has.
    self._waiters = concurrent.futures.ThreadPoolExecutor(workers, "env-step")
    self._keys = itertools.count()
    self._step = 0
    self.env_failures: collections.Counter = collections.Counter({k: 0 for k in KINDS})

  @property
  def env_errors(self) -> int:
    """Failed steps of every kind (errors, timeouts, crashes)."""
    return sum(self.env_failures.values())

  def close(self) -> None:
    self._waiters.shutdown(wait=False, cancel_futures=True)
    self.pool.close()  # Fails what is still running, so no waiter is left blocked.

  def run(self, problems: Sequence[Problem], prompts: Sequence[list[int]], k: int,
          sampling: SamplingParams, seed: int, step: int,
          between_calls: Optional[Callable[[], None]] = None) -> list[list[EpisodeRecord]]:
    """K episodes of each problem, in problem order; `between_calls()` runs before each
    scheduler step.

    A process that holds none of the engine's devices receives the episodes from the
    rollout's processes (collective)."""
    mesh = self.engine.layout.mesh
    if not hosts.holds(mesh):
      return hosts.share(None, mesh)
    sched = Scheduler(self.engine, self.scheduler_cfg)
    self._step = step
    owner: dict[int, tuple[_Live, ...]] = {}  # request id -> episodes by sample
    done: list[list[Optional[EpisodeRecord]]] = [[None] * k for _ in problems]
    budget, queued = self._concurrent_prompts(prompts, k), 0
    shard_of: list[int] = []  # Per queued prompt, the data shard holding its episodes.
    stepping: list = []  # The last scheduler step's finished turns, their env steps running.
    while queued < len(prompts) or not sched.idle or stepping:
      while queued < len(prompts):
        shard = self._open_shard(done, shard_of, budget)
        if shard is None:
          break
        i = queued
        first = self._turn_sampling(sampling, 0)
        rid = sched.submit(prompts[i], first, n=k, seed=turn_seed(seed, step, i, 0, 0),
                           keep=True, shard=shard)
        shard_of.append(shard)
        owner[rid] = tuple(_Live(i, j, problems[i], self.env.reset(problems[i]),
                                 list(prompts[i]))
                           for j in range(k))
        queued += 1
      if between_calls is not None:
        between_calls()
      finished = []
      for rid, j, c in sched.step():
        live = owner[rid][j]
        finished.append((live, c, sched.held.pop((rid, j)), self._env_step(live, c)))
      for live, completion, held, future in stepping:  # Ran while that step decoded.
        result = self._outcome(live, future)
        self._advance(sched, live, completion, held, result, sampling, seed, step, owner,
                      done)
      stepping = finished
    return hosts.share([list(row) for row in done], mesh)

  def _concurrent_prompts(self, prompts: Sequence[list[int]], k: int) -> int:
    """Prompts whose K episodes one data shard's pool holds at their longest, all at once."""
    ps, longest = self.engine.page_size, max(len(p) for p in prompts)
    pages = cdiv(longest + self.limits.max_tokens, ps) + 1  # +1: a copy on write
    usable = sum(a.usable for a in self.engine.allocs) // self.engine.shards
    per_shard = usable // (k * pages)
    if per_shard < 1:
      raise UserError(f"agent: {k} episodes of up to {longest} + {self.limits.max_tokens} "
                      f"tokens need {k * pages} KV pages at once; the pool has {usable} per "
                      "data shard (raise the pool or lower max_tokens or the group size)")
    return per_shard

  def _open_shard(self, done, shard_of: Sequence[int], budget: int) -> Optional[int]:
    """The data shard for the next prompt: the one with the fewest live prompts, if under
    `budget`. An episode's later turns run where its pages are, so the shards are balanced
    by the episodes they hold, not by free slots (held pages take no slot): no shard ever
    holds more episodes than its pool can grow to their longest."""
    live = [0] * self.engine.shards
    for row, shard in zip(done, shard_of):
      live[shard] += any(e is None for e in row)
    shard = min(range(len(live)), key=lambda s: live[s])
    return shard if live[shard] < budget else None

  def _turn_sampling(self, sampling: SamplingParams, used: int) -> SamplingParams:
    left = self.limits.max_tokens - used
    return dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, left))

  def _env_step(self, live: _Live, c: Completion) -> concurrent.futures.Future:
    """The environment's answer to a finished turn, stepped in a pool worker; the key names
    the episode (problem id / sample) and turn, for its dead letter."""
    episode_id = f"{getattr(live.problem, 'id', live.index)}/{live.sample}"
    key = ("episode", episode_id, len(live.turns), next(self._keys))
    return self._waiters.submit(self.pool.call, key, _step_in_worker, live.episode,
                                self._reply(c), step=self._step)

  def _outcome(self, live: _Live, future: concurrent.futures.Future) -> Step | StepFailed:
    """The step's answer, with the episode's state after it; or why it failed, counted."""
    try:
      done = future.result()  # Bounded: the pool ends every call by its deadline.
    except Exception as e:  # E.g. the pool was closed under it: the episode ends, not the run.
      done_kind, reason = "error", f"{type(e).__name__}: {e}"
    else:
      if done.kind == "ok":
        live.episode, step = done.value
        return step
      done_kind, reason = done.kind, done.reason
    self.env_failures[done_kind] += 1
    return StepFailed(done_kind, reason)

  def _reply(self, c: Completion) -> str:
    tok = self.turns.tokenizer
    return tok.decode(c.tokens, skip_special_tokens=True)

  def _advance(self, sched, live: _Live, c: Completion, held, result, sampling, seed, step,
               owner, done) -> None:
    """Records a turn and queues the next, or ends the episode."""
    failed = isinstance(result, StepFailed)  # Counted already; the episode scores 0.
    if failed:
      result = Step("", 0.0, True)
    live.history += c.tokens
    used = len(c.tokens) + sum(len(t.completion.tokens) + len(t.observation_ids)
                               for t in live.turns)  # Tokens after the prompt so far.
    ended = "failed" if failed else "done" if result.done else None
    obs: tuple[int, ...] = ()
    if ended is None and len(live.turns) + 1 >= self.max_turns:
      ended = "max_turns"
    if ended is None:
      obs = tuple(self.turns.observation(result.observation, c.tokens[-1]))
      if used + len(obs) >= self.limits.max_tokens:
        ended, obs = "max_tokens", ()
    live.turns.append(Turn(c, self._reply(c), result.observation if obs else "", obs,
                           float(result.reward)))
    if ended is None:
      live.history += obs
      nxt = sched.resume(held, live.history, self._turn_sampling(sampling, used + len(obs)),
                         seed=turn_seed(seed, step, live.index, live.sample, len(live.turns)))
      owner[nxt] = (live,)
      return
    sched.release(held)
    rewards = [t.reward for t in live.turns]
    total = sum(rewards) if self.limits.reward == "sum" else rewards[-1]
    total = 0.0 if failed else total  # Earlier turns' rewards included: not to be trusted.
    done[live.index][live.sample] = EpisodeRecord(tuple(live.turns), float(total),
                                            bool(result.solved), ended)


def scripted_episode(env: Environment, problem: Problem, turns: TurnFormat,
                     limits: EpisodeLimits, rng: np.random.Generator
                     ) -> Optional[tuple[list[int], list[int]]]:
  """The ids after the prompt of an episode played with the environment's demonstration
  replies (each closed with the tokenizer's end of turn), and their loss mask (1 on the
  replies); None when the environment has no demonstration or it exceeds the limits."""
  replies = env.demonstration(problem, rng)
  if replies is None:
    return None
  tok = turns.tokenizer
  end = [tok.eos_id] if tok.eos_id is not None else []
  ids, mask = [], []
  played = play(env, problem, replies[:min(limits.max_turns, env.max_turns)])
  for n, (reply, step) in enumerate(played):
    said = tok.encode(reply, add_special_tokens=False) + end
    ids += said
    mask += [1] * len(said)
    if not step.done and n + 1 < len(played):
      obs = turns.observation(step.observation, said[-1])
      ids += obs
      mask += [0] * len(obs)
  return (ids, mask) if 0 < len(ids) <= limits.max_tokens else None
