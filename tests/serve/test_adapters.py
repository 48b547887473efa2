"""Batched multi-LoRA: one program over several adapters gives each adapter exactly what
it would get alone, and optim_step moves only its own adapter (AdamW as optax's)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_post import models
from jaxrl_post.errors import UserError
from jaxrl_post.models.config import LoraConfig
from jaxrl_post.rollout import weights
from jaxrl_post.models.transformer import init_model, params_of, split_adapters, with_params
from jaxrl_post.serve import losses
from jaxrl_post.serve.adapters import ATTN, MLP, AdamParams, AdapterBank, Row

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "tiny_llama")
LORA = LoraConfig(rank=4, alpha=8.0, targets=ATTN + MLP)
CAPACITY = 4  # One bank shape for every test: their programs compile once.


@pytest.fixture(scope="module")
def base():
  model, _ = models.load(FIXTURE, compute_dtype="float32")
  return model.config, params_of(model)


def _adapter(cfg, seed):  # A random adapter with B non-zero, so it changes the outputs.
  adapter = split_adapters(params_of(init_model(cfg.replace(lora=LORA), seed=seed)))[0]
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape), adapter)


def _rows(slot, seed, lengths, vocab):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    seq = rng.integers(0, vocab, n + 1).astype(np.int32)
    out.append(Row(slot, seq[:-1], {"target_tokens": seq[1:], "weights": rng.random(n),
                                    "logprobs": -rng.random(n) * 3,
                                    "advantages": rng.normal(size=n)}))
  return out


def _alone(cfg, base, adapter, rows, loss_fn):
  """One adapter's logprobs [N] per row and loss gradient, from the plain dense forward."""
  model = init_model(cfg.replace(lora=LORA))
  loss, config = losses.resolve(loss_fn, {})

  def total(adapter):
    params = {**base, "layers": {**base["layers"], **adapter["layers"]}}
    m = with_params(model, params)
    out, lps = 0.0, []
    for r in rows:
      h = m(jnp.asarray(r.tokens)[None], jnp.arange(len(r.tokens))[None])
      logp = jax.nn.log_softmax(m.logits(h)[0], -1)
      lp = logp[jnp.arange(len(r.tokens)), r.inputs["target_tokens"]]
      inputs = {k: jnp.asarray(r.inputs[k], jnp.float32)[None] for k in loss.inputs}
      out = out + jnp.sum(loss.fn(lp[None], inputs, jnp.ones((1, len(r.tokens))), config))
      lps.append(lp)
    return out, lps

  (_, lps), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(adapter)
  return [np.asarray(x) for x in lps], grad


@pytest.mark.parametrize("loss_fn,split", [
    ("cross_entropy", False), ("cross_entropy", True),
    pytest.param("ppo", False, marks=pytest.mark.sweep)])
def test_a_batch_of_two_adapters_gives_each_what_it_gets_alone(base, loss_fn, split):
  """split: the base as a server on a GPU holds it (serve.service.shared_base: replicated
  over the mesh of every device, in the engines' per-layer form), the training program
  unrolling the layers over it and the rows split over the devices; the same logprobs and
  gradients."""
  cfg, params = base
  if split:
    from jaxrl_post.rollout import EngineConfig
    from jaxrl_post.serve.service import shared_base
    from jaxrl_post.sharding import MeshConfig, make_mesh

    mesh = make_mesh(MeshConfig(data=jax.device_count(), fsdp=1))
    shared = shared_base(cfg, params, EngineConfig(split_layers=True), mesh)
    assert weights.is_split(shared)
    bank = AdapterBank(cfg, shared, LORA, CAPACITY, mesh)
  else:
    bank = AdapterBank(cfg, params, LORA, CAPACITY)
  a, b = bank.allocate(0), bank.allocate(1)
  adapters = {a: _adapter(cfg, 10), b: _adapter(cfg, 11)}
  for slot, adapter in adapters.items():
    bank.set_adapter(slot, adapter, None)
  rows = {a: _rows(a, 0, (5, 13), cfg.vocab_size), b: _rows(b, 1, (9,), cfg.vocab_size)}
  batch = rows[b][:1] + rows[a]  # Interleaved on purpose: rows find their own slot.
  lps, per_row = bank.forward_backward(batch, loss_fn, {}, forward_only=False)
  got = {b: lps[:1], a: lps[1:]}
  for slot in (a, b):
    want_lps, want_grad = _alone(cfg, params, adapters[slot], rows[slot], loss_fn)
    for g, w in zip(got[slot], want_lps):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    grad = jax.tree.map(lambda x: x[:, slot], bank.grads)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6),
                 grad, want_grad)
  assert not np.any(np.asarray(jax.tree.leaves(bank.grads)[0][:, 2]))  # The free slot: none.


