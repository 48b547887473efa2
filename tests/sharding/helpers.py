"""Shared set-up for the sharding tests, and one sharded step + sync that runs in one
process or across several (the two-process worker)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_post.models import ModelConfig, abstract_model, init_model
from jaxrl_post.models.transformer import logical_axes, params_of, with_params
from jaxrl_post.sharding import (TRAINING_RULES, MeshConfig, PlacementConfig, SyncConfig,
                                 WeightSync, build_meshes, tree_shardings)

CFG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                  compute_dtype="float32")


def sharded_init(cfg, mesh, seed=0, rules=TRAINING_RULES):
  """eval_shape -> shardings -> jit(init): parameters are born sharded."""
  abstract = abstract_model(cfg)
  shardings = tree_shardings(logical_axes(abstract), params_of(abstract), rules, mesh)
  return jax.jit(lambda: params_of(init_model(cfg, seed)), out_shardings=shardings)()


def batch(seed=0, b=8, t=16):
  tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
  return tokens, np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))


def loss_fn(cfg):
  model = abstract_model(cfg)

  def loss(params, tokens, positions):
    m = with_params(model, params)
    logp = jax.nn.log_softmax(m.logits(m(tokens, positions))[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

  return loss


def logits_fn(cfg):
  model = abstract_model(cfg)
  return jax.jit(lambda p, t, pos: with_params(model, p).logits(with_params(model, p)(t, pos)))


PLACEMENT = PlacementConfig(trainer_mesh=MeshConfig(fsdp=4, tensor=2),
                            rollout_mesh=MeshConfig(data=4, fsdp=1, tensor=2))


def global_array(x: np.ndarray, mesh, spec):
  """A global array built from each process's own slices (works across processes)."""
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def run_step() -> dict:
  meshes = build_meshes(PLACEMENT)
  train = sharded_init(CFG, meshes.trainer, seed=3)
  tokens, positions = batch(seed=4)
  spec = P(("data", "fsdp"), None)
  tok = global_array(tokens, meshes.trainer, spec)
  pos = global_array(np.ascontiguousarray(positions), meshes.trainer, spec)
  loss, grads = jax.jit(jax.value_and_grad(loss_fn(CFG)))(train, tok, pos)
  grad_norm = jax.jit(lambda g: jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))(grads)

  abstract = abstract_model(CFG)
  sync = WeightSync(meshes, logical_axes(abstract), params_of(abstract), SyncConfig())
  weights = sync(train, sync.initial(train))
  rtok = global_array(tokens, meshes.rollout, P("data", None))
  rpos = global_array(np.ascontiguousarray(positions), meshes.rollout, P("data", None))
  logits = logits_fn(CFG.replace(compute_dtype="bfloat16"))(weights.params, rtok, rpos)
  total = jax.jit(jnp.sum, out_shardings=NamedSharding(meshes.rollout, P()))(logits)
  return {"loss": float(loss), "grad_norm": float(grad_norm), "logits_sum": float(total),
          "version": weights.version}
