"""The packed forward's attention: long rows take the blocked (or kernel) path, which equals
the plain masked softmax in values and gradients and never holds [S, S] float32 scores."""

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post.kernels import PackedAttentionConfig
from jaxrl_post.models import ModelConfig, init_model
from jaxrl_post.models import layers as L
from jaxrl_post.models.transformer import positions_from_segments
from jaxrl_post.sharding import TRAINING_RULES, MeshConfig, activation_rules, make_mesh

TOL = 1e-5  # float32: the same sums in another order
PLAIN = L.TrainingAttention(plain_max_len=1 << 20)
# Rows of 40 tokens in 16-token tiles: 3 query tiles, a padded last one, skipped tiles.
BLOCKED = L.TrainingAttention(plain_max_len=0, kernel=PackedAttentionConfig(
    backend="blocked", jnp_block=16))
TRITON = L.TrainingAttention(plain_max_len=0, kernel=PackedAttentionConfig(
    backend="triton", block_q=16, block_kv=16, bwd_block_q=16, bwd_block_kv=16))
# Row 0: sequences of 10, 17, 1 and 7 tokens, then 5 padding tokens; row 1: one sequence;
# row 2: all padding (a padding row of the trainer).
SEGMENTS = np.stack([np.repeat([1, 2, 3, 4, 0], [10, 17, 1, 7, 5]), np.full(40, 9),
                     np.zeros(40, int)])


def tiny(**kw) -> ModelConfig:
  base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, compute_dtype="float32", max_position_embeddings=64)
  return ModelConfig(**{**base, **kw})


def close(actual, expected):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=TOL, atol=TOL)


def qkv(seed, hq=4, hkv=2, d=16, segments=SEGMENTS):
  rng = np.random.default_rng(seed)
  b, t = segments.shape
  draw = lambda h: jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  return draw(hq), draw(hkv), draw(hkv), draw(hq)


def attention_value_and_grads(config, q, k, v, weights, window, segments=SEGMENTS):
  seg = jnp.asarray(segments, jnp.int32)
  pos = positions_from_segments(seg)

  def loss(q, k, v):
    out = L.packed_attention_fn(seg, pos, window, config)(q, k, v)
    return jnp.sum(out * weights), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("window", [None, 5, 16], ids=["causal", "window5", "window16"])
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa"])
def test_blocked_path_equals_the_plain_path(window, group):
  q, k, v, weights = qkv(group, hq=2 * group, hkv=2)
  out, grads = attention_value_and_grads(BLOCKED, q, k, v, weights, window)
  want, want_grads = attention_value_and_grads(PLAIN, q, k, v, weights, window)
  close(out, want)
  for g, w in zip(grads, want_grads):
    close(g, w)
  padding = SEGMENTS == 0
  assert not np.asarray(out)[padding].any()  # padding queries attend to nothing
  assert not any(np.asarray(g)[padding].any() for g in grads)


def test_triton_kernel_path_equals_the_plain_path_with_a_window():
  q, k, v, weights = qkv(3)
  out, grads = attention_value_and_grads(TRITON, q, k, v, weights, 7)
  want, want_grads = attention_value_and_grads(PLAIN, q, k, v, weights, 7)
  close(out, want)
  for g, w in zip(grads, want_grads):
    close(g, w)


def f32_sizes(hlo: str) -> list[int]:
  """Element counts of every float32 array in an HLO module."""
  dims = re.findall(r"f32\[([\d,]*)\]", hlo)
  return [int(np.prod([int(n) for n in d.split(",") if n])) for d in dims]


