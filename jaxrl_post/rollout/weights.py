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
"""

from __future__ import annotations

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


@functools.partial(jax.jit, static_argnames=("num_layers", "shardings"))
def _split(layers: dict, *, num_layers: int, shardings) -> tuple[dict, ...]:
  out = tuple({name: w[i] for name, w in layers.items()} for i in range(num_layers))
  return jax.tree.map(jax.lax.with_sharding_constraint, out,
                      tuple(dict(shardings) for _ in range(num_layers)))


def split_layers(params: dict, num_layers: int) -> dict:
  """`params` (placed, stacked layers) with its layers as a tuple of per-layer dicts.

  A copy: the caller's stacked arrays stay valid (the weight sync recycles them, and a
  LoRA sync keeps their base), so a split engine holds one more copy of the layers.
  """
  if is_split(params):
    return params
  layers = params["layers"]
  shardings = tuple(sorted((name, _layer_sharding(w.sharding)) for name, w in layers.items()))
  return {**params, "layers": _split(layers, num_layers=num_layers, shardings=shardings)}


def abstract_split(params: dict, num_layers: int) -> dict:
  """Shapes (jax.ShapeDtypeStruct) of `split_layers(params)` for abstract `params`."""
  one = lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype,
                                       sharding=_layer_sharding(getattr(w, "sharding", None)))
  layer = {name: one(w) for name, w in params["layers"].items()}
  return {**params, "layers": tuple(dict(layer) for _ in range(num_layers))}


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
