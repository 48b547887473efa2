"""`python -m jaxrl_post.plan --fit`: the bindings with which a config fits its target.

Each candidate is the config plus a few gin bindings, planned for real (its programs
compiled for the target, as the plain plan does), so a verdict is never an estimate. The
search is greedy over moves that each relieve one part of a device's memory:

* micro_batches x2: half the activations of the train step (its largest transient: the
  layer inputs remat keeps for the backward pass);
* remat "full": keep only each layer's input instead of its intermediates;
* reference bfloat16: half the frozen reference's resident copy;
* rollout tensor x2: the engine's weights and KV heads split over twice the devices
  instead of replicated (fewer, wider decode replicas);
* slots / 2: half the KV the engine's slots need at the longest sequence.

While the config does not fit, the move whose estimated saving (from the last plan's
memory breakdown) is largest is compiled next; a move that does not lower the peak is
dropped. Once a candidate fits, the remaining moves are tried from it within the compile
budget, and every candidate that fits is ranked by predicted step time: the fastest wins,
the others are the runners-up.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

from jaxrl_post.errors import UserError


@dataclasses.dataclass(frozen=True)
class Candidate:
  bindings: tuple[str, ...]  # gin bindings on top of the config's own
  moves: tuple[str, ...]  # the moves that made them
  plan: Optional[dict]  # Plan.as_json(), None where it could not be planned
  error: str = ""

  @property
  def fits(self) -> bool:
    return self.plan is not None and bool(self.plan["fits"])

  @property
  def peak(self) -> float:
    return float("inf") if self.plan is None else self.plan["peak_gb_per_device"]

  @property
  def step_s(self) -> float:
    return float("inf") if self.plan is None else self.plan["predicted_s"]["step"]


@dataclasses.dataclass(frozen=True)
class Move:
  name: str
  bindings: Callable  # (exp, rollout mesh shape) -> {gin name: value}, or None (n/a)
  saving_gb: Callable  # (plan json) -> estimated GB per device it frees


def _micro_batches(exp, mesh):
  t, r = exp.trainer, exp.rollout
  m = 2 * t.micro_batches
  if (r.prompts_per_step * r.group_size) % (t.minibatches * m):
    return None
  return {"TrainerConfig.micro_batches": m}


def _remat(exp, mesh):
  if exp.model.overrides.get("remat", "none") == "full":
    return None
  return {"ModelSpec.overrides": {**exp.model.overrides, "remat": "full"}}


def _reference(exp, mesh):
  if exp.reference.dtype == "bfloat16" or exp.trainer.loss.kl_coef <= 0:
    return None
  return {"ReferenceSpec.dtype": "bfloat16"}


def _rollout_tensor(exp, mesh):
  data, tensor = mesh["data"], mesh["tensor"]
  if data % 2:
    return None
  return {"rollout_mesh/MeshConfig.data": data // 2, "rollout_mesh/MeshConfig.fsdp": 1,
          "rollout_mesh/MeshConfig.tensor": 2 * tensor,
          "rollout_mesh/MeshConfig.expert": mesh["expert"]}


def _slots(exp, mesh):
  eng = exp.rollout.engine
  if eng.num_slots is None or eng.num_slots // 2 < max(eng.group_slots, 1) * mesh["data"]:
    return None
  return {"EngineConfig.num_slots": eng.num_slots // 2}


def _kv_short(plan) -> float:
  """GB per device the KV pool lacks for the slots' need (0 when it holds them)."""
  tokens = plan["kv_tokens_needed"] - plan["kv_tokens"]
  return max(tokens, 0) * plan["resident_gb"]["kv_pool"] / max(plan["kv_tokens_needed"], 1)


MOVES = (
    Move("micro_batches x2", _micro_batches, lambda p: p["memory_gb"]["train"]["temp"] / 2),
    Move("remat full", _remat, lambda p: p["memory_gb"]["train"]["temp"] / 2),
    Move("reference bfloat16", _reference, lambda p: p["resident_gb"]["reference"] / 2),
    Move("rollout tensor x2", _rollout_tensor,
         lambda p: p["resident_gb"]["rollout_weights"] / 2),
    Move("slots / 2", _slots, lambda p: p["resident_gb"]["kv_pool"] / 2 + 2 * _kv_short(p)),
)


