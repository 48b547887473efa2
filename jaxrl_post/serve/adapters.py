"""Many LoRA adapters of one rank over one frozen base model, trained in batched programs.

The adapters live stacked on a slot axis: each LoRA matrix is [L, S, ...] for S slots
(L layers first, so the layer scan slices it as it slices the base weights; over a base
split per layer, as on a GPU, each unrolled layer takes its own index). A batch
of datums from several adapters runs as ONE forward/backward: each row gathers its
adapter ([L, B, ...]; models.transformer._dense applies one adapter per row), the loss
is the sum of every row's, and the gradient of the gather adds each row's gradient into
its own slot. Gradients accumulate per slot until that adapter's optim_step, which
updates only its slot (AdamW with the step's hyperparameters and the slot's own step
count), so adapters never see each other's data or weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_post.errors import UserError
from jaxrl_post.kernels import ChunkedLogprobConfig
from jaxrl_post.models.config import LoraConfig, ModelConfig
from jaxrl_post.models.transformer import (abstract_model, group_lora, lora_param_shapes,
                                          with_params)
from jaxrl_post.rl.forward import head_logprobs
from jaxrl_post.rl.packing import bucket
from jaxrl_post.rollout import weights
from jaxrl_post.serve import losses

# LoRA on every matrix of attention and MLP (Tinker's train_attn and train_mlp).
ATTN = ("wq", "wk", "wv", "wo")
MLP = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class Row:
  """One datum of one adapter: N input tokens and per-position loss inputs [N]."""

  slot: int
  tokens: np.ndarray  # [N] int32
  inputs: dict[str, np.ndarray]  # target_tokens and the loss's inputs, each [N]


@dataclasses.dataclass(frozen=True)
class AdamParams:
  learning_rate: float = 1e-4
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-12
  weight_decay: float = 0.0
  grad_clip_norm: float = 0.0


def adapter_shapes(cfg: ModelConfig) -> dict:
  """The adapter of a LoRA model config as float32 shapes, {"layers": {name: [L, ...]}}."""
  return {"layers": {name: jax.ShapeDtypeStruct((cfg.num_layers, *shape), jnp.float32)
                     for name, (shape, _) in lora_param_shapes(cfg).items()}}


def stacked(tree, slots: int):  # [L, ...] leaves -> [L, S, ...] zeros, `slots` slots
  return jax.tree.map(lambda x: jnp.zeros((x.shape[0], slots, *x.shape[1:]), jnp.float32), tree)


class AdapterBank:
  """`capacity` adapter slots of `lora` over `base` (a params_of dict without adapters,
  its layers stacked or split as rollout.weights splits them: Service.base)."""

  def __init__(self, cfg: ModelConfig, base: dict, lora: LoraConfig, capacity: int,
               mesh: Optional[jax.sharding.Mesh] = None):
    self.cfg = cfg.replace(lora=lora)
    self.capacity = capacity
    self.mesh = mesh
    self.row_multiple = 1 if mesh is None else mesh.size
    self.shapes = adapter_shapes(self.cfg)
    replicated = None if mesh is None else NamedSharding(mesh, P())
    self._rows = None if mesh is None else NamedSharding(mesh, P(tuple(mesh.axis_names)))
    place = (lambda t: t) if mesh is None else (lambda t: jax.device_put(t, replicated))
    self.base = place(base)
    # Adapter weights, their accumulated gradients and Adam moments: [L, S, ...] each, four
    # buffers of their own (optim_step donates all four).
    self.lora, self.grads, self.mu, self.nu = (place(stacked(self.shapes, capacity))
                                               for _ in range(4))
    self.steps = np.zeros((capacity,), np.int64)  # optimizer steps taken, per slot
    self.targets = {}  # slot -> the matrices its optimizer trains (the others stay as made)
    self.free = list(range(capacity))
    self.scratch = 0  # Slots set aside for the caller's own use (reserve).

  def reserve(self) -> int:
    """A slot no client gets (e.g. for one-off forwards with another adapter)."""
    self.scratch += 1
    return self.free.pop()

  # ---------------------------------------------------------------- slots

  def allocate(self, seed: int, targets: tuple[str, ...] = ATTN + MLP) -> int:
    """A slot holding a fresh adapter (A random, B zero: a no-op until trained) whose
    optimizer trains the adapters of `targets` only (Tinker's train_attn / train_mlp)."""
    if not self.free:
      raise UserError(f"create_model: all {self.capacity - self.scratch} adapter slots of rank "
                      f"{self.cfg.lora.rank} are in use (start the server with a larger "
                      "ServeConfig.max_adapters)")
    slot = self.free.pop(0)
    self.set_adapter(slot, fresh_adapter(self.shapes, seed), None)
    self.targets[slot] = tuple(targets)
    return slot

  def release(self, slot: int) -> None:
    self.free.append(slot)

  def adapter(self, slot: int) -> dict:
    """The slot's adapter as a params_of-shaped dict of [L, ...] arrays."""
    return jax.tree.map(lambda x: x[:, slot], self.lora)

  def optimizer_state(self, slot: int) -> dict:
    return {"mu": jax.tree.map(lambda x: x[:, slot], self.mu),
            "nu": jax.tree.map(lambda x: x[:, slot], self.nu),
            "steps": np.int64(self.steps[slot])}

  def set_adapter(self, slot: int, adapter: dict, optimizer: Optional[dict]) -> None:
    """Writes an adapter (and its Adam state, or fresh state) into `slot`."""
    put = lambda bank, one: jax.tree.map(lambda b, x: b.at[:, slot].set(x), bank, one)
    self.lora = put(self.lora, adapter)
    self.grads = put(self.grads, jax.tree.map(jnp.zeros_like, adapter))
    zeros = jax.tree.map(jnp.zeros_like, adapter)
    self.mu = put(self.mu, zeros if optimizer is None else optimizer["mu"])
    self.nu = put(self.nu, zeros if optimizer is None else optimizer["nu"])
    self.steps[slot] = 0 if optimizer is None else int(optimizer["steps"])

  # ---------------------------------------------------------------- forward / backward

  def forward_backward(self, rows: list[Row], loss_fn: str, config: dict,
                       forward_only: bool) -> tuple[list[np.ndarray], np.ndarray]:
    """Runs the rows as one batch: (each row's target logprobs [N], each row's loss).
    Without forward_only, adds each row's gradient to its slot's accumulated gradient."""
    loss, config = losses.resolve(loss_fn, config)
    batch = self._batch(rows, loss.inputs)
    program = batch_program(self.cfg, loss_fn, forward_only)
    consts = {k: jnp.float32(v) for k, v in config.items()}
    grads, logp, per_row = program(self.lora, self.grads, self.base, batch, consts)
    if not forward_only:
      self.grads = grads
    logp, per_row = np.asarray(logp), np.asarray(per_row)
    return [logp[i, :len(r.tokens)] for i, r in enumerate(rows)], per_row[:len(rows)]

  def _batch(self, rows: list[Row], names: tuple[str, ...]) -> dict:
    """Rows padded to bucketed [B, T] (bounded recompiles), B a multiple of the devices."""
    width = bucket(max(len(r.tokens) for r in rows), 16)
    n = bucket(len(rows), self.row_multiple)
    out = {"slot": np.zeros((n,), np.int32), "tokens": np.zeros((n, width), np.int32),
           "targets": np.zeros((n, width), np.int32), "mask": np.zeros((n, width), np.float32)}
    out["inputs"] = {k: np.zeros((n, width), np.float32) for k in names}
    for i, r in enumerate(rows):
      m = len(r.tokens)
      out["slot"][i], out["tokens"][i, :m], out["mask"][i, :m] = r.slot, r.tokens, 1.0
      out["targets"][i, :m] = r.inputs["target_tokens"]
      for k in names:
        out["inputs"][k][i, :m] = r.inputs[k]
    if self._rows is not None:
      out = jax.device_put(out, jax.tree.map(lambda _: self._rows, out))
    return out

  # ---------------------------------------------------------------- optimizer

  def optim_step(self, slot: int, hp: AdamParams) -> dict[str, float]:
    """One AdamW step of `slot` on its accumulated gradient, which it then clears."""
    return self.optim_steps([(slot, hp)])[0]

  def optim_steps(self, steps: list[tuple[int, AdamParams]]) -> list[dict[str, float]]:
    """One AdamW step of each (slot, hyperparameters) on the slot's accumulated gradient,
    which it then clears: ONE program for all of them (the slots distinct), so adapters
    whose clients step together pay one call. The slots are padded with others, left as
    they are, to a power of two (bounded recompiles)."""
    slots = [slot for slot, _ in steps]
    if len(set(slots)) != len(slots):
      raise ValueError(f"optim_steps: slots {slots} repeat")
    n = min(self.capacity, bucket(len(slots), 1))
    pad = [s for s in range(self.capacity) if s not in slots][:n - len(slots)]
    for slot in slots:
      self.steps[slot] += 1
    hps = [dataclasses.asdict(hp) for _, hp in steps + [(None, AdamParams())] * len(pad)]
    scalars = {k: jnp.asarray([hp[k] for hp in hps], jnp.float32) for k in hps[0]}
    count = jnp.asarray([self.steps[s] for s in slots] + [1] * len(pad), jnp.float32)
    targets = [self.targets.get(s, ATTN + MLP) for s in slots] + [()] * len(pad)
    trains = {"layers": {name: jnp.asarray([name.rsplit("_lora_", 1)[0] in t for t in targets])
                         for name in self.shapes["layers"]}}  # [k] per matrix: live and trained
    live = jnp.asarray([True] * len(slots) + [False] * len(pad))
    self.lora, self.grads, self.mu, self.nu, norms = adam_program(
        self.lora, self.grads, self.mu, self.nu, jnp.asarray(slots + pad, jnp.int32), live,
        trains, count, scalars)
    return [{"grad_norm": float(x)} for x in np.asarray(norms)[:len(slots)]]


def fresh_adapter(shapes: dict, seed: int) -> dict:
  """A new adapter of `shapes` (adapter_shapes): A ~ N(0, 1 / fan_in), as PEFT's Kaiming
  init scales it, so the first steps' gradients on B are not scaled down by a tiny A;
  B = 0, so it starts as a no-op."""
  keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(shapes))))

  def init(path, x):
    if str(path[-1].key).endswith("_lora_b"):
      return jnp.zeros(x.shape, jnp.float32)
    fan_in = int(np.prod(x.shape[1:-1]))  # [L, in..., r]
    return jax.random.normal(next(keys), x.shape, jnp.float32) / np.sqrt(fan_in)

  return jax.tree_util.tree_map_with_path(init, shapes)


