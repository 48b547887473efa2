"""The real (non-interpreted) kernels lower for CUDA and TPU from a CPU-only jaxlib.

jax.export runs the Pallas -> Triton and Pallas -> Mosaic lowerings, which is where most
kernel-authoring errors surface (non-power-of-two Triton blocks, scalar prefetch on GPU,
unsupported primitives, bad BlockSpecs). The target device is given as an abstract mesh,
as the Triton lowering needs a compute capability. Not covered without hardware: Triton's
PTX compilation and Mosaic's TPU compilation, which happen when XLA compiles the module on
the device (the `gpu`-marked tests run the kernels there).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from jaxrl_post import kernels

TRITON_CALL = "__gpu$xla.gpu.triton"
TARGETS = {
    "cuda": (AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                            platform="cuda"), "triton", TRITON_CALL),
    "tpu": (AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
            "mosaic", "tpu_custom_call"),
}
# SmolLM2-like decode shapes: 9 query heads on 3 KV heads of 64, 16-token pages.
B, HQ, HKV, D, PAGE, POOL, MAX_PAGES = 8, 9, 3, 64, 16, 256, 32
S = jax.ShapeDtypeStruct
# jax 0.11 deprecates Pallas-Triton in favour of Mosaic GPU; it is still the GPU path here.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def export(platform, fn, *args):
  """StableHLO text of fn exported for `platform` under an abstract device of that kind."""
  device = TARGETS[platform][0]
  mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(fn), platforms=(platform,),
        # Triton custom calls carry no serialization-compatibility guarantee; we only
        # check that they lower, we do not store them.
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*args)
  return exported.mlir_module()


def kernel_calls(platform, text):
  return text.count(TARGETS[platform][2])


def paged_args(dtype):
  pool = S((HKV, POOL, PAGE, D), dtype)
  return (S((B, HQ, D), dtype), pool, pool, S((B, MAX_PAGES), jnp.int32), S((B,), jnp.int32))


@pytest.mark.parametrize("platform", TARGETS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_paged_attention_lowers(platform, dtype):
  cfg = kernels.PagedAttentionConfig(backend=TARGETS[platform][1], interpret=False)
  fn = functools.partial(kernels.paged_attention_with_lse, config=cfg)
  assert kernel_calls(platform, export(platform, fn, *paged_args(dtype))) == 1


@pytest.mark.parametrize("platform", TARGETS)
def test_cascade_attention_lowers(platform):
  paged = kernels.PagedAttentionConfig(backend=TARGETS[platform][1], interpret=False)
  cfg = kernels.CascadeAttentionConfig(prefix=paged, suffix=paged)
  fn = functools.partial(kernels.cascade_attention, config=cfg)
  q, k_pages, v_pages, suffix_table, suffix_lengths = paged_args(jnp.bfloat16)
  groups = 2  # 2 prompts x 4 samples: 4 * 3 = 12 stacked query rows per KV head
  args = (q, k_pages, v_pages, S((groups, 16), jnp.int32), S((groups,), jnp.int32),
          suffix_table, suffix_lengths)
  assert kernel_calls(platform, export(platform, fn, *args)) == 2  # prefix + suffix


@pytest.mark.parametrize("platform", TARGETS)
def test_packed_attention_forward_and_backward_lower(platform):
  backend = {"cuda": "triton", "tpu": "splash"}[platform]
  cfg = kernels.PackedAttentionConfig(backend=backend, interpret=False)

  def fwd_bwd(q, k, v, seg):
    out, vjp = jax.vjp(lambda *x: kernels.packed_attention(*x, seg, config=cfg), q, k, v)
    return out, vjp(out)

  t = 1024
  args = (S((2, t, HQ, D), jnp.bfloat16), S((2, t, HKV, D), jnp.bfloat16),
          S((2, t, HKV, D), jnp.bfloat16), S((2, t), jnp.int32))
  # forward; dK/dV and dQ (triton) or dQ and dK/dV (splash)
  assert kernel_calls(platform, export(platform, fwd_bwd, *args)) == 3


@pytest.mark.parametrize("platform", TARGETS)
def test_chunked_logprob_lowers(platform):
  def value_and_grad(h, w, tg):
    return jax.value_and_grad(lambda h, w: kernels.chunked_logprob(h, w, tg, 0.8)[0].sum(),
                              argnums=(0, 1))(h, w)

  args = (S((512, 576), jnp.bfloat16), S((576, 49152), jnp.bfloat16), S((512,), jnp.int32))
  text = export(platform, value_and_grad, *args)
  assert "stablehlo.dot_general" in text and kernel_calls(platform, text) == 0  # plain XLA



@pytest.mark.parametrize("platform", TARGETS)
def test_paged_prefill_lowers(platform):
  cfg = kernels.PagedAttentionConfig(backend=TARGETS[platform][1], interpret=False)
  fn = functools.partial(kernels.paged_prefill_attention, config=cfg, window=64)
  rows, t, k = 4, 24, 8  # The engine's packed rows of 24 tokens, 8 key pages each.
  pool = S((HKV, POOL, PAGE, D), jnp.bfloat16)
  table, tokens = S((rows, k), jnp.int32), S((rows, t), jnp.int32)
  args = (S((rows, t, HQ, D), jnp.bfloat16), pool, pool, table, table, table, tokens, tokens)
  assert kernel_calls(platform, export(platform, fn, *args)) == 1
