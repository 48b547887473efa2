"""The mixture-of-experts feed-forward block: top-k softmax router, dropless experts.

Every token goes to its k chosen experts; none is dropped for capacity. The (token, choice)
pairs are sorted by expert and each expert's rows run as one group of a grouped matmul
(`jax.lax.ragged_dot`), so the work is the k experts' FLOPs per token, not E's.

Routing replay: given the expert ids the rollout engine chose for each token (recorded),
the block takes those experts instead of its own top-k, and computes their gates from its
own router probabilities at them -- the tokens go through the experts that produced them,
and the router still gets a gradient. Tokens with no recorded ids (id -1) use their own
choice. Recorded ids that are not replayed are still compared with the router's own
choice, which is how often replay changes anything.

Experts are sharded over the mesh's "expert" axis when the active rules give it one (see
sharding.rules), and so are the tokens: attention and the dense layers run on each
device's own tokens, and the expert block moves them to the shards holding their experts
and back (_sharded_experts).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_post.models.config import ModelConfig
from jaxrl_post.sharding import active_rules, logical_to_spec, spec_axes

NO_EXPERT = -1  # A recorded id meaning "not recorded": the token routes itself.


class Routing(NamedTuple):
  """What one MoE layer reports about its routing (stacked to [L, ...] over layers)."""

  experts: jax.Array  # [B, T, k] int32: the router's own top-k (what a rollout records)
  balance: jax.Array  # [] float32: the load-balancing loss of the layer's real tokens
  agree: jax.Array  # [] float32: recorded tokens whose recorded experts are the router's own
  recorded: jax.Array  # [] float32: real tokens that had recorded ids


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
  """Per-layer MoE parameters (without the leading layers axis)."""
  d, e, f = cfg.hidden_size, cfg.moe.num_experts, cfg.moe.intermediate_size
  return {
      "router": ((d, e), ("embed", "router")),  # No rule names "router": every token
      # needs every expert's logit, and the matrix is small.
      "we_gate": ((e, d, f), ("expert", "embed", "mlp")),
      "we_up": ((e, d, f), ("expert", "embed", "mlp")),
      "we_down": ((e, f, d), ("expert", "mlp", "embed")),
  }


def route(cfg: ModelConfig, h, router, replay=None):
  """(expert ids [N, k], gates [N, k] float32, probs [N, E], own top-k [N, k]) of h [N, D].

  replay: [N, k] int32 recorded ids (NO_EXPERT rows route themselves), or None.
  """
  logits = jnp.dot(h, router.astype(h.dtype), preferred_element_type=jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)  # float32, as Hugging Face routes
  _, own = jax.lax.top_k(probs, cfg.moe.experts_per_token)
  ids = own
  if replay is not None:
    recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
    ids = jnp.where(recorded, replay, own)
  gates = jnp.take_along_axis(probs, ids, axis=-1)
  if cfg.moe.norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates, probs, own


def experts_ffn(x, ids, gates, w_gate, w_up, w_down, first_expert=0):
  """sum_j gates[:, j] * expert_{ids[:, j]}(x) over the experts held here.

  Args:
    x: [N, D] tokens.
    ids, gates: [N, k] chosen experts and their weights.
    w_gate, w_up: [E_here, D, F]; w_down: [E_here, F, D] -- experts first_expert.. of E.
    first_expert: global id of the first expert held here.

  Returns:
    [N, D] in x's dtype; pairs whose expert is held elsewhere contribute nothing.
  """
  n, k = ids.shape
  e_here = w_gate.shape[0]
  local = ids.reshape(-1) - first_expert  # [N * k]
  held = (local >= 0) & (local < e_here)
  key = jnp.where(held, local, e_here)  # Pairs held elsewhere sort last, in no group.
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=e_here + 1)[:e_here].astype(jnp.int32)
  rows = jnp.take(x, order // k, axis=0)  # [N * k, D] grouped by expert
  dt = x.dtype
  gate = jax.lax.ragged_dot(rows, w_gate.astype(dt), sizes)
  up = jax.lax.ragged_dot(rows, w_up.astype(dt), sizes)
  out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down.astype(dt), sizes)  # [N * k, D]
  # Back to (token, choice) order by a gather (the inverse permutation), in x's dtype: no
  # float32 [N * k, D] buffer, the largest of a MoE train step.
  pairs = jnp.take(out, jnp.argsort(order), axis=0).reshape(n, k, -1)
  weight = (gates.reshape(-1) * held).reshape(n, k, 1)  # 0 for pairs held elsewhere
  return jnp.sum(pairs.astype(jnp.float32) * weight, axis=1).astype(dt)


def balance_loss(probs, ids, valid, num_experts: int):
  """Switch-style load balancing: E * sum_e (share of choices to e) * (mean prob of e).

  1 when routing is uniform; grows as a few experts take the tokens. Over real tokens
  only (valid [N] bool), so padding does not pull the router.
  """
  w = valid.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(w), 1.0)
  chosen = jnp.sum(jax.nn.one_hot(ids, num_experts) * w[:, None, None], axis=(0, 1))
  share = chosen / (count * ids.shape[1])
  mean_prob = jnp.sum(probs * w[:, None], axis=0) / count
  return num_experts * jnp.sum(share * mean_prob)


def moe_block(cfg: ModelConfig, h, p, recorded=None, valid=None, replay: bool = True):
  """The MoE feed-forward of normed hidden states h [B, T, D] -> ([B, T, D], Routing).

  p holds the layer's router and expert weights; recorded [B, T, k] the rollout's ids
  (NO_EXPERT where none) or None; replay (static) routes by them, else they are only
  compared; valid [B, T] bool real tokens (None: all) for the balance loss and agreement.
  """
  b, t, d = h.shape
  flat = h.reshape(b * t, d)
  rec = None if recorded is None else recorded.reshape(b * t, -1)
  ids, gates, probs, own = route(cfg, flat, p["router"], rec if replay else None)
  out = _sharded_experts(flat, ids, gates, p["we_gate"], p["we_up"], p["we_down"])
  real = jnp.ones((b * t,), bool) if valid is None else valid.reshape(-1)
  if rec is None:
    agree = has = jnp.float32(0.0)
  else:
    has = real & jnp.all(rec >= 0, axis=-1)
    same = jnp.all(jnp.sort(rec, axis=-1) == jnp.sort(own, axis=-1), axis=-1)
    agree, has = jnp.sum(same & has).astype(jnp.float32), jnp.sum(has).astype(jnp.float32)
  routing = Routing(own.reshape(b, t, -1).astype(jnp.int32),
                    balance_loss(probs, ids, real, cfg.moe.num_experts), agree, has)
  return out.reshape(b, t, d), routing


def _sharded_experts(x, ids, gates, w_gate, w_up, w_down):
  """experts_ffn, per expert shard under shard_map when the rules split "expert".

  "expert" is a batch axis too (sharding.rules): each shard of it holds its own tokens.
  The block gathers the tokens of the shards along "expert" (the devices that together
  hold every expert for those tokens), runs the pairs that chose this shard's experts, and
  reduce-scatters the partial outputs back to the tokens' own shards -- dropless, with no
  capacity, and each device's expert FLOPs a 1/E share of the routed pairs. Tokens that
  the expert axis does not divide stay whole on every expert shard and the partial outputs
  are summed instead. Expert matrices split over "tensor" on their hidden (mlp) dimension
  stay split: each tensor shard runs its columns and the outputs are summed over "tensor"
  (gathering them instead would copy every expert matrix in every decode step).
  """
  active = active_rules()
  if active is None:
    return experts_ffn(x, ids, gates, w_gate, w_up, w_down)
  rules, mesh = active
  axis = logical_to_spec(("expert",), (w_gate.shape[0],), rules, mesh)[0]
  if axis is None:
    return experts_ffn(x, ids, gates, w_gate, w_up, w_down)
  rows = logical_to_spec(("batch", None), x.shape, rules, mesh)[0]
  mlp = logical_to_spec(("expert", "embed", "mlp"), w_gate.shape, rules, mesh)[2]
  tp = "tensor" if "tensor" in spec_axes(mlp) and "tensor" not in spec_axes(rows) else None
  tokens = PartitionSpec(rows, None)
  up_spec, down_spec = PartitionSpec(axis, None, tp), PartitionSpec(axis, tp, None)
  per_shard = w_gate.shape[0] // mesh.shape[axis]
  dispatch = axis in spec_axes(rows)

  def local(x, ids, gates, wg, wu, wd):
    first = jax.lax.axis_index(axis) * per_shard
    if dispatch:
      group = [jax.lax.all_gather(a, axis, tiled=True) for a in (x, ids, gates)]
      out = experts_ffn(*group, wg, wu, wd, first)
      out = jax.lax.psum_scatter(out, axis, scatter_dimension=0, tiled=True)
    else:
      out = jax.lax.psum(experts_ffn(x, ids, gates, wg, wu, wd, first), axis)
    return out if tp is None else jax.lax.psum(out, tp)

  return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, up_spec, up_spec,
                                                    down_spec),
                       out_specs=tokens, check_vma=False)(x, ids, gates, w_gate, w_up, w_down)


def recorded_layers(recorded: Optional[jax.Array], num_layers: int):
  """Recorded ids [B, T, L, k] -> per-layer scan inputs [L, B, T, k] (None stays None)."""
  if recorded is None:
    return None
  assert recorded.shape[2] == num_layers, (recorded.shape, num_layers)
  return jnp.moveaxis(recorded.astype(jnp.int32), 2, 0)


def experts_ffn_reference(x, ids, gates, w_gate, w_up, w_down):
  """float32 reference of experts_ffn: every expert on every token, masked by the choices.

  E times the FLOPs: for tests only.
  """
  x = x.astype(jnp.float32)
  weight = jnp.sum(jax.nn.one_hot(ids, w_gate.shape[0]) * gates[..., None], axis=1)  # [N, E]
  hidden = jax.nn.silu(jnp.einsum("nd,edf->enf", x, w_gate)) * jnp.einsum("nd,edf->enf", x,
                                                                            w_up)
  out = jnp.einsum("enf,efd->end", hidden, w_down)  # [E, N, D]
  return jnp.einsum("ne,end->nd", weight, out)