def bind_rows(model, base: dict, lora: dict, slot):
  """(`model` bound to `base` with each row's adapter gathered from `lora` ([L, S, ...]
  leaves) by `slot` [B], the per-layer weights or None).

  `base` is stacked or in the engines' split form (rollout.weights: on a GPU); split, each
  layer's adapters are gathered beside its base buffers and the forward unrolls them."""
  per_row = jax.tree.map(lambda x: jnp.take(x, slot, axis=1), lora["layers"])  # [L, B, ...]
  if not weights.is_split(base):
    return with_params(model, {**base, "layers": {**base["layers"], **per_row}}), None
  # Unrolled, a layer's weights may hold more than the model's own: the A's of matrices that
  # read the same input side by side (group_lora, laid out once for all layers), so each
  # group's low-rank product is one matmul a layer.
  per_row = group_lora(model.config, per_row)
  bound, layers = weights.bind(model.config, base)
  return bound, tuple({**p, **jax.tree.map(lambda x, i=i: x[i], per_row)}
                      for i, p in enumerate(layers))


@functools.lru_cache(maxsize=None)
def batch_program(cfg: ModelConfig, loss_fn: str, forward_only: bool):
  """The jitted batched forward(/backward) of one loss (cached per model and loss)."""
  loss, model = losses.LOSSES.get(loss_fn), abstract_model(cfg)

  def total_loss(lora, base, batch, config):
    m, layers = bind_rows(model, base, lora, batch["slot"])
    b, t = batch["tokens"].shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    segments = batch["mask"].astype(jnp.int32)
    hidden, _ = m.forward_routed(batch["tokens"], positions, segments, layers=layers)  # [B, T, D]
    lp, _ = head_logprobs(hidden.reshape(1, b * t, -1), m.lm_head_weight().astype(hidden.dtype),
                          batch["targets"].reshape(1, b * t), 1.0, ChunkedLogprobConfig())
    lp = lp.reshape(b, t) * batch["mask"]
    per_token = loss.fn(lp, batch["inputs"], batch["mask"], config)
    per_row = jnp.sum(per_token, axis=-1)
    return jnp.sum(per_row), (lp, per_row)

  def run(lora, grads, base, batch, config):
    if forward_only:
      _, (lp, per_row) = total_loss(lora, base, batch, config)
      return grads, lp, per_row
    g, (lp, per_row) = jax.grad(total_loss, has_aux=True)(lora, base, batch, config)
    return jax.tree.map(jnp.add, grads, g), lp, per_row

  return jax.jit(run, donate_argnums=() if forward_only else (1,))


@functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
def adam_program(lora, grads, mu, nu, slots, live, trains, count, hp):
  """AdamW on the k distinct `slots`: decoupled weight decay, optional clipping of each
  slot's global norm. count and every hp value are [k], per slot; `trains` (lora's tree of
  [k] bools) says which matrices of which slots it updates, the others keeping their
  weights and moments; the gradients of the `live` slots are cleared (a padding slot's
  stays)."""
  bank = {"lora": lora, "grads": grads, "mu": mu, "nu": nu}
  old = jax.tree.map(lambda x: x[:, slots], bank)  # [L, k, ...] leaves
  at = lambda a, x: a.reshape((1, -1) + (1,) * (x.ndim - 2))  # [k] -> broadcast over x
  g = jax.tree.map(lambda x, t: jnp.where(at(t, x), x, 0.0), old["grads"], trains)
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(x), axis=(0, *range(2, x.ndim)))
                      for x in jax.tree.leaves(g)))  # [k]
  clip = hp["grad_clip_norm"]
  g = jax.tree.map(lambda x: at(jnp.where(clip > 0, jnp.minimum(1.0, clip / (norm + 1e-6)),
                                          1.0), x) * x, g)
  b1, b2 = hp["beta1"], hp["beta2"]
  m = jax.tree.map(lambda m1, g1: at(b1, g1) * m1 + at(1 - b1, g1) * g1, old["mu"], g)
  v = jax.tree.map(lambda v1, g1: at(b2, g1) * v1 + at(1 - b2, g1) * jnp.square(g1),
                   old["nu"], g)
  c1, c2 = 1 - b1 ** count, 1 - b2 ** count

  def update(p1, m1, v1):
    step = (m1 / at(c1, p1)) / (jnp.sqrt(v1 / at(c2, p1)) + at(hp["eps"], p1))
    return p1 - at(hp["learning_rate"], p1) * (step + at(hp["weight_decay"], p1) * p1)

  new = {"lora": jax.tree.map(update, old["lora"], m, v), "mu": m, "nu": v,
         "grads": jax.tree.map(jnp.zeros_like, g)}
  which = {"lora": trains, "mu": trains, "nu": trains,
           "grads": jax.tree.map(lambda _: live, trains)}
  out = {name: jax.tree.map(lambda x, y, z, t: x.at[:, slots].set(jnp.where(at(t, y), y, z)),
                            bank[name], new[name], old[name], which[name]) for name in bank}
  return out["lora"], out["grads"], out["mu"], out["nu"], norm
