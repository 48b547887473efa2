"""Checkpoints: round trip, keep-N, and a save cut off mid-write is never loaded."""

import gc
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.checkpoint import CheckpointConfig, Checkpointer, abstract_like
from jaxrl_post.errors import UserError


def _state(seed):
  k = jax.random.key(seed)
  return {"w": jax.random.normal(k, (4, 8)), "step": jnp.int32(seed),
          "opt": (jnp.ones((8,)) * seed, {"mu": jnp.zeros((4, 8), jnp.bfloat16)})}


def _equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b)))


def test_round_trip_keeps_last_n(tmp_path):
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig(keep=2))
  for step in range(4):
    ckpt.save(step, _state(step), {"step": step, "it": {"next_index": 3 * step}}, _state(9))
  ckpt.wait()
  assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
  state, ref, meta = ckpt.restore(3, abstract_like(_state(0)), abstract_like(_state(0)))
  assert _equal(state, _state(3)) and _equal(ref, _state(9))
  assert meta == {"step": 3, "it": {"next_index": 9}}
  ckpt.close()


def test_partial_save_is_never_loaded_and_is_cleaned_up(tmp_path):
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig(keep=3, async_save=False))
  ckpt.save(1, _state(1), {"step": 1})
  ckpt.close()
  # What a process killed while writing step 2 leaves: a temporary directory, half full.
  partial = tmp_path / "2.orbax-checkpoint-tmp-1234567"
  shutil.copytree(tmp_path / "1", partial)
  for root, _, files in os.walk(partial):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(max(0, os.path.getsize(os.path.join(root, name)) // 2))
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig(keep=3))
  assert ckpt.latest_step() == 1
  state, _, meta = ckpt.restore(1, abstract_like(_state(0)))
  assert _equal(state, _state(1)) and meta == {"step": 1}
  # Never read; removed by a thread Orbax starts with the manager (it joins it only before
  # the next save), so the removal is awaited here rather than assumed done.
  deadline = time.monotonic() + 60
  while partial.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not partial.exists()
  ckpt.close()


def test_restore_into_a_different_structure_is_a_clear_error(tmp_path):
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
  ckpt.save(0, _state(0), {"step": 0})
  other = {"w": jax.ShapeDtypeStruct((5, 8), jnp.float32)}
  with pytest.raises(UserError, match="does not match"):
    ckpt.restore(0, other)
  # The first array that differs, by its path, before Orbax starts reading any.
  wider = abstract_like(_state(0))
  wider["opt"][1]["mu"] = jax.ShapeDtypeStruct((4, 9), jnp.bfloat16)
  with pytest.raises(UserError, match=r"\(state opt\.1\.mu is \(4, 8\) in the checkpoint, "
                                      r"\(4, 9\) in this run\)"):
    ckpt.restore(0, wider)
  more = {**abstract_like(_state(0)), "v": jax.ShapeDtypeStruct((3,), jnp.float32)}
  with pytest.raises(UserError, match=r"\(state v is not in the checkpoint\)"):
    ckpt.restore(0, more)
  with pytest.raises(UserError, match=r"\(it holds no reference\)"):
    ckpt.restore(0, abstract_like(_state(0)), {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)})
  ckpt.close()


def test_a_corrupted_step_is_one_line_naming_the_file_and_the_step_to_resume_from(tmp_path,
                                                                                  capfd):
  ckpt = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
  for step in (0, 1):
    ckpt.save(step, _state(step), {"step": step})
  for root, _, files in os.walk(tmp_path / "1" / "state"):
    for name in files:  # The arrays' chunks cut short, the step's index intact.
      if os.sep + "d" in root:
        os.truncate(os.path.join(root, name), 10)
  capfd.readouterr()
  with pytest.raises(UserError, match=r"/1: checkpoint cannot be read \(OUT_OF_RANGE: "
                                      r".* is not valid for value of size 10\); move it away "
                                      r"to resume from step 0$"):
    ckpt.restore(1, abstract_like(_state(0)))
  gc.collect()  # Orbax's other reads, failing after the first, are not printed.
  time.sleep(0.5)
  assert "Traceback" not in capfd.readouterr().err
  state, _, _ = ckpt.restore(0, abstract_like(_state(0)))
  assert _equal(state, _state(0))
  ckpt.close()


def test_config_validation():
  with pytest.raises(UserError, match="keep"):
    CheckpointConfig(keep=0)
