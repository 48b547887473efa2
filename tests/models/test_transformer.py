"""The transformer's own invariants: axes, shapes, packing, caching, remat, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.errors import UserError
from jaxrl_post.models import ModelConfig, KVCache, RopeScaling, abstract_model, init_model, preset
from jaxrl_post.models import layers as L
from jaxrl_post.models.transformer import LOGICAL_AXES, logical_axes, param_count, \
    positions_from_segments

TOL = 1e-5  # float32 equivalences below are exact maths, reordered.


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, compute_dtype="float32", max_position_embeddings=64)
  return ModelConfig(**{**base, **kw})


def test_every_parameter_names_its_logical_axes():
  model = init_model(tiny(qkv_bias=True, o_bias=True))
  axes = logical_axes(model)
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  is_axes = lambda x: isinstance(x, tuple)
  flat_axes = jax.tree.leaves(axes, is_leaf=is_axes)
  flat_params = jax.tree.leaves(params)
  assert len(flat_axes) == len(flat_params) == 16  # 3 global + 13 per-layer (with biases)
  for names, x in zip(flat_axes, flat_params):
    assert len(names) == x.ndim
    assert set(names) <= set(LOGICAL_AXES), names
  for names in jax.tree.leaves(axes["layers"], is_leaf=is_axes):
    assert names[0] == "layers"


def test_the_compiled_init_draws_the_eager_inits_weights_bit_for_bit():
  """The training command's one-program init (init_model_compiled) against init_model's op
  by op draws: every parameter in every dtype, LoRA and value head included, per seed."""
  from jaxrl_post.models import LoraConfig
  from jaxrl_post.models.transformer import init_model_compiled, params_of

  cfg = tiny(param_dtype="bfloat16", tie_word_embeddings=False, value_head=True, qk_norm=True,
             qkv_bias=True, lora=LoraConfig(rank=4, targets=("wq", "w_up")))
  for config, seed in ((tiny(), 0), (cfg, 0), (cfg, 7)):
    want = params_of(init_model(config, seed), nnx.Variable)
    got = params_of(init_model_compiled(config, seed), nnx.Variable)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      assert g.dtype == w.dtype
      np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert logical_axes(init_model_compiled(config, seed)) == logical_axes(init_model(config))


@pytest.mark.parametrize("name,expected", [("smollm2-135m", 134_515_008),
                                           ("llama3-8b", 8_030_261_248),
                                           ("qwen2.5-0.5b", 494_032_768),
                                           ("qwen3-0.6b", 596_049_920),
                                           ("gemma3-1b", 999_885_952)])
def test_full_size_presets_by_shape_only(name, expected):
  cfg = preset(name)
  model = abstract_model(cfg)  # eval_shape: no memory is allocated.
  assert param_count(model) == cfg.num_params == expected


def test_layers_are_scanned_so_the_program_does_not_grow_with_depth():
  def n_eqns(layers):
    model = init_model(tiny(num_layers=layers))
    graphdef, state = nnx.split(model)
    tok = jnp.zeros((1, 8), jnp.int32)
    fn = lambda s: nnx.merge(graphdef, s)(tok, jnp.arange(8)[None])
    return len(jax.make_jaxpr(fn)(state).jaxpr.eqns)

  assert n_eqns(2) == n_eqns(12)


def test_packed_rows_equal_separate_sequences():
  model = init_model(tiny(), seed=1)
  rng = np.random.default_rng(0)
  a, b = rng.integers(0, 97, 5), rng.integers(0, 97, 7)
  row = np.concatenate([a, b, [0, 0]])[None]
  seg = np.array([[1] * 5 + [2] * 7 + [0, 0]])
  pos = positions_from_segments(jnp.asarray(seg))
  np.testing.assert_array_equal(pos[0, :12], list(range(5)) + list(range(7)))
  packed = model(jnp.asarray(row), pos, jnp.asarray(seg))
  for seq, start in ((a, 0), (b, 5)):
    alone = model(jnp.asarray(seq)[None], jnp.arange(len(seq))[None])
    np.testing.assert_allclose(packed[0, start:start + len(seq)], alone[0], atol=TOL)


def test_sliding_window_limits_attention():
  cfg = tiny(sliding_window=3)
  model = init_model(cfg, seed=2)
  tok = jnp.asarray(np.random.default_rng(1).integers(0, 97, (1, 10)))
  pos = jnp.arange(10)[None]
  full = model(tok, pos)
  # Changing a token more than `window` positions back must not change the last output.
  changed = model(tok.at[0, 2].set((tok[0, 2] + 1) % 97), pos)
  np.testing.assert_allclose(full[0, -1], changed[0, -1], atol=TOL)
  assert not np.allclose(full[0, 3], changed[0, 3], atol=TOL)


def test_cached_prefill_and_decode_equal_the_full_forward():
  model = init_model(tiny(qkv_bias=True), seed=3)
  tok = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, 9)))
  pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
  full = model(tok, pos)
  cache = KVCache.zeros(model.config, 2, 16)
  h, cache = model.forward_cached(tok[:, :6], pos[:, :6], cache, jnp.zeros(2, jnp.int32))
  steps = [h]
  for t in range(6, 9):
    h, cache = model.forward_cached(tok[:, t:t + 1], pos[:, t:t + 1], cache,
                                    jnp.full((2,), t, jnp.int32))
    steps.append(h)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=TOL)


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_policies_change_memory_not_maths(policy):
  tok = jnp.asarray(np.random.default_rng(3).integers(0, 97, (2, 8)))
  pos = jnp.broadcast_to(jnp.arange(8), (2, 8))

  def loss_and_grad(remat):
    model = init_model(tiny(remat=remat), seed=4)
    graphdef, state = nnx.split(model)

    def loss(s):
      m = nnx.merge(graphdef, s)
      return jnp.mean(m.logits(m(tok, pos)) ** 2)

    return jax.value_and_grad(loss)(state)

  (l0, g0), (l1, g1) = loss_and_grad("none"), loss_and_grad(policy)
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), g0, g1)


def test_bf16_compute_with_f32_params_tracks_f32():
  tok = jnp.asarray(np.random.default_rng(4).integers(0, 97, (1, 12)))
  pos = jnp.arange(12)[None]
  m32 = init_model(tiny(), seed=5)
  m16 = init_model(tiny(compute_dtype="bfloat16"), seed=5)
  assert m16.embed[...].dtype == jnp.float32
  h16 = m16(tok, pos)
  assert h16.dtype == jnp.bfloat16
  p32 = jax.nn.softmax(m32.logits(m32(tok, pos)))
  p16 = jax.nn.softmax(m16.logits(h16))
  np.testing.assert_allclose(p16, p32, atol=2e-2)


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones():
  cfg = tiny(head_dim=64, rope_theta=500000.0,
             rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64))
  base = L.rope_inv_freq(tiny(head_dim=64, rope_theta=500000.0))
  scaled = L.rope_inv_freq(cfg)
  wavelen = 2 * np.pi / base
  np.testing.assert_allclose(scaled[wavelen < 64 / 4], base[wavelen < 64 / 4])
  np.testing.assert_allclose(scaled[wavelen > 64], base[wavelen > 64] / 8.0, rtol=1e-6)


@pytest.mark.parametrize("field,value", [("num_kv_heads", 3), ("head_dim", 7),
                                         ("remat", "sometimes"), ("hidden_size", 0),
                                         ("compute_dtype", "int8")])
def test_invalid_configs_name_the_field(field, value):
  with pytest.raises(UserError, match=field):
    tiny(**{field: value})


def test_lora_starts_as_a_no_op_and_equals_merged_weights():
  from jaxrl_post.models.config import LoraConfig
  lora = LoraConfig(rank=4, alpha=8.0, targets=("wq", "wo", "w_down"))
  base = init_model(tiny(), seed=6)
  adapted = init_model(tiny(lora=lora), seed=6)
  for name in ("embed", "final_norm"):
    getattr(adapted, name).set_value(getattr(base, name)[...])
  for name in base.layers.names:
    getattr(adapted.layers, name).set_value(getattr(base.layers, name)[...])
  tok = jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 7)))
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  np.testing.assert_allclose(adapted(tok, pos), base(tok, pos), atol=TOL)  # B == 0.

  rng = np.random.default_rng(6)
  for name in lora.targets:
    b = getattr(adapted.layers, f"{name}_lora_b")
    b.set_value(jnp.asarray(rng.normal(0, 0.1, b[...].shape), jnp.float32))
    a = getattr(adapted.layers, f"{name}_lora_a")[...]
    delta = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(a, b[...])
    w = getattr(base.layers, name)
    w.set_value(w[...] + lora.scale * delta.reshape(w[...].shape))
  np.testing.assert_allclose(adapted(tok, pos), base(tok, pos), atol=1e-4)
  lora_leaves = jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam))
  assert len(lora_leaves) == 2 * len(lora.targets)
  axes = jax.tree.leaves(logical_axes(adapted), is_leaf=lambda x: isinstance(x, tuple))
  assert sum("lora_rank" in a for a in axes) == 2 * len(lora.targets)


@pytest.mark.parametrize("adapters", [1, 2])
def test_grouped_lora_layout_computes_what_the_per_matrix_one_does(adapters):
  from jaxrl_post.models.config import LoraConfig
  from jaxrl_post.models.transformer import group_lora, post_attention, qkv_projection
  lora = LoraConfig(rank=4, alpha=8.0, adapters=adapters,
                    targets=("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
  cfg = tiny(lora=lora)
  model = init_model(cfg, seed=3)
  rng = np.random.default_rng(3)
  p = {n: w[0] for n, w in model.layers.stacked().items()}
  p = {n: jnp.asarray(rng.normal(0, 0.2, w.shape), w.dtype) if "lora_b" in n else w
       for n, w in p.items()}
  p["lora_adapter"] = jnp.asarray(rng.integers(0, adapters, (3, 5)), jnp.int32)
  grouped = group_lora(cfg, p)
  assert grouped["wq+wk+wv_lora_a"].shape == (32, 12)
  assert grouped["w_up_lora_b_padded"].shape == (8, 48)
  x = jnp.asarray(rng.normal(0, 1, (3, 5, 32)), jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(5), (3, 5))
  for want, got in zip(qkv_projection(cfg, x, p, pos), qkv_projection(cfg, x, grouped, pos)):
    np.testing.assert_allclose(got, want, atol=TOL)
  attn = jnp.asarray(rng.normal(0, 1, (3, 5, 4, 8)), jnp.float32)
  np.testing.assert_allclose(post_attention(cfg, x, grouped, attn)[0],
                             post_attention(cfg, x, p, attn)[0], atol=TOL)
  # The grouped path is the one taken: without B's padded copies it would not run.
  broken = {**grouped, "wk_lora_b_padded": jnp.zeros_like(grouped["wk_lora_b_padded"])}
  assert not np.allclose(qkv_projection(cfg, x, broken, pos)[1],
                         qkv_projection(cfg, x, p, pos)[1], atol=TOL)


@pytest.mark.parametrize("shards,lora", [(1, None), (2, None), (2, 1), (1, 2), (2, "rows")])
def test_the_side_by_side_product_is_q_k_and_v_of_each_shard(shards, lora):
  """qkv_side_by_side (the GPU decode's one product, before q/k norms and RoPE, which its
  kernels apply) holds qkv_projection's q, k and v before those: each tensor shard's
  heads side by side, so the shard's part of the heads axis is its own q, k and v; with
  LoRA on all three (1 or 2 adapters, or one per row as serve lays them out), their
  deltas from one A and one B product."""
  from jaxrl_post.models.config import LoraConfig
  from jaxrl_post.models.transformer import group_lora, qkv_before_rope, qkv_side_by_side
  adapters = 2 if lora == 2 else 1
  adapted = LoraConfig(rank=4, alpha=8.0, adapters=adapters, targets=("wq", "wk", "wv"))
  cfg = tiny(qkv_bias=True, lora=None if lora is None else adapted)
  p = {n: w[0] for n, w in init_model(cfg, seed=5).layers.stacked().items()}
  rng = np.random.default_rng(5)
  noisy = [n for n in p if n in ("bq", "bk", "bv") or n.endswith("_lora_b")]
  p.update({n: jnp.asarray(rng.normal(0, 0.5, p[n].shape), p[n].dtype) for n in noisy})
  if lora == "rows":  # Each of the 3 rows its own adapter's A and B.
    rows = lambda w: jnp.asarray(rng.normal(0, 0.5, (3, *w.shape)), w.dtype)
    p.update({n: rows(w) for n, w in p.items() if "_lora_" in n})
  if lora == 2:
    p["lora_adapter"] = jnp.asarray(rng.integers(0, 2, (3, 5)), jnp.int32)
  x = jnp.asarray(rng.normal(0, 1, (3, 5, 32)), jnp.float32)
  hq, hkv = cfg.num_heads // shards, cfg.num_kv_heads // shards
  grouped = p if lora is None else group_lora(cfg, p)
  y = qkv_side_by_side(cfg, x, grouped, shards)
  y = y.reshape(3, 5, shards, hq + 2 * hkv, cfg.head_dim)
  got = [y[:, :, :, :hq], y[:, :, :, hq:hq + hkv], y[:, :, :, hq + hkv:]]
  for want, part in zip(qkv_before_rope(cfg, x, p), got):
    np.testing.assert_allclose(part.reshape(want.shape), want, atol=TOL)
  if lora is not None:  # The adapters' share is in it, and not laid out: refused.
    base = {n: w for n, w in p.items() if "lora" not in n}
    assert not np.allclose(y, qkv_side_by_side(cfg, x, base, shards).reshape(y.shape),
                           atol=TOL)
    with pytest.raises(ValueError, match="laid out by group_lora"):
      qkv_side_by_side(cfg, x, p, shards)