def test_optim_step_is_adamw_on_its_own_slot_only(base):
  cfg, params = base
  bank = AdapterBank(cfg, params, LORA, CAPACITY)
  a, b = bank.allocate(0), bank.allocate(1)
  before_b = bank.adapter(b)
  hp = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
  ref = optax.adamw(hp.learning_rate, hp.beta1, hp.beta2, hp.eps, weight_decay=hp.weight_decay)
  want, state = bank.adapter(a), None
  state = ref.init(want)
  for step in range(2):
    bank.forward_backward(_rows(a, step, (7,), cfg.vocab_size), "cross_entropy", {}, False)
    grad = jax.tree.map(lambda x: x[:, a], bank.grads)
    updates, state = ref.update(grad, state, want)
    want = optax.apply_updates(want, updates)
    bank.optim_step(a, hp)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
               bank.adapter(a), want)
  jax.tree.map(np.testing.assert_array_equal, bank.adapter(b), before_b)
  assert not np.any(np.asarray(jax.tree.leaves(bank.grads)[0]))  # Cleared by the step.


def test_one_optim_program_steps_several_slots_each_with_its_own_hyperparameters(base):
  """Three adapters stepped together (padded to the bank's four slots with one that holds
  a gradient of its own): each moves as optax's AdamW with its own settings and step count; the
  padding slot keeps its weights, moments and gradient."""
  cfg, params = base
  bank = AdapterBank(cfg, params, LORA, CAPACITY)
  slots = [bank.allocate(i) for i in range(4)]
  stepped, pad = slots[:3], slots[3]
  hps = [AdamParams(learning_rate=1e-2), AdamParams(learning_rate=3e-3, beta1=0.5),
         AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1e-3)]
  refs = [optax.chain(optax.clip_by_global_norm(hp.grad_clip_norm) if hp.grad_clip_norm
                      else optax.identity(),
                      optax.adamw(hp.learning_rate, hp.beta1, hp.beta2, hp.eps,
                                  weight_decay=hp.weight_decay)) for hp in hps]
  want = [bank.adapter(s) for s in stepped]
  states = [ref.init(w) for ref, w in zip(refs, want)]
  bank.optim_step(stepped[0], hps[0])  # Slot 0 is one step ahead: its own bias correction.
  want[0], states[0] = bank.adapter(stepped[0]), refs[0].update(
      jax.tree.map(jnp.zeros_like, want[0]), states[0], want[0])[1]
  for i, slot in enumerate(slots):
    bank.forward_backward(_rows(slot, 20 + i, (6,), cfg.vocab_size), "cross_entropy", {}, False)
  grads = [jax.tree.map(lambda x: x[:, s], bank.grads) for s in slots]
  pad_before = (bank.adapter(pad), bank.optimizer_state(pad), grads[3])
  norms = bank.optim_steps(list(zip(stepped, hps)))
  for i, slot in enumerate(stepped):
    updates, _ = refs[i].update(grads[i], states[i], want[i])
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7),
                 bank.adapter(slot), optax.apply_updates(want[i], updates))
    np.testing.assert_allclose(norms[i]["grad_norm"], optax.tree.norm(grads[i]), rtol=1e-5)
  pad_after = (bank.adapter(pad), bank.optimizer_state(pad),
               jax.tree.map(lambda x: x[:, pad], bank.grads))
  jax.tree.map(np.testing.assert_array_equal, pad_after, pad_before)
  assert not any(np.any(np.asarray(x[:, stepped])) for x in jax.tree.leaves(bank.grads))


