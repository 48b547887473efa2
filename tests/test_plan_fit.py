"""plan --fit: the search over bindings, and the command a user runs."""

import collections
import json
import os
import re
import subprocess
import sys

import jax

from jaxrl_post.pipeline import config
from jaxrl_post.plan import fit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs/quickstart.gin")


def _experiment(bindings):
  config.parse([QUICKSTART], list(bindings))
  return config.build_experiment()


def _fake_plan(capacity=10.0, rollout_weights=0.0):
  """A plan whose memory follows the bindings: micro-batches halve the train temp, the
  reference in bf16 halves its copy, a wider rollout tensor split divides its weights,
  remat does nothing here; more micro-batches run slower."""
  calls = []

  def plan_with(bindings):
    calls.append(list(bindings))
    exp = _experiment(bindings)
    micro = exp.trainer.micro_batches
    temp = 8.0 / micro
    reference = 2.0 if exp.reference.dtype == "float32" else 1.0
    weights = rollout_weights / exp.placement.rollout_mesh.tensor
    peak = 4.0 + temp + reference + weights
    return {"fits": peak <= capacity, "peak_gb_per_device": peak,
            "predicted_s": {"step": 1.0 + micro / 10},
            "memory_gb": {"train": {"temp": temp}},
            "resident_gb": {"reference": reference, "rollout_weights": weights,
                            "kv_pool": 0.1},
            "kv_tokens": 100, "kv_tokens_needed": 50}
  return plan_with, calls