def test_long_rows_never_hold_seq_by_seq_float32_scores():
  """Forward and backward of a 1024-token row: the largest float32 array of the blocked
  program is below S * S elements (the plain program holds [H, S, S] scores)."""
  s = 1024
  segments = np.repeat([1, 2, 0], [600, 400, 24])[None]
  q, k, v, weights = qkv(4, hq=2, hkv=1, d=16, segments=segments)
  seg = jnp.asarray(segments, jnp.int32)
  pos = positions_from_segments(seg)
  config = L.TrainingAttention(kernel=PackedAttentionConfig(backend="blocked", jnp_block=128))

  def program(config):
    def loss(q, k, v):
      return jnp.sum(L.packed_attention_fn(seg, pos, None, config)(q, k, v) * weights)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()

  blocked, plain = program(config), program(PLAIN)
  assert max(f32_sizes(blocked.as_text())) < s * s <= max(f32_sizes(plain.as_text()))
  temp = lambda c: c.memory_analysis().temp_size_in_bytes
  print(f"temp bytes: blocked {temp(blocked)}, plain {temp(plain)}")
  assert temp(blocked) * 8 < temp(plain)
  want = jax.grad(lambda *x: jnp.sum(L.packed_attention_fn(seg, pos, None, PLAIN)(*x)
                                     * weights), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(blocked(q, k, v), want):
    close(g, w)


def test_tiles_are_not_hoisted_out_of_a_layer_scan():
  """Under a scan over layers, values computed from tile indices alone (the causal mask of
  each tile pair, a masked select's zeros) are layer-invariant; JAX would hoist them out of
  the loop and stack every tile pair: [n, n, ..., block, block], S * S elements again."""
  b, s, hq, hkv, d, block = 1, 1024, 2, 1, 16, 128
  seg = jnp.ones((b, s), jnp.int32)
  attend = functools.partial(L.packed_attention, config=PackedAttentionConfig(
      backend="blocked", jnp_block=block), sliding_window=None)

  def loss(w, x):
    def layer(x, wl):
      q = (x @ wl).reshape(b, s, hq, d)
      return x + attend(q, q[:, :, :hkv], q[:, :, :hkv], seg).reshape(b, s, hq * d), None
    return jnp.sum(jax.lax.scan(layer, x, w)[0])

  w, x = jnp.zeros((2, hq * d, hq * d)), jnp.zeros((b, s, hq * d))
  compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
  assert max(f32_sizes(compiled.as_text())) < s * s


@pytest.mark.parametrize("remat", ["none", "full", "dots", "dots_no_batch"])
def test_no_remat_policy_saves_the_blocked_kernels_score_tiles(remat):
  """Inside the layer's checkpoint the kernel's forward is visible to the policy; "dots"
  once saved every [block, block] score tile of every tile pair and layer ([S, S] per head
  again: 1.1 GB per row for SmolLM2 at 1024 tokens). Only the kernel's own residuals (its
  output and log-sum-exp) and the projections may be saved."""
  s, block = 256, 32
  model = init_model(tiny(remat=remat, max_position_embeddings=s), seed=1)
  seg = jnp.asarray(np.repeat([1, 2], [160, 96])[None], jnp.int32)
  tokens, pos = jnp.zeros((1, s), jnp.int32), positions_from_segments(seg)
  attention = L.TrainingAttention(plain_max_len=0, kernel=PackedAttentionConfig(
      backend="blocked", jnp_block=block))
  graphdef, state = nnx.split(model)
  loss = lambda state: jnp.sum(nnx.merge(graphdef, state)(tokens, pos, seg,
                                                          attention=attention))
  listing = io.StringIO()
  with contextlib.redirect_stdout(listing):  # one line per residual: "f32[...] from ..."
    jax.ad_checkpoint.print_saved_residuals(loss, state)
  sizes = f32_sizes(listing.getvalue())
  assert sizes and max(sizes) < s * s, sorted(sizes)[-3:]  # tiles: n * n * block^2 per head


def model_loss(model, tokens, positions, segments, attention):
  graphdef, state = nnx.split(model)

  def loss(state):  # a mean over real tokens, at the scale of the trainer's token-mean loss
    hidden = nnx.merge(graphdef, state)(tokens, positions, segments, attention=attention)
    real = (segments != 0)[..., None]
    return jnp.sum(jnp.where(real, jnp.sin(hidden), 0.0)) / jnp.sum(real), hidden

  return jax.value_and_grad(loss, has_aux=True)(state)


def packed_tokens(seed):
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 97, SEGMENTS.shape))
  seg = jnp.asarray(SEGMENTS, jnp.int32)
  return tokens, positions_from_segments(seg), seg


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "window6"])
def test_model_with_blocked_attention_equals_the_plain_model(window):
  assert_model_equals_the_plain_model(tiny(sliding_window=window, qkv_bias=True), BLOCKED)


