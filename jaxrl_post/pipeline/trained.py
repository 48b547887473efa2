"""The trained policy of a run directory: its config, the checkpoint's weights, its tokenizer.

Export, generation and stand-alone evaluation read a run back without rebuilding it: the
model config comes from the run's own config.gin (written by `train.prepare`), and only the
parameters are restored from the Orbax checkpoint, as host arrays, so no mesh, optimizer or
device layout of the training run is needed (a run trained on 8 GPUs exports on a laptop).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import gin
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.checkpoint import read_stored, shape_difference
from jaxrl_post.errors import UserError
from jaxrl_post.models import PRESETS, EMBEDDED, ModelConfig, Tokenizer, Transformer, preset
from jaxrl_post.models.hf_export import merge_lora
from jaxrl_post.models.presets import embedded_path
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import abstract_model, params_of, with_params
from jaxrl_post.pipeline import config as run_config
from jaxrl_post.pipeline.config import ModelSpec


@dataclasses.dataclass(frozen=True)
class TrainedPolicy:
  """A checkpoint's policy: `params` are host arrays shaped as `config` says (LoRA adapters
  still separate when config.lora is set)."""

  config: ModelConfig
  params: dict
  tokenizer: Tokenizer
  step: int
  workdir: str

  def merged(self) -> tuple[ModelConfig, dict]:
    """Config and params with LoRA adapters folded in (unchanged without LoRA)."""
    return merge_lora(self.config, self.params)

  def model(self, compute_dtype: Optional[str] = None) -> Transformer:
    """A Transformer holding these weights (adapters merged), on the default device."""
    cfg, params = self.merged()
    if compute_dtype:
      cfg = cfg.replace(compute_dtype=compute_dtype)
    dtype = jnp.dtype(cfg.param_dtype)
    return with_params(abstract_model(cfg), jax.tree.map(lambda x: jnp.asarray(x, dtype), params))


def checkpoint_steps(workdir: str) -> list[int]:
  """Complete checkpoint steps under WORKDIR/checkpoints, oldest first.

  Orbax writes a step into a temporary directory and renames it to the bare step number
  once complete, so only all-digit names are finished checkpoints.
  """
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n, "state")))


def resolve_step(workdir: str, step: Optional[int]) -> int:
  """The requested step (default: the newest), or a one-line UserError."""
  steps = checkpoint_steps(workdir)
  if not steps:
    raise UserError(f"{workdir}: no checkpoint (no complete step under "
                    f"{os.path.join(workdir, 'checkpoints')}; train with python -m "
                    f"jaxrl_post.train --workdir={workdir} first)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise UserError(f"{workdir}: no checkpoint at step {step} (steps saved: "
                    f"{', '.join(map(str, steps))})")
  return step


def read_model_spec(workdir: str) -> ModelSpec:
  """The run's ModelSpec, from the config.gin that training wrote into the workdir."""
  path = os.path.join(workdir, "config.gin")
  if not os.path.isfile(path):
    raise UserError(f"{path}: file not found (python -m jaxrl_post.train writes it)")
  run_config.parse([path], [])
  try:
    with gin.config_scope("model"):  # Where Experiment builds its ModelSpec.
      return run_config.CONFIGURABLES["ModelSpec"]()
  except (TypeError, ValueError) as e:
    raise UserError(f"{path}: cannot build ModelSpec ({str(e).splitlines()[0]})") from e


def policy_config(spec: ModelSpec) -> tuple[ModelConfig, Tokenizer]:
  """The config and tokenizer `load_policy` would give, without reading any weights."""
  from jaxrl_post.models.gguf_file import GGUFFile, config_from_gguf
  from jaxrl_post.models.hf import config_from_hf, read_json
  from jaxrl_post.models.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

  overrides = dict(spec.overrides)
  if spec.lora is not None:
    overrides["lora"] = spec.lora
  source = spec.source
  if source in PRESETS:
    return preset(source, **overrides), char_tokenizer()
  from jaxrl_post.models import hub
  source = hub.local_source(source, weights=False)
  if os.path.isdir(source):
    cfg_path = os.path.join(source, "config.json")
    return (config_from_hf(read_json(cfg_path), cfg_path, **overrides),
            tokenizer_from_hf_dir(source))
  path = embedded_path(source) if source in EMBEDDED else source
  if not os.path.isfile(path):
    raise UserError(f"ModelSpec.source {source!r}: no such preset, embedded model, GGUF file, "
                    "model directory or hub id (a relative path is read from the current "
                    "directory)")
  f = GGUFFile(path)
  return config_from_gguf(f, **overrides), tokenizer_from_gguf(f.meta, path)


def restore_params(workdir: str, step: int) -> dict:
  """The checkpoint's full parameters (trainable + frozen) as host numpy arrays."""
  import orbax.checkpoint as ocp
  from absl import logging

  from jaxrl_post.rl.trainer import merge_params

  # Orbax warns through absl about reading a checkpoint it did not open for writing.
  logging.set_verbosity(logging.ERROR)
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  checkpointer = ocp.PyTreeCheckpointer()

  def read():
    tree = checkpointer.metadata(path).item_metadata
    if tree is None:  # Orbax logs why and returns nothing: its index of the arrays.
      raise UserError(f"{path}: cannot read the checkpoint (the index of its arrays is "
                      "unreadable: cut short or corrupted)")
    wanted = {k: tree[k] for k in ("params", "frozen") if k in tree and tree[k]}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=wanted, restore_args=restore_args, partial_restore=True))

  out = read_stored(read, lambda what: f"{path}: cannot read the checkpoint ({what})")
  return merge_params(out.get("params", {}), out.get("frozen", {}))


def _check_shapes(cfg: ModelConfig, params: dict, where: str) -> None:
  differs = shape_difference(params, params_of(abstract_model(cfg)), "params",
                             "its config.gin")
  if differs:
    raise UserError(f"{where}: checkpoint does not match the run's config.gin ({differs})")


def load_trained(workdir: str, step: Optional[int] = None) -> TrainedPolicy:
  """The policy saved at `step` (default: the newest complete checkpoint) of a run."""
  step = resolve_step(workdir, step)
  cfg, tokenizer = policy_config(read_model_spec(workdir))
  params = restore_params(workdir, step)
  _check_shapes(cfg, params, os.path.join(workdir, "checkpoints", str(step)))
  return TrainedPolicy(cfg, params, tokenizer, step, workdir)