def _rollout_mesh(exp):
  m = exp.placement.rollout_mesh
  return {"data": 2 // m.tensor, "tensor": m.tensor, "expert": 1}


def test_the_search_takes_the_largest_saving_first_and_ranks_what_fits_by_step():
  plan_with, calls = _fake_plan()
  base = _experiment([])
  found = fit.search(plan_with, _experiment, lambda exp: {"data": 1, "tensor": 1, "expert": 1},
                     budget=4, log=lambda line: None)
  best = found[0]
  # 4 + 8 + 2 = 14 does not fit; micro-batches x2 (saving 4) comes first: 4 + 4 + 2 = 10.
  assert best.fits and best.moves == ("micro_batches x2",)
  assert best.bindings == (f"TrainerConfig.micro_batches = {2 * base.trainer.micro_batches}",)
  assert [c.fits for c in found] == sorted((c.fits for c in found), reverse=True)
  steps = [c.step_s for c in found if c.fits]
  assert steps == sorted(steps) and len(calls) <= 4
  assert not found[-1].fits and found[-1].moves == ()  # The config as it is.
  # The winning bindings are what a user pastes: parsed, they build the planned config.
  assert _experiment(best.bindings).trainer.micro_batches == 2 * base.trainer.micro_batches


def test_a_move_made_early_is_taken_back_once_others_free_enough():
  """Micro-batches x2 (the largest estimated saving) fits first but runs slower; a wider
  rollout split frees enough to take it back: the split alone wins."""
  plan_with, _ = _fake_plan(capacity=16.0, rollout_weights=4.0)  # 4 + 8 + 2 + 4 = 18 GB
  found = fit.search(plan_with, _experiment, _rollout_mesh, budget=10, log=lambda line: None)
  best = found[0]
  assert best.fits and best.moves == ("rollout tensor x2",) and best.peak == 16.0
  assert best.bindings == ("rollout_mesh/MeshConfig.data = 1",
                           "rollout_mesh/MeshConfig.expert = 1",
                           "rollout_mesh/MeshConfig.fsdp = 1",
                           "rollout_mesh/MeshConfig.tensor = 2")
  assert all(best.step_s <= c.step_s for c in found[1:] if c.fits)
  slower = [c for c in found if c.fits and "micro_batches x2" in c.moves]
  assert slower and all(c.step_s > best.step_s for c in slower)  # among the runners-up


def test_slots_shrink_to_what_the_pool_holds_when_it_holds_fewer():
  """The pool holds 3 sequences of the longest length; the slots need 8 (whole blocks of
  group_slots = 2 per data shard): 2 slots fit, which is what the move binds, once."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  experiment = lambda b: _experiment(["EngineConfig.group_slots = 2", *b])
  slots = experiment([]).rollout.engine.num_slots
  per_slot = 100

  def plan_with(bindings):
    n = experiment(bindings).rollout.engine.num_slots
    short = n * per_slot > 3 * per_slot
    return {"fits": not short, "peak_gb_per_device": 4.0 + n, "predicted_s": {"step": 1.0},
            "memory_gb": {"train": {"temp": 0.0}},
            "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.3},
            "kv_tokens": 3 * per_slot, "kv_tokens_needed": n * per_slot}

  found = fit.search(plan_with, experiment, mesh, budget=6, log=lambda line: None)
  assert slots > 3 and found[0].fits and found[0].moves == ("slots to the pool",)
  assert found[0].bindings == ("EngineConfig.num_slots = 2",)


def test_bindings_are_gin_that_a_shell_can_quote():
  line = fit.gin_binding("ModelSpec.overrides", {"remat": "full", "scale": 0.5})
  assert line == 'ModelSpec.overrides = {"remat": "full", "scale": 0.5}' and "'" not in line
  exp = _experiment([line.replace('{"remat": "full", "scale": 0.5}',
                                  '{"remat": "full", "compute_dtype": "float32"}')])
  assert exp.model.overrides["remat"] == "full"


def test_the_report_gives_the_winner_as_pasteable_flags_and_the_runners_up():
  plan = lambda fits, peak, step: {"fits": fits, "peak_gb_per_device": peak,
                                   "predicted_s": {"step": step}}
  found = [fit.Candidate(("ReferenceSpec.dtype = \"bfloat16\"",), ("reference bfloat16",),
                         plan(True, 85.7, 28.1)),
           fit.Candidate(("TrainerConfig.micro_batches = 8",), ("micro_batches x2",),
                         plan(True, 85.2, 31.7)),
           fit.Candidate((), (), plan(False, 100.6, 30.7))]
  lines = fit.report(found, "v5p-8").splitlines()
  assert lines[0].startswith("fit: fastest that fits v5p-8: predicted step 28.100 s")
  assert lines[1] == """  --gin_param='ReferenceSpec.dtype = "bfloat16"'"""
  assert lines[2] == "runners-up:" and "--gin_param='TrainerConfig.micro_batches = 8'" in lines[3]
  assert lines[4].startswith("  does not fit: step 30.700 s, peak 100.60 GB (as is)")
  assert fit.report(found[2:], "v5p-8").startswith("fit: nothing tried fits v5p-8")


def test_plan_fit_on_the_quickstart_prints_json_candidates():
  """The command end to end at a budget of one plan (the search itself is tested above)."""
  out = subprocess.run([sys.executable, "-m", "jaxrl_post.plan", f"--gin_file={QUICKSTART}",
                        "--fit", "--fit_budget=1", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["fits"] and "fit: planning the config as it is" in out.stderr
  (only,) = result["candidates"]
  assert (only["bindings"], only["moves"], only["fits"]) == ([], [], True)
  assert only["peak_gb_per_device"] > 0
  assert only["predicted_step_s"] > 0


def test_slots_grow_to_what_the_pool_holds_up_to_a_steps_samples():
  """A pool with room for more sequences than the slots decode at once: the move binds as
  many slots as it holds (fewer decode waves: a faster predicted step), never more than
  the step's samples."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  base = ["EngineConfig.num_slots = 4", "EngineConfig.group_slots = 2"]
  experiment = lambda b: _experiment([*base, *b])
  samples = experiment([]).rollout.prompts_per_step * experiment([]).rollout.group_size
  per_slot = 100

  def plan_with(held):
    def plan(bindings):
      n = experiment(bindings).rollout.engine.num_slots
      return {"fits": n <= held, "peak_gb_per_device": 4.0,
              "predicted_s": {"step": -(-samples // n)},  # one wave per num_slots samples
              "memory_gb": {"train": {"temp": 0.0}},
              "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.3},
              "kv_tokens": held * per_slot, "kv_tokens_needed": n * per_slot}
    return plan

  found = fit.search(plan_with(11), experiment, mesh, budget=6, log=lambda line: None)
  assert found[0].moves == ("slots to the pool",)
  assert found[0].bindings == ("EngineConfig.num_slots = 10",)  # whole blocks of 2
  found = fit.search(plan_with(10 * samples), experiment, mesh, budget=6, log=lambda l: None)
  assert found[0].bindings == (f"EngineConfig.num_slots = {samples}",)


def test_a_config_that_fits_with_room_takes_a_lighter_remat_when_it_is_faster():
  """Full remat recomputes each layer's forward in the backward pass; with memory to spare
  the search steps down the ladder (full -> dots_no_batch) for a faster predicted step,
  and not where the lighter policy would not fit."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  full = 'ModelSpec.overrides = {"remat": "full"}'
  experiment = lambda b: _experiment([full, *b])
  temp = {"full": 2.0, "dots_no_batch": 5.0, "dots": 9.0, "none": 14.0}

  def plan_with(capacity):
    def plan(bindings):
      remat = experiment(bindings).model.overrides["remat"]
      peak = 4.0 + temp[remat]
      return {"fits": peak <= capacity, "peak_gb_per_device": peak,
              "predicted_s": {"step": {"full": 4.0, "dots_no_batch": 3.2, "dots": 3.1,
                                       "none": 3.0}[remat]},
              "memory_gb": {"train": {"temp": temp[remat]}},
              "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.1},
              "kv_tokens": 100, "kv_tokens_needed": 50}
    return plan

  found = fit.search(plan_with(10.0), experiment, mesh, budget=6, log=lambda line: None)
  assert found[0].moves == ("remat lighter",) and found[0].step_s == 3.2
  assert found[0].bindings == ('ModelSpec.overrides = {"remat": "dots_no_batch"}',)
  found = fit.search(plan_with(7.0), experiment, mesh, budget=6, log=lambda line: None)
  assert found[0].moves == () and found[0].step_s == 4.0  # dots_no_batch needs 9 GB


def test_a_lighter_remat_that_does_not_fit_alone_fits_beside_more_micro_batches():
  """dots_no_batch alone is over the capacity but much faster than full remat: the search
  goes on from it, frees its activations with twice the micro-batches, and that pair
  (slower than the lighter remat alone, faster than full) wins."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  experiment = lambda b: _experiment(['ModelSpec.overrides = {"remat": "full"}', *b])
  micro = experiment([]).trainer.micro_batches

  def plan(bindings):
    exp = experiment(bindings)
    remat, split = exp.model.overrides["remat"], exp.trainer.micro_batches // micro
    temp = {"full": 2.0, "dots_no_batch": 8.0}[remat] / split
    step = {"full": 4.0, "dots_no_batch": 3.0}[remat] + 0.2 * (split - 1)
    return {"fits": 4.0 + temp <= 10.0, "peak_gb_per_device": 4.0 + temp,
            "predicted_s": {"step": step}, "memory_gb": {"train": {"temp": temp}},
            "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.1},
            "kv_tokens": 100, "kv_tokens_needed": 50}

  found = fit.search(plan, experiment, mesh, budget=6, log=lambda line: None)
  assert found[0].moves == ("micro_batches x2", "remat lighter"), found[0]
  assert found[0].fits and found[0].step_s == 3.2
  over = [c for c in found if c.moves == ("remat lighter",)]
  assert over and not over[0].fits  # tried, ranked behind everything that fits


def test_slots_are_sized_to_the_pool_the_other_moves_leave():
  """A lighter remat leaves a smaller KV pool (800 tokens, not 1,600): beside it, the
  slots move sizes the slots to that pool (8 of 100 tokens), not to the config's own (16,
  which would not fit)."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  experiment = lambda b: _experiment(['ModelSpec.overrides = {"remat": "full"}',
                                      "EngineConfig.group_slots = 2",
                                      "EngineConfig.num_slots = 4", *b])

  def plan(bindings):
    exp = experiment(bindings)
    full, n = exp.model.overrides["remat"] == "full", exp.rollout.engine.num_slots
    pool = 1600 if full else 800
    return {"fits": n * 100 <= pool, "peak_gb_per_device": 6.0 if full else 9.0,
            "predicted_s": {"step": (4.0 if full else 3.0) - 0.01 * n},
            "memory_gb": {"train": {"temp": 2.0 if full else 5.0}},
            "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.1},
            "kv_tokens": pool, "kv_tokens_needed": n * 100}

  found = fit.search(plan, experiment, mesh, budget=6, log=lambda line: None)
  assert found[0].moves == ("slots to the pool", "remat lighter"), found[0]
  assert "EngineConfig.num_slots = 8" in found[0].bindings and found[0].fits


def test_slots_beside_an_unplanned_set_are_sized_to_its_nearest_planned_part():
  """Beside a lighter remat (a pool of 800 tokens, not the config's 400) the slots double
  to 8. Adding the bf16 reference to that pair makes a set whose other moves (remat
  lighter + reference) were never planned: its slots are sized to the lighter remat's pool
  (the largest planned part), not the config's, where 4 slots are what the config has
  and the set would be dropped as one the slots move cannot change."""
  mesh = lambda exp: {"data": 1, "tensor": 1, "expert": 1}
  experiment = lambda b: _experiment(['ModelSpec.overrides = {"remat": "full"}',
                                      "EngineConfig.group_slots = 2", "LossConfig.kl_coef = 0.01",
                                      "EngineConfig.num_slots = 4", *b])

  def plan(bindings):
    exp = experiment(bindings)
    full, n = exp.model.overrides["remat"] == "full", exp.rollout.engine.num_slots
    pool = 400 if full else 800
    bf16 = exp.reference.dtype == "bfloat16"
    return {"fits": n * 100 <= pool, "peak_gb_per_device": 6.0,
            "predicted_s": {"step": (4.0 if full else 3.0) - 0.01 * n - 0.1 * bf16},
            "memory_gb": {"train": {"temp": 1.0}},
            "resident_gb": {"reference": 0.0, "rollout_weights": 0.0, "kv_pool": 0.1},
            "kv_tokens": pool, "kv_tokens_needed": n * 100}

  found = fit.search(plan, experiment, mesh, budget=8, log=lambda line: None)
  assert found[0].moves == ("reference bfloat16", "slots to the pool", "remat lighter"), \
      found[0]
  assert "EngineConfig.num_slots = 8" in found[0].bindings and found[0].fits


def test_within_a_search_a_program_compiled_for_one_candidate_is_not_compiled_again(
    monkeypatch):
  """Two configs a slots move apart share their train step and weight sync: planned
  inside compiling_once(), the second compiles only its rollout programs."""
  from jaxrl_post.plan import memory, programs

  compiles = collections.Counter()  # Programs handed to XLA, by module name (jax's own
  real = jax.stages.Lowered.compile  # in-process caches may answer some without a compile).

  def counted(self, *args, **kwargs):
    compiles[re.search(r"module @(\w+)", self.as_text()).group(1)] += 1
    return real(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
  small = ["RolloutSpec.prompts_per_step = 4", "RolloutSpec.group_size = 4",
           "EngineConfig.group_slots = 4", "PlacementConfig.num_devices = 1",
           "PoolConfig.num_pages = None"]
  plan = lambda slots: programs.compile_programs(
      _experiment([*small, f"EngineConfig.num_slots = {slots}"]), jax.devices()[:1])
  with memory.compiling_once():
    once = plan(16)
    first = dict(compiles)
    compiles.clear()
    again = plan(8)
  assert first.get("jit_minibatch_update", 0) >= 1 and first.get("jit_decode_loop") == 1, first
  assert "jit_minibatch_update" not in compiles and compiles.get("jit_decode_loop") == 1, \
      compiles
  assert again.train.compiled == once.train.compiled and again.sync == once.sync
  assert again.decode != once.decode  # Twice the slots' programs, compiled for each.


def test_a_detour_that_one_move_does_not_make_fit_goes_back_to_the_set_it_left():
  """A lighter remat beside 2x micro-batches is much faster but 3 GB over; the wider
  rollout split beside it (the largest saving) frees 1.5 GB, not enough: the search goes
  back to the micro-batches, tries the split there (it fits, faster), then the split
  alone (the fastest that fits), within the budget that the detour would otherwise have
  spent going further over."""
  experiment = lambda b: _experiment(['ModelSpec.overrides = {"remat": "full"}',
                                      "LossConfig.kl_coef = 0.01", *b])
  micro = experiment([]).trainer.micro_batches

  def plan(bindings):
    exp = experiment(bindings)
    remat, split = exp.model.overrides["remat"], exp.trainer.micro_batches // micro
    tensor = exp.placement.rollout_mesh.tensor
    temp = {"full": 3.0, "dots_no_batch": 9.0}[remat] / split
    reference = 2.0 if exp.reference.dtype == "float32" else 1.0
    peak = 4.0 + temp + reference + 3.0 / tensor
    step = {"full": 4.0, "dots_no_batch": 3.0}[remat] + 0.5 * (split - 1) - 0.3 * (tensor - 1)
    return {"fits": peak <= 10.5, "peak_gb_per_device": peak, "predicted_s": {"step": step},
            "memory_gb": {"train": {"temp": temp}},
            "resident_gb": {"reference": reference, "rollout_weights": 3.0 / tensor,
                            "kv_pool": 0.1},
            # A pool of just the slots' need: the slots move has nothing to change.
            "kv_tokens": 100 * exp.rollout.engine.num_slots,
            "kv_tokens_needed": 100 * exp.rollout.engine.num_slots}

  found = fit.search(plan, experiment, _rollout_mesh, budget=6, log=lambda line: None)
  assert found[0].moves == ("rollout tensor x2",) and found[0].fits, found[0]
  assert found[0].step_s == 3.7
  tried = {c.moves for c in found}
  assert ("micro_batches x2", "remat lighter") in tried  # the detour, abandoned after
  assert ("micro_batches x2", "rollout tensor x2", "remat lighter") in tried  # one move
  assert ("micro_batches x2", "rollout tensor x2") in tried  # that move, back where it left
  assert ("micro_batches x2", "reference bfloat16", "rollout tensor x2",
          "remat lighter") not in tried