def gin_value(value) -> str:
  """`value` as gin reads it, with double-quoted strings (the binding goes inside single
  quotes on a command line)."""
  if isinstance(value, str):
    return json.dumps(value)
  if isinstance(value, dict):
    return "{" + ", ".join(f"{gin_value(k)}: {gin_value(v)}" for k, v in value.items()) + "}"
  if isinstance(value, (list, tuple)):
    inner = ", ".join(gin_value(v) for v in value)
    return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
  return repr(value)


def gin_binding(name: str, value) -> str:
  return f"{name} = {gin_value(value)}"


def search(plan_with: Callable, experiment: Callable, rollout_mesh: Callable,
           budget: int = 6, log: Callable[[str], None] = print) -> list[Candidate]:
  """Candidates planned, best first (fitting ones by predicted step, then the rest by peak).

  plan_with(bindings) -> Plan json; experiment(bindings) -> the Experiment they build;
  rollout_mesh(exp) -> its rollout mesh's axis sizes; budget: most configs compiled.
  """
  seen: dict[tuple, Candidate] = {}

  def plan(bindings: dict, moves: tuple) -> Candidate:
    key = tuple(gin_binding(k, v) for k, v in sorted(bindings.items()))
    if key not in seen:
      log(f"fit: planning {' + '.join(moves) or 'the config as it is'}")
      try:
        seen[key] = Candidate(key, moves, plan_with(list(key)))
      except UserError as e:  # A move this config cannot take (a mesh that does not divide).
        seen[key] = Candidate(key, moves, None, str(e))
      c = seen[key]
      log(f"fit:   {'fits' if c.fits else 'does not fit'}, peak {c.peak:.2f} GB, "
          f"step {c.step_s:.3f} s" if c.plan else f"fit:   not plannable: {c.error}")
    return seen[key]

  current = plan({}, ())
  if current.plan is None:
    raise UserError(f"plan --fit: the config itself cannot be planned: {current.error}")
  bindings, tried = {}, set()
  while len(seen) < budget:
    exp = experiment(list(current.bindings))
    mesh = rollout_mesh(exp)
    options = [(m.saving_gb(current.plan), m, m.bindings(exp, mesh)) for m in MOVES
               if m.name not in tried]
    options = [o for o in options if o[2] is not None]
    if not options:
      break
    _, move, extra = max(options, key=lambda o: o[0])
    tried.add(move.name)
    nxt = plan({**bindings, **extra}, current.moves + (move.name,))
    better = (nxt.fits and (not current.fits or nxt.step_s < current.step_s)) or (
        not current.fits and nxt.peak < current.peak)
    if better:
      current, bindings = nxt, {**bindings, **extra}
  fitting = sorted((c for c in seen.values() if c.fits), key=lambda c: c.step_s)
  rest = sorted((c for c in seen.values() if not c.fits), key=lambda c: c.peak)
  return fitting + rest


def report(candidates: list[Candidate], target: str, runners_up: int = 3) -> str:
  """The winning bindings ready to paste, with the runners-up."""
  lines = []
  best = candidates[0]
  if not best.fits:
    lines.append(f"fit: nothing tried fits {target}; closest (peak {best.peak:.2f} GB):")
  else:
    lines.append(f"fit: fastest that fits {target}: predicted step {best.step_s:.3f} s, "
                 f"peak {best.peak:.2f} GB per device ({' + '.join(best.moves) or 'as is'})")
  lines.append("  " + (" ".join(f"--gin_param='{b}'" for b in best.bindings)
                       or "(no bindings: the config fits as it is)"))
  others = [c for c in candidates[1:] if c.plan is not None][:runners_up]
  if others:
    lines.append("runners-up:")
  for c in others:
    verdict = "fits" if c.fits else "does not fit"
    lines.append(f"  {verdict}: step {c.step_s:.3f} s, peak {c.peak:.2f} GB "
                 f"({' + '.join(c.moves) or 'as is'}): "
                 + (" ".join(f"--gin_param='{b}'" for b in c.bindings) or "(no bindings)"))
  return "\n".join(lines)
