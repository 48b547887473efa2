"""A pool of verifier worker processes that scores completions while the engine decodes.

A verifier is arbitrary CPU code run on untrusted model output: it can raise, loop forever
or take the interpreter down with it (a segfault in a native parser, an `os._exit` in
sandboxed code). Each worker is a process that holds the task (sent once, when the worker
starts) and makes one call at a time, so the pool always knows which sample a worker is
on: a call past `timeout_s` gets its worker killed and replaced, and so does a worker that
dies. Either way that sample scores 0.0, as does a call that raises or returns a non-finite
reward; each failure is appended as one JSON line to a dead-letter file. Nothing a verifier
does raises into the trainer or holds it past the deadline.

Calls are submitted one sample at a time under a key of the caller's choosing and return at
once; `results(keys)` blocks until those keys are done and answers in the keys' order, so
rewards are matched to samples by key, never by arrival. A slow call holds up only its own
worker: the others keep taking the queue, so fast calls wait only while every worker is on
a slow one.

Workers start from the "forkserver" context: a fresh, single-threaded server process forks
them, never the trainer, whose JAX runtime threads make a plain fork unsafe. As with any
spawned process, the trainer's main module is imported in each worker (guard its entry point
with `if __name__ == "__main__"`), and the task's class must be importable there. A task
that cannot be pickled can score on threads instead (`processes=False`): the same pool, but
a hung call can only be abandoned, not killed.

The same workers also run plain function calls (`call`): an agent's tool calls go through
them with the same deadline, kill and dead-letter handling, off the trainer's process.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
from multiprocessing import connection
from typing import Any, Hashable, Mapping, NamedTuple, Sequence

import numpy as np

from jaxrl_post import host
from jaxrl_post.errors import UserError
from jaxrl_post.rewards.base import Problem, Task
from jaxrl_post.rewards.compose import reward_metrics
from jaxrl_post.rewards.dispatch import verify

KINDS = ("error", "timeout", "crash")  # The failure types a dead-letter line can carry.
_READY = "ready"  # A worker's first message: the task is unpickled, calls may come.
_START_TIMEOUT_S = 120.0  # A worker that is not ready by then is killed as a failed start.
_START_FAILURES = 3  # Workers dead before ready, in a row, that make the pool give up.
_STOP_GRACE_S = 2.0  # How long `close` lets an idle worker exit before killing it.


def default_workers() -> int:
  """min(4, the CPUs this process may run on): verifiers share the host with the trainer."""
  return min(4, host.cpus())


@dataclasses.dataclass(frozen=True)
class VerifierStats:
  """How one `results` call's samples were scored.

  Attributes:
    samples: Samples asked for.
    errors: Calls that raised or returned a non-finite reward.
    timeouts: Calls killed (or, on threads, abandoned) at the deadline.
    crashes: Calls whose worker died under them.
    error_types: Errors by exception type name, e.g. {"ValueError": 2}.
    busy_s: Seconds the workers spent on these samples, deadline-cut calls included.
    wait_s: Seconds `results` blocked: how long the caller waited once it had to.
    parts: Per sample, in the keys' order, the reward's named components (None for a
      failed call, or a task without components).
  """

  samples: int = 0
  errors: int = 0
  timeouts: int = 0
  crashes: int = 0
  error_types: Mapping[str, int] = dataclasses.field(default_factory=dict)
  busy_s: float = 0.0
  wait_s: float = 0.0
  parts: tuple = ()

  def counts(self) -> dict[str, int]:
    """The failure counts alone: deterministic for a deterministic verifier."""
    return {"errors": self.errors, "timeouts": self.timeouts, "crashes": self.crashes}

  def as_metrics(self) -> dict[str, float]:
    out: dict[str, float] = {"reward/wait_s": self.wait_s, "verifier/samples": self.samples,
                             "verifier/seconds_per_sample": self.busy_s / max(self.samples, 1)}
    out.update({f"verifier/{name}": n for name, n in self.counts().items()})
    out.update({f"verifier/errors/{name}": n for name, n in sorted(self.error_types.items())})
    names = list(dict.fromkeys(name for p in self.parts if p is not None for name in p))
    out.update(reward_metrics(names, self.parts) if names else {})  # reward/<component>
    return out


class _Outcome(NamedTuple):
  reward: float
  kind: str  # "ok" or one of KINDS.
  error_type: str | None
  seconds: float
  parts: Any  # The reward's named components (None without), or a call's return value.


class CallResult(NamedTuple):
  """How one `call` went: its return value when kind is "ok", else None and the reason."""
  value: Any
  kind: str  # "ok" or one of KINDS.
  reason: str | None


@dataclasses.dataclass(frozen=True)
class _Call:
  """A function call for a worker (`VerifierPool.call`): fn and args must pickle."""
  fn: Any
  args: tuple


@dataclasses.dataclass
class _Job:
  key: Hashable
  problem: Problem | None
  completion: str | None
  step: int | None
  started: float = 0.0  # time.monotonic() when a worker took it.
  call: _Call | None = None  # Set: run this instead of scoring.
  reason: str | None = None  # Why it failed, for `call`'s result.


def _serve(conn: connection.Connection, task: Task, own_process: bool) -> None:
  """A worker's loop: (problem, completion) in, `verify`'s (reward, parts, type, reason)
  out."""
  if own_process:
    # Ctrl-C reaches the whole process group; the trainer handles it and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
  try:
    conn.send(_READY)
    while True:
      message = conn.recv()
      conn.send(_run(message) if isinstance(message, _Call) else verify(task, *message))
  except (EOFError, OSError):
    return  # The pool closed, or abandoned this (thread) worker: nobody is listening.
  finally:
    conn.close()


def _run(call: _Call) -> tuple[float, Any, str | None, str | None]:
  """A plain call in `verify`'s reply shape: (0.0, its value, None, None), or the error."""
  try:
    return 0.0, call.fn(*call.args), None, None
  except Exception as e:  # Contained like a verifier's: the caller gets a failed result.
    return 0.0, None, type(e).__name__, " ".join(f"{type(e).__name__}: {e}".split())[:300]