def test_an_attention_only_adapter_leaves_its_mlp_matrices_as_made(base):
  cfg, params = base
  bank = AdapterBank(cfg, params, LORA, CAPACITY)
  attn, both = bank.allocate(0, ATTN), bank.allocate(1)
  made = bank.adapter(attn)
  for slot in (attn, both):
    bank.forward_backward(_rows(slot, slot, (8,), cfg.vocab_size), "cross_entropy", {}, False)
  bank.optim_steps([(attn, AdamParams(learning_rate=1e-2, weight_decay=0.1)),
                    (both, AdamParams(learning_rate=1e-2))])
  moved = lambda slot, name: not np.array_equal(bank.lora["layers"][name][:, slot],
                                                made["layers"][name])
  for name in bank.shapes["layers"]:
    matrix = name.rsplit("_lora_", 1)[0]
    assert moved(attn, name) == (matrix in ATTN), name  # A (decayed) and B of attention
    if name.endswith("_lora_b"):  # (A's gradient is 0 while B is: no moment yet)
      assert np.any(np.asarray(bank.mu["layers"][name][:, attn])) == (matrix in ATTN), name
  assert all(moved(both, f"{m}_lora_b") for m in ATTN + MLP)  # B = 0 -> trained: moved
  assert not any(np.any(np.asarray(x[:, :2])) for x in jax.tree.leaves(bank.grads))


def _numpy_loss(name, lp, q, adv, w, cfg):
  ratio = np.exp(lp - q)
  clip = np.clip(ratio, cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2))
  return {"cross_entropy": -lp * w, "importance_sampling": -ratio * adv,
          "ppo": -np.minimum(ratio * adv, clip * adv), "cispo": -clip * lp * adv,
          "dro": -(lp * adv - 0.5 * cfg.get("beta", 0) * (lp - q) ** 2)}[name]


@pytest.mark.parametrize("name,config", [("cross_entropy", {}), ("importance_sampling", {}),
                                         ("ppo", {"clip_low_threshold": 0.9}), ("cispo", {}),
                                         ("dro", {"beta": 0.05})])
def test_each_loss_is_its_documented_formula(name, config):
  rng = np.random.default_rng(3)
  lp, q = -rng.random((2, 6)), -rng.random((2, 6))
  adv, w = rng.normal(size=(2, 6)), rng.random((2, 6))
  loss, full = losses.resolve(name, config)
  inputs = {"logprobs": q, "advantages": adv, "weights": w}
  got = loss.fn(jnp.asarray(lp), {k: jnp.asarray(v) for k, v in inputs.items()},
                jnp.ones((2, 6)), full)
  np.testing.assert_allclose(got, _numpy_loss(name, lp, q, adv, w, config), rtol=1e-6)


def test_gspo_weighs_tokens_by_their_sequences_mean_ratio():
  lp, q = jnp.asarray([[-1.0, -2.0, -3.0]]), jnp.asarray([[-1.2, -2.2, -9.0]])
  mask = jnp.asarray([[1.0, 1.0, 0.0]])  # The last token is not the sampler's.
  loss, cfg = losses.resolve("gspo", {"clip_high_threshold": 2.0})
  inputs = {"logprobs": q, "advantages": jnp.ones((1, 3)), "sequence_ratio_mask": mask}
  got = loss.fn(lp, inputs, jnp.ones((1, 3)), cfg)
  np.testing.assert_allclose(got, [[-np.exp(0.2), -np.exp(0.2), 0.0]], rtol=1e-6)
  grad = jax.grad(lambda x: jnp.sum(loss.fn(x, inputs, jnp.ones((1, 3)), cfg)))(lp)
  np.testing.assert_allclose(grad, [[-np.exp(0.2), -np.exp(0.2), 0.0]], rtol=1e-6)