def assert_model_equals_the_plain_model(cfg, attention):
  """Hidden states at real tokens, the loss and every parameter's gradient."""
  model = init_model(cfg, seed=1)
  args = packed_tokens(2)
  (loss, hidden), grads = model_loss(model, *args, attention)
  (want_loss, want_hidden), want_grads = model_loss(model, *args, PLAIN)
  real = SEGMENTS != 0
  close(np.asarray(hidden)[real], np.asarray(want_hidden)[real])
  close(loss, want_loss)
  jax.tree.map(close, grads, want_grads)


MIXED = dict(sliding_window=6, layer_types=("sliding_attention", "full_attention"),
             rope_local_base_freq=100.0)


@pytest.mark.parametrize("extra", [{}, dict(sliding_window=6, qk_norm=True), MIXED],
                         ids=["causal", "window6-qk-norm", "mixed-layers"])
def test_model_with_rope_in_the_kernel_equals_the_plain_model(extra):
  """At head_dim 32 the Triton kernels take q and k before RoPE and rotate them as they
  read them (forward and both backward kernels): the model's hidden states and every
  parameter's gradient equal the plain path's, which rotates first. Gemma 3's mixed
  layers rotate by tables of their own base."""
  cfg = tiny(qkv_bias=True, head_dim=32, **extra)
  assert L.rope_in_attention(cfg, SEGMENTS.shape[1], TRITON)
  assert not L.rope_in_attention(tiny(), SEGMENTS.shape[1], TRITON)  # head_dim 8: halves of 4
  assert not L.rope_in_attention(cfg, SEGMENTS.shape[1], BLOCKED)
  assert_model_equals_the_plain_model(cfg, TRITON)


@pytest.mark.parametrize("head_dim", [8, 32], ids=["rope-before", "rope-in-kernel"])
def test_kernel_path_runs_per_device_on_a_mesh(head_dim):
  """On 8 devices the Pallas path goes through shard_map (rows over data x fsdp, heads
  over tensor; RoPE tables with the rows) and gives the single-device numbers."""
  model = init_model(tiny(head_dim=head_dim), seed=3)
  tokens, pos, seg = (jnp.tile(x, (2, 1)) for x in packed_tokens(4))  # 6 rows: 3 per fsdp shard
  mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, tokens, pos, seg):
    with activation_rules(TRAINING_RULES, mesh):
      return nnx.merge(graphdef, state)(tokens, pos, seg, attention=TRITON)

  sharded = forward(state, tokens, pos, seg)
  text = forward.lower(state, tokens, pos, seg).as_text()
  assert "shard_map" in text or "sdy.manual_computation" in text
  want = init_model(tiny(head_dim=head_dim), seed=3)(tokens, pos, seg, attention=PLAIN)
  real = np.asarray(seg) != 0
  close(np.asarray(sharded)[real], np.asarray(want)[real])


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("platform,backend", [("cuda", "triton"), ("tpu", "splash")])
def test_model_training_forward_lowers_to_the_kernel_for_gpu_and_tpu(platform, backend):
  """No GPU or TPU here: export the model's forward and backward for each (as the kernel
  tests do) to check that its route lowers, sliding window included."""
  from tests.kernels.test_lowering import export, kernel_calls
  model = init_model(tiny(sliding_window=64, num_heads=2, num_kv_heads=1, head_dim=64), seed=5)
  graphdef, state = nnx.split(model)
  kernel = PackedAttentionConfig(backend=backend, interpret=False)
  attention = L.TrainingAttention(kernel=kernel)

  def loss(state, tokens, pos, seg):
    return jnp.mean(nnx.merge(graphdef, state)(tokens, pos, seg, attention=attention))

  rows = jax.ShapeDtypeStruct((2, 1024), jnp.int32)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  text = export(platform, jax.grad(loss), abstract, rows, rows, rows)
  assert kernel_calls(platform, text) == 3  # forward and two backward kernels, in the scan
