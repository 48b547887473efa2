"""The rollout engine's copy of the weights: stacked layers, or one buffer per layer.

The model keeps each decoder parameter stacked over its layers ([L, ...]) and its forward
scans them. Each scan step then takes its layer's slice of every stacked matrix. XLA:TPU
reads such a slice in place; XLA:GPU copies it into a buffer of its own before the matmul
reads it, so on a GPU a decode step reads every weight twice and writes it once (on one
H100, Llama-3.2-1B at 64 slots: 112 copies a step, 37% of the step's device time).

So on a GPU the engine holds the layers split -- `params["layers"]` a tuple of L dicts of
per-layer arrays, made once per weight version -- and its programs unroll the layers over
them (rollout.forward): every matmul reads its weights where they lie. Which form a
program gets is static (RolloutLayout.split_layers), so each form compiles its own program.
A run's weight sync writes the split form itself (SplitLayers), so the layers live on the
devices once; weights handed over stacked are split by the engine, a second copy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.models.transformer import Transformer, abstract_model, params_of, with_params


def is_split(params: dict) -> bool:
  return isinstance(params["layers"], (tuple, list))


def _layer_sharding(sharding):
  """The sharding of one layer's slice of a stacked array sharded as `sharding`."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
  return sharding


def _by_layer(tree: dict, num_layers: int, take) -> dict:
  """`tree` with its stacked "layers" as a tuple of per-layer trees, leaf i of layer i
  being take(leaf, i); a tree without layers (a sync's half holding none) as it is."""
  if "layers" not in tree or is_split(tree):
    return tree
  layers = tree["layers"]
  return {**tree, "layers": tuple(jax.tree.map(lambda w, i=i: take(w, i), layers)
                                  for i in range(num_layers))}


@dataclasses.dataclass(frozen=True)
class SplitLayers:
  """The engine's per-layer form of a weight tree, for a program that writes the weights
  (the weight sync: sharding.sync's `form`): made there, the layers exist once on the
  devices, the sync's output being the engine's own buffers; split by the engine from a
  stacked tree they would exist twice (the sync recycles its stacked copy)."""

  num_layers: int

  def __call__(self, tree: dict) -> dict:  # Inside a jitted program: slices.
    return _by_layer(tree, self.num_layers, lambda w, i: w[i])

  def shardings(self, tree: dict) -> dict:
    return _by_layer(tree, self.num_layers, lambda s, i: _layer_sharding(s))

  def abstract(self, tree: dict) -> dict:
    one = lambda w, i: jax.ShapeDtypeStruct(
        w.shape[1:], w.dtype, sharding=_layer_sharding(getattr(w, "sharding", None)))
    return _by_layer(tree, self.num_layers, one)


def engine_form(cfg: ModelConfig, mesh, split_layers: bool | None = None) -> SplitLayers | None:
  """The form an engine on `mesh` holds its weights in (`split_layers` as
  EngineConfig.split_layers): SplitLayers when it splits them, None for the model's own
  stacked tree."""
  from jaxrl_post.rollout.layout import RolloutLayout
  split = RolloutLayout.build(cfg, mesh, split_layers).split_layers
  return SplitLayers(cfg.num_layers) if split else None


@functools.lru_cache(maxsize=None)
def _splitter(form: SplitLayers, treedef, shardings: tuple):
  return jax.jit(form, out_shardings=jax.tree.unflatten(treedef, shardings))


def split_layers(params: dict, num_layers: int) -> dict:
  """`params` (placed, stacked layers) with its layers as a tuple of per-layer dicts.

  A copy: the caller's stacked arrays stay valid (a run's weight sync makes the split
  form itself instead: SplitLayers), so held beside them the layers exist twice.
  """
  if is_split(params):
    return params
  form = SplitLayers(num_layers)
  leaves, treedef = jax.tree.flatten(form.shardings(jax.tree.map(lambda w: w.sharding,
                                                                 params)))
  return _splitter(form, treedef, tuple(leaves))(params)


def abstract_split(params: dict, num_layers: int) -> dict:
  """Shapes (jax.ShapeDtypeStruct) of `split_layers(params)` for abstract `params`."""
  return SplitLayers(num_layers).abstract(params)


def template(cfg: ModelConfig) -> Transformer:
  """The model's structure with abstract weights: what the engine binds its weights to."""
  return abstract_model(cfg)


def bind(cfg: ModelConfig, params: dict) -> tuple[Transformer, tuple[dict, ...] | None]:
  """(the model bound to `params`, its per-layer weights or None when stacked).

  With split layers the model's own stacked layers stay abstract shapes: the forward
  takes each layer's weights from the tuple instead (rollout.forward).
  """
  model = template(cfg)
  if not is_split(params):
    return with_params(model, params), None
  stacked = params_of(model)["layers"]
  return with_params(model, {**params, "layers": stacked}), tuple(params["layers"])
