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
* remat lighter: one step from the config's remat towards none (full -> dots_no_batch ->
  dots -> none): less recompute in the backward pass for more memory, tried once a set
  fits;
* slots to the pool: as many decode slots as the KV pool holds at the longest sequence
  (whole cascade blocks per data shard, at most a step's samples): fewer where it is
  short of the config's slots, more where it holds more (fewer decode waves). The pool
  is the one the plan of the set's other moves left, where that set was planned (a
  lighter remat leaves less), else that of the largest planned part of them; a set is
  sized again once a nearer plan is known.

A local search over sets of moves. While the config does not fit, the move whose
estimated saving (from the last plan's memory breakdown) is largest is planned next and
kept if it lowers the peak. Once a set fits, each of its moves is taken back in turn and
the others added (a leaner set may let a slower move go), keeping what still fits and is
faster, or as fast and leaner; a set that does not fit but is much faster (a lighter
remat) is kept too, as a detour, so that the move after it frees its memory (more
micro-batches beside the lighter remat); if that one move does not make it fit, the
search goes back to the set it left and tries that move there. Every candidate that
fits is ranked by predicted step: the fastest wins, the others are the runners-up.
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
  # (exp, rollout mesh shape, the plan of the config as it is) -> {gin name: value}, or
  # None (n/a)
  bindings: Callable
  saving_gb: Callable  # (plan json) -> estimated GB per device it frees


def _micro_batches(exp, mesh, base):
  t, r = exp.trainer, exp.rollout
  m = 2 * t.micro_batches
  if (r.prompts_per_step * r.group_size) % (t.minibatches * m):
    return None
  return {"TrainerConfig.micro_batches": m}


def _remat(exp, mesh, base):
  if exp.model.overrides.get("remat", "none") == "full":
    return None
  return {"ModelSpec.overrides": {**exp.model.overrides, "remat": "full"}}


# Remat policies from the most recompute (least memory) to none (models.config).
_REMAT_LADDER = ("full", "dots_no_batch", "dots", "none")


def _lighter_remat(exp, mesh, base):
  """One step down the ladder: what the backward pass recomputes, kept instead (the
  train step's FLOPs fall, its activations grow); None at "none"."""
  remat = exp.model.overrides.get("remat", "none")
  if remat not in _REMAT_LADDER[:-1]:
    return None
  lighter = _REMAT_LADDER[_REMAT_LADDER.index(remat) + 1]
  return {"ModelSpec.overrides": {**exp.model.overrides, "remat": lighter}}


def _reference(exp, mesh, base):
  if exp.reference.dtype == "bfloat16" or exp.trainer.loss.kl_coef <= 0:
    return None
  return {"ReferenceSpec.dtype": "bfloat16"}


def _rollout_tensor(exp, mesh, base):
  data, tensor = mesh["data"], mesh["tensor"]
  if data % 2:
    return None
  return {"rollout_mesh/MeshConfig.data": data // 2, "rollout_mesh/MeshConfig.fsdp": 1,
          "rollout_mesh/MeshConfig.tensor": 2 * tensor,
          "rollout_mesh/MeshConfig.expert": mesh["expert"]}


def _slots(exp, mesh, base):
  """The slots the base plan's pool holds at the longest sequence, at most a step's
  samples, in whole blocks of group_slots per data shard; None where that is the
  config's own number (or not one block)."""
  from jaxrl_post.rollout.layout import batch_shards

  eng, data = exp.rollout.engine, batch_shards(mesh)
  if eng.num_slots is None:
    return None
  per_shard = eng.num_slots // data
  per_slot = base["kv_tokens_needed"] // max(per_shard, 1)  # tokens of one slot's sequence
  unit = max(eng.group_slots, 1)
  samples = -(-exp.rollout.prompts_per_step * exp.rollout.group_size // data)
  held = min(base["kv_tokens"] // max(per_slot, 1), max(samples, unit)) // unit * unit
  if held < unit or held == per_shard:
    return None
  return {"EngineConfig.num_slots": held * data}


def _kv_short(plan) -> float:
  """GB per device the KV pool lacks for the slots' need (0 when it holds them)."""
  tokens = plan["kv_tokens_needed"] - plan["kv_tokens"]
  return max(tokens, 0) * plan["resident_gb"]["kv_pool"] / max(plan["kv_tokens_needed"], 1)


_SLOTS = "slots to the pool"
MOVES = (
    Move("micro_batches x2", _micro_batches, lambda p: p["memory_gb"]["train"]["temp"] / 2),
    Move("remat full", _remat, lambda p: p["memory_gb"]["train"]["temp"] / 2),
    Move("reference bfloat16", _reference, lambda p: p["resident_gb"]["reference"] / 2),
    Move("rollout tensor x2", _rollout_tensor,
         lambda p: p["resident_gb"]["rollout_weights"] / 2),
    Move(_SLOTS, _slots, lambda p: 2 * _kv_short(p)),
    Move("remat lighter", _lighter_remat, lambda p: -p["memory_gb"]["train"]["temp"]),
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


def _bindings_for(moves: frozenset, experiment: Callable, rollout_mesh: Callable,
                  base: dict):
  """The bindings of a set of moves, applied in MOVES order (each sees the config the
  earlier ones made; `base` is the plan whose KV pool the slots are sized to); None if
  one of them does not apply."""
  bindings: dict = {}
  for m in MOVES:
    if m.name in moves:
      exp = experiment(_lines(bindings))
      extra = m.bindings(exp, rollout_mesh(exp), base)
      if extra is None:
        return None
      bindings.update(extra)
  return bindings


def _lines(bindings: dict) -> list[str]:
  return [gin_binding(k, v) for k, v in sorted(bindings.items())]


def _neighbours(current: Candidate, moves: frozenset) -> list[frozenset]:
  """Move sets one move away, in the order worth trying: while it does not fit, moves by
  their estimated saving; once it fits, first each move taken back (memory moves cost
  speed: micro-batches and remat recompute, narrower replicas decode fewer sequences at
  once), then the others, those that free least (or cost memory for speed) first."""
  adds = sorted((m for m in MOVES if m.name not in moves),
                key=lambda m: -m.saving_gb(current.plan))
  if not current.fits:
    return [moves | {m.name} for m in adds]
  # Fitting: the moves that free least first (those that cost memory buy speed).
  return ([moves - {m.name} for m in MOVES if m.name in moves] +
          [moves | {m.name} for m in reversed(adds)])


# How much faster a set that does not fit must be for the search to go on from it (for
# one move: if the move that frees most beside it does not make it fit, the search goes
# back to the set it left and tries that move there, then that set's other moves).
_DETOUR = 0.02


def _better(nxt: Candidate, current: Candidate) -> bool:
  if not current.fits:
    return nxt.fits or nxt.peak < current.peak
  if not nxt.fits:
    # Much faster but over (a lighter remat): a detour. From a set that does not fit the
    # next move frees memory, the largest saving first (more micro-batches), which can
    # make it fit while it keeps most of its speed; what fits is ranked by step either way.
    return nxt.plan is not None and nxt.step_s < current.step_s * (1 - _DETOUR)
  faster = nxt.step_s < current.step_s * (1 - 1e-3)
  leaner = nxt.step_s <= current.step_s * 1.02 and nxt.peak < current.peak
  return faster or leaner


def _pool_source(option: frozenset, seen: dict) -> frozenset:
  """The planned set whose KV pool `option`'s slots are sized to: its other moves if they
  were planned, else the planned subset of them with the most moves (the pool nearest
  the one they would leave; the config's own at worst)."""
  others = option - {_SLOTS}
  return max((s for s, c in seen.items() if s <= others and c.plan is not None),
             key=lambda s: (len(s), sorted(s)))


def search(plan_with: Callable, experiment: Callable, rollout_mesh: Callable,
           budget: int = 6, log: Callable[[str], None] = print) -> list[Candidate]:
  """Candidates planned, best first (fitting ones by predicted step, then the rest by peak).

  A local search over sets of moves: from the current set, the first untried neighbour
  (see _neighbours) is planned and becomes current if _better; it stops when `budget`
  configs were compiled or no neighbour is left.
  plan_with(bindings) -> Plan json; experiment(bindings) -> the Experiment they build;
  rollout_mesh(exp) -> its rollout mesh's axis sizes.
  """
  seen: dict[frozenset, Candidate] = {}
  # (set, the set whose pool its slots were sized to): a set the slots move found nothing
  # to change for under one pool is tried again once a closer set's pool is known.
  inapplicable: set[tuple[frozenset, frozenset]] = set()

  def plan(moves: frozenset, bindings: dict) -> Candidate:
    names = tuple(m.name for m in MOVES if m.name in moves)
    log(f"fit: planning {' + '.join(names) or 'the config as it is'}")
    lines = tuple(_lines(bindings))
    try:
      c = Candidate(lines, names, plan_with(list(lines)))
    except UserError as e:  # A move this config cannot take (a mesh that does not divide).
      c = Candidate(lines, names, None, str(e))
    log(f"fit:   {'fits' if c.fits else 'does not fit'}, peak {c.peak:.2f} GB, "
        f"step {c.step_s:.3f} s" if c.plan else f"fit:   not plannable: {c.error}")
    seen[moves] = c
    return c

  moves = frozenset()
  current = plan(moves, {})
  if current.plan is None:
    raise UserError(f"plan --fit: the config itself cannot be planned: {current.error}")
  left = None  # (moves, candidate) a detour left: where the search goes on if it fails.
  first: list[frozenset] = []  # A set to try before the current set's neighbours.
  while len(seen) < budget:
    options, first = [*first, *_neighbours(current, moves)], []
    for option in options:
      pool_of = _pool_source(option, seen)
      if option in seen or (option, pool_of) in inapplicable:
        continue
      bindings = _bindings_for(option, experiment, rollout_mesh, seen[pool_of].plan)
      if bindings is None:
        inapplicable.add((option, pool_of))
        continue
      nxt = plan(option, bindings)
      if left is not None and not nxt.fits:  # The detour's one move did not make it fit:
        # back to the set it left, that move tried there first (it frees the most, which
        # may let a slower move be taken back).
        first = [left[0] | (option - moves)]
        (moves, current), left = left, None
      elif _better(nxt, current):
        if current.fits and not nxt.fits:
          left = (moves, current)
        elif nxt.fits:
          left = None
        current, moves = nxt, option
      break
    else:  # Nothing left to try from here: back from a detour, or done.
      if left is None:
        break
      (moves, current), left = left, None
  planned = [c for c in seen.values() if c.plan is not None]
  fitting = sorted((c for c in planned if c.fits), key=lambda c: c.step_s)
  rest = sorted((c for c in planned if not c.fits), key=lambda c: c.peak)
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
