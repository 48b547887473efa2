"""When the worker holds a forward_backward back for other clients' (to run them as one
program): only for clients stepping at a pace that says theirs is about to arrive."""

import heapq
import types

from jaxrl_post.serve.config import ServeConfig
from jaxrl_post.serve.service import Op, Run, Service


def _service(runs):
  return types.SimpleNamespace(runs={r.model_id: r for r in runs}, _control=[],
                               cfg=ServeConfig())


def _run(name, step_times, queued=None, fbs_per_step=1):
  run = Run(name, "base", 4, 0)
  for t in step_times:
    for i in range(fbs_per_step):
      run.submitted("forward_backward", t + 0.001 * i)
    run.submitted("optim_step", t + 0.002)
  if queued:
    heapq.heappush(run.ops, Op(1, 0, queued, "req-0", None))
  return run


def test_a_client_in_lockstep_is_waited_for_and_an_idle_one_is_not(monkeypatch):
  now = 100.0
  monkeypatch.setattr("time.monotonic", lambda: now)
  waiting = _run("a", [now - 0.1, now], "forward_backward")
  due = Service._others_due
  assert due(_service([waiting, _run("b", [now - 0.1, now - 0.05])]))  # every 50 ms
  assert not due(_service([waiting, _run("b", [now - 1.05, now - 1.0])]))  # idle for 1 s
  assert not due(_service([waiting, _run("b", [now - 0.01])]))  # one step: no pace yet
  # A client sending three forward_backwards a step keeps the pace of its steps.
  assert due(_service([waiting, _run("b", [now - 0.1, now - 0.05], fbs_per_step=3)]))
  mid_step = _run("b", [now - 0.1, now - 0.05])
  mid_step.submitted("forward_backward", now - 0.01)  # its step began: its next one is no
  assert not due(_service([waiting, mid_step]))       # new step (it joins, or runs, alone)
  assert not due(_service([waiting]))  # alone
  # A queued optim_step runs at once: the program waits for no one.
  assert not due(_service([_run("a", [now - 0.1, now], "optim_step"),
                           _run("b", [now - 0.1, now - 0.05])]))