@pytest.mark.parametrize("name,config,message", [
    ("nope", {}, "not a known loss_fn"), ("stable_reinforce", {}, "not published"),
    ("ppo", {"beta": 1.0}, "not options of 'ppo'"), ("dro", {}, "beta: 'dro' needs a number")])
def test_a_loss_mistake_is_one_line_naming_it(name, config, message):
  with pytest.raises(UserError, match=message):
    losses.resolve(name, config)


def test_sampling_engines_that_split_their_layers_share_one_base_and_decode_the_same(base):
  """On a GPU the sampler engines hold their layers one buffer per layer: the base is
  split once for every rank's engine and a swap of adapters copies none of it."""
  from jaxrl_post.rollout import EngineConfig, SamplingParams
  from jaxrl_post.serve.requests import Sample
  from jaxrl_post.serve.sampling import Engines, Weights

  cfg, params = base
  adapters = [Weights(4, _adapter(cfg, seed)) for seed in (1, 2, 3)]
  sampling = SamplingParams(temperature=0.0, max_tokens=6)
  jobs = [(w, Sample((5, 9, 2 + i), 1, sampling, 7, False), 7)
          for i, w in enumerate([None, *adapters])]
  engine_cfg = EngineConfig(num_slots=8, decode_steps=4)
  out = {}
  for split in (False, True):
    engines = Engines(cfg, params, dataclasses.replace(engine_cfg, split_layers=split), 8.0,
                      slots=3)
    first = engines.sample(4, jobs[:3])  # the base and two adapters
    held = engines._engine(4)
    base_ids = {id(w) for layer in held.engine.params["layers"] for n, w in layer.items()
                if "_lora_" not in n} if split else None
    rest = engines.sample(4, jobs[3:])  # a third adapter takes a slot: new engine weights
    if split:
      assert weights.is_split(held.engine.params) and held.version == 2
      assert base_ids == {id(w) for layer in held.engine.params["layers"]
                          for n, w in layer.items() if "_lora_" not in n}
      assert base_ids == {id(w) for layer in engines.base["layers"] for w in layer.values()}
    out[split] = [[c.tokens for c in cs] for cs in first + rest]
  assert out[True] == out[False]


def test_the_banks_and_the_engines_hold_one_copy_of_the_base(base, tmp_path):
  """The server's base weights exist once: the adapter banks train over the engines' own
  (split per layer, as on a GPU), and the loaded copy is let go."""
  from jaxrl_post.rollout import EngineConfig
  from jaxrl_post.serve.config import ServeConfig
  from jaxrl_post.serve.service import Served, Service

  cfg, params = base
  served = Served("tiny", cfg, params, str(tmp_path), (0,), lambda s: [1])
  serve_cfg = ServeConfig(engine=EngineConfig(num_slots=4, decode_steps=2, split_layers=True))
  service = Service(served, serve_cfg, str(tmp_path / "work"))
  try:
    assert weights.is_split(service.base) and service.served.params is None
    assert service.engines.base is service.base
    bank = service._bank(4)
    assert all(x is y for x, y in zip(jax.tree.leaves(bank.base),
                                      jax.tree.leaves(service.base)))
  finally:
    service.close()


def test_a_sampler_asked_to_record_stability_information_is_refused_naming_it():
  from jaxrl_post.serve import requests as R

  body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
          "sampling_params": {"max_tokens": 4}}
  assert R.sample(body, 320, 64, 8, (0,), lambda s: [1]).prompt == (1, 2)
  with pytest.raises(UserError, match="^record_stability_info: "):
    R.sample({**body, "record_stability_info": True}, 320, 64, 8, (0,), lambda s: [1])