def _exit_with_parent() -> None:
  """Ends this worker when the trainer dies, even mid-call (SIGKILL skips `close`)."""
  parent = multiprocessing.parent_process()
  if parent is None or parent.sentinel is None:
    return

  def watch():
    connection.wait([parent.sentinel])
    os._exit(0)

  threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class _Worker:
  """One verifier, a process (or a thread), serving calls over its pipe one at a time."""

  def __init__(self, task: Task, context: Any):
    self.conn, child = multiprocessing.Pipe()
    if context is None:
      self.proc: Any = threading.Thread(target=_serve, args=(child, task, False),
                                        name="verifier", daemon=True)
    else:
      self.proc = context.Process(target=_serve, args=(child, task, True), name="verifier",
                                  daemon=True)
    self.proc.start()
    if context is not None:
      child.close()  # The process has its own copy; ours would hide its death from recv.
    self.born, self.ready, self.job, self.dead = time.monotonic(), False, None, False

  @property
  def sentinel(self) -> Any:
    return getattr(self.proc, "sentinel", None)

  @property
  def pid(self) -> int | None:
    return getattr(self.proc, "pid", None)

  def exit_reason(self) -> str:
    """Why the worker ended, e.g. "worker exited with code 3", "worker killed by SIGSEGV"."""
    if not isinstance(self.proc, multiprocessing.process.BaseProcess):
      return "verifier thread ended"
    self.proc.join(1.0)
    code = self.proc.exitcode
    if code is not None and code < 0:
      try:
        return f"worker killed by {signal.Signals(-code).name}"
      except ValueError:  # A signal number this platform has no name for.
        return f"worker killed by signal {-code}"
    return f"worker exited with code {code}"

  def kill(self) -> None:
    """Stops the worker now; a thread cannot be stopped and is abandoned instead."""
    self.dead = True
    self.conn.close()
    if isinstance(self.proc, multiprocessing.process.BaseProcess):
      self.proc.kill()
      self.proc.join()

  def stop(self) -> None:
    """Lets an idle worker exit (its pipe closes), killing it after a grace period (a busy
    one at once)."""
    self.dead = True
    self.conn.close()
    if isinstance(self.proc, multiprocessing.process.BaseProcess):
      self.proc.join(_STOP_GRACE_S if self.job is None else 0.0)
      if self.proc.is_alive():
        self.proc.kill()
        self.proc.join()


class VerifierPool:
  """Scores (problem, completion) calls on worker processes, matched to samples by key.

  Usage:

    with VerifierPool(task, workers=4, timeout_s=10.0, dead_letter="run/dead_letter.jsonl") \\
        as pool:
      for key, problem, text in finished_samples:  # as soon as each is decoded
        pool.submit(key, problem, text, step=step)
      rewards, stats = pool.results(keys)  # float32 [len(keys)], in the keys' order

  One thread (the dispatcher) feeds idle workers from a FIFO queue, reads their results,
  and kills and replaces workers past their deadline or dead. Everything the dispatcher
  and the callers share changes only under `_cond`.
  """

  def __init__(self, task: Task, *, workers: int | None = None, timeout_s: float = 10.0,
               processes: bool = True, dead_letter: str | None = None):
    """Starts the workers (in the background: the constructor does not wait for them).

    Args:
      task: Supplies `score(problem, completion) -> float`; pickled once per worker.
      workers: Calls scored at once (default `default_workers()`).
      timeout_s: Longest one call may run, from when a worker takes it.
      processes: Workers are processes (killable); False: threads of this process.
      dead_letter: JSONL file that gets one line per failed call; None writes none.

    Raises:
      UserError: A bad argument, or (with processes) a task that cannot be pickled.
    """
    workers = default_workers() if workers is None else workers
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
      raise UserError(f"verifier pool: workers={workers!r} must be an integer >= 1")
    if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
      raise UserError(f"verifier pool: timeout_s={timeout_s!r} must be a finite number > 0")
    if processes:
      _check_pickles(task)
    self.task, self.timeout_s, self._dead_letter_path = task, float(timeout_s), dead_letter
    self._context = multiprocessing.get_context("forkserver") if processes else None
    self._cond = threading.Condition()
    self._queue: collections.deque[_Job] = collections.deque()
    self._jobs: dict[Hashable, _Job] = {}  # Submitted, not finished.
    self._done: dict[Hashable, _Outcome] = {}  # Finished, not yet collected by `results`.
    self._closed, self._woken, self._broken = False, False, None
    self._start_failures = 0
    self._dead_letter_file = None
    self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
    self._workers = [_Worker(task, self._context) for _ in range(workers)]
    self._thread = threading.Thread(target=self._dispatch, name="verifier-pool", daemon=True)
    self._thread.start()
    atexit.register(self.close)  # No orphan workers, even if the owner never closes.

  # ------------------------------------------------------------------ caller side

  def submit(self, key: Hashable, problem: Problem, completion: str, *,
             step: int | None = None) -> None:
    """Queues one call and returns at once; `step` only labels dead-letter lines.

    Raises:
      ValueError: `key` is already in the pool (submitted and not yet collected).
      RuntimeError: The pool is closed.
    """
    with self._cond:
      self._enqueue(_Job(key, problem, completion, step), "submit")

  def call(self, key: Hashable, fn: Any, *args: Any, step: int | None = None) -> CallResult:
    """Runs fn(*args) on a worker and blocks until it is done: the same deadline, kill and
    dead-letter handling as scoring. fn and args must pickle (a module-level function).

    Raises:
      ValueError: `key` is already in the pool.
      RuntimeError: The pool is closed.
    """
    with self._cond:
      job = _Job(key, None, None, step, call=_Call(fn, tuple(args)))
      self._enqueue(job, "call")
      self._cond.wait_for(lambda: key in self._done)
      outcome = self._done.pop(key)
    ok = outcome.kind == "ok"
    return CallResult(outcome.parts if ok else None, outcome.kind, None if ok else job.reason)

  def _enqueue(self, job: _Job, verb: str) -> None:
    """Under `_cond`: queues `job` for a worker (or fails it at once in a broken pool)."""
    if self._closed:
      raise RuntimeError(f"verifier pool: {verb} after close")
    if job.key in self._jobs or job.key in self._done:
      raise ValueError(f"verifier pool: key {job.key!r} was already submitted")
    self._jobs[job.key] = job
    if self._broken is not None:
      self._finish(job, "crash", self._broken)
      return
    self._queue.append(job)
    self._wake()

  def results(self, keys: Sequence[Hashable]) -> tuple[np.ndarray, VerifierStats]:
    """Blocks until every key's call is done (or failed); collects them.

    Returns:
      float32 rewards [len(keys)] in the keys' order (0.0 for a failed call), and how the
      calls went. Collected keys leave the pool, so a key may be used again afterwards.

    Raises:
      ValueError: A key that was never submitted (or was already collected).
    """
    start = time.perf_counter()
    if len(set(keys)) != len(keys):
      raise ValueError("verifier pool: results asked for the same key twice")
    with self._cond:
      unknown = [k for k in keys if k not in self._jobs and k not in self._done]
      if unknown:
        raise ValueError(f"verifier pool: results for unsubmitted key {unknown[0]!r}")
      self._cond.wait_for(lambda: all(k in self._done for k in keys))
      outcomes = [self._done.pop(k) for k in keys]
    return (np.array([o.reward for o in outcomes], np.float32),
            _stats(outcomes, time.perf_counter() - start))

  def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> bool:
    """Whether every worker is up (task loaded) within `timeout_s`; for tests and benchmarks
    that should not time worker start-up."""
    with self._cond:
      return self._cond.wait_for(
          lambda: self._broken is not None or all(w.ready for w in self._workers), timeout_s)

  @property
  def pids(self) -> list[int]:
    """The live worker processes (empty on threads)."""
    with self._cond:
      return [w.pid for w in self._workers if w.pid is not None]

  def close(self) -> None:
    """Stops every worker and the dispatcher; calls not yet done score 0.0 as crashes."""
    with self._cond:
      if self._closed:
        return
      self._closed = True
      self._wake()
    self._thread.join()
    atexit.unregister(self.close)
    with self._cond:
      for w in self._workers:
        w.conn.close()  # All at once: idle workers then exit side by side.
      for w in self._workers:
        w.stop()
      for job in list(self._jobs.values()):
        self._finish(job, "crash", "verifier pool closed")
      self._queue.clear()
      if self._dead_letter_file is not None:
        self._dead_letter_file.close()
    self._wake_r.close()
    self._wake_w.close()

  def __enter__(self) -> "VerifierPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ dispatcher side

  def _wake(self) -> None:
    """Interrupts the dispatcher's wait (at most one wake-up is ever in flight)."""
    if not self._woken:
      self._woken = True
      self._wake_w.send_bytes(b"")

  def _dispatch(self) -> None:
    try:
      while True:
        with self._cond:
          if self._closed:
            return
          self._assign()
          live = [w for w in self._workers if not w.dead]
          watched = {w.conn: w for w in live}
          watched.update({w.sentinel: w for w in live if w.sentinel is not None})
          timeout = self._next_deadline() - time.monotonic()
        ready = connection.wait([self._wake_r, *watched], max(timeout, 0.0))
        with self._cond:
          if self._closed:
            return
          if self._wake_r in ready:
            while self._wake_r.poll():
              self._wake_r.recv_bytes()
            self._woken = False
          for obj in ready:
            if obj is not self._wake_r and not watched[obj].dead:
              self._service(watched[obj])
          self._expire()
    except BaseException as e:  # A bug here must not hang `results`: fail what is left.
      with self._cond:
        self._give_up(f"verifier pool dispatcher failed: {type(e).__name__}: {e}")

  def _assign(self) -> None:
    for w in self._workers:
      if not self._queue:
        return
      if w.ready and w.job is None and not w.dead:
        job = self._queue.popleft()
        try:
          w.conn.send(job.call or (job.problem, job.completion))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
          self._finish(job, "error", f"cannot send to a worker: {type(e).__name__}: {e}",
                       error_type=type(e).__name__)
          continue
        except OSError:  # The worker just died; it is found and replaced below.
          self._queue.appendleft(job)
          continue
        job.started, w.job = time.monotonic(), job

  def _service(self, w: _Worker) -> None:
    """Takes what a worker sent; replaces it if it is gone."""
    gone = False
    try:
      while not w.dead and w.conn.poll():
        message = w.conn.recv()
        if message == _READY:
          w.ready, self._start_failures = True, 0
          self._cond.notify_all()
          continue
        job, w.job = w.job, None
        reward, parts, error_type, reason = message
        self._finish(job, "ok" if error_type is None else "error", reason, reward, error_type,
                     parts)
    except (EOFError, OSError):
      gone = True
    if gone or (w.sentinel is not None and not w.proc.is_alive()):
      self._replace(w, "crash", w.exit_reason())

  def _expire(self) -> None:
    now = time.monotonic()
    for w in list(self._workers):
      if w.job is not None and now - w.job.started >= self.timeout_s:
        self._replace(w, "timeout", f"no result after {self.timeout_s:g} s")
      elif not w.ready and now - w.born >= _START_TIMEOUT_S:
        self._replace(w, "crash", f"worker not ready after {_START_TIMEOUT_S:g} s")

  def _next_deadline(self) -> float:
    deadlines = [w.job.started + self.timeout_s for w in self._workers if w.job is not None]
    deadlines += [w.born + _START_TIMEOUT_S for w in self._workers if not w.ready]
    return min(deadlines, default=time.monotonic() + 3600.0)

  def _replace(self, w: _Worker, kind: str, reason: str) -> None:
    """Kills `w`, fails its call (if any) with `kind`, and starts a fresh worker."""
    job = w.job
    w.kill()
    if job is not None:
      self._finish(job, kind, reason)
    if not w.ready:
      self._start_failures += 1
      if self._start_failures >= _START_FAILURES:
        self._give_up(f"workers cannot start: {reason}")
        return
    self._workers[self._workers.index(w)] = _Worker(self.task, self._context)

  def _give_up(self, reason: str) -> None:
    """No more workers: every call, queued or to come, fails as a crash with `reason`."""
    self._broken = reason
    for w in self._workers:
      if not w.dead:
        w.kill()
    for job in list(self._jobs.values()):
      self._finish(job, "crash", reason)
    self._queue.clear()

  def _finish(self, job: _Job, kind: str, reason: str | None, reward: float = 0.0,
              error_type: str | None = None, parts: dict | None = None) -> None:
    if self._jobs.pop(job.key, None) is None:
      return  # Already failed (e.g. by `_give_up`) before its worker answered.
    seconds = time.monotonic() - job.started if job.started else 0.0
    job.reason = reason
    self._done[job.key] = _Outcome(reward, kind, error_type, seconds, parts)
    if kind != "ok":
      self._write_dead_letter(job, kind, reason or "")
    self._cond.notify_all()

  def _write_dead_letter(self, job: _Job, kind: str, reason: str) -> None:
    if self._dead_letter_path is None:
      return
    try:
      if self._dead_letter_file is None:
        directory = os.path.dirname(self._dead_letter_path)
        if directory:
          os.makedirs(directory, exist_ok=True)
        self._dead_letter_file = open(self._dead_letter_path, "a", buffering=1)
      record = {"step": job.step, "problem_id": getattr(job.problem, "id", None),
                "key": job.key, "type": kind, "reason": reason}
      if job.call is not None:  # A tool call: which function failed.
        fn = job.call.fn
        record["call"] = getattr(fn, "__name__", None) or getattr(fn, "func", fn).__name__
      self._dead_letter_file.write(json.dumps(record, default=repr) + "\n")
    except OSError:
      pass  # A full disk loses the record, not the step: the counters still show it.


def _check_pickles(task: Task) -> None:
  try:
    pickle.dumps(task)
  except Exception as e:  # pickle raises several types (PicklingError, TypeError, ...).
    raise UserError(f"verifier pool: task {type(task).__name__} cannot be sent to worker "
                    f"processes ({type(e).__name__}: {e}); use processes=False") from e


def _stats(outcomes: Sequence[_Outcome], wait_s: float) -> VerifierStats:
  kinds = collections.Counter(o.kind for o in outcomes)
  types = collections.Counter(o.error_type for o in outcomes if o.kind == "error")
  return VerifierStats(samples=len(outcomes), errors=kinds["error"], timeouts=kinds["timeout"],
                       crashes=kinds["crash"], error_types=dict(types),
                       busy_s=sum(o.seconds for o in outcomes), wait_s=wait_s,
                       parts=tuple(o.parts for o in outcomes))
