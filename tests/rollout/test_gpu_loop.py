"""The decode loop as a GPU runs it -- all `steps` every call, no runtime branch in
sampling (rollout.programs._decode_steps), so the host never waits on a flag -- decodes
what the early-exit loop does: the same tokens, logprobs and kept-set floors, with slots
finishing mid-call and samplers of every kind in one batch. The GPU form is traced here by
telling the programs their mesh is a GPU's; XLA:CPU runs it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_post.rollout import SamplingParams, generate, programs, sampling
from tests.rollout import helpers as H

KINDS = (SamplingParams(temperature=0.0, max_tokens=5),  # greedy, stops mid-call
         SamplingParams(temperature=0.9, max_tokens=13),
         SamplingParams(temperature=0.7, top_k=5, max_tokens=9),
         SamplingParams(temperature=1.0, top_p=0.8, max_tokens=17))


def _decode(prompts):
  engine = H.engine()
  return [generate(engine, [p], n=2, sampling=s)[0] for p, s in zip(prompts, KINDS)]


def test_the_gpu_decode_loop_decodes_what_the_early_exit_loop_does(monkeypatch):
  prompts = H.prompts(np.random.default_rng(11), [3, 8, 14, 21])
  want = _decode(prompts)
  monkeypatch.setattr(programs, "mesh_platform", lambda mesh: "gpu")
  jax.clear_caches()  # Traced anew: the same static arguments would reuse the CPU's trace.
  try:
    got = _decode(prompts)
    assert programs._decode_gpu._cache_size() > 0  # The GPU's program decoded them.
  finally:
    jax.clear_caches()
  for g_req, w_req in zip(got, want):
    for g, w in zip(g_req, w_req):
      assert g.tokens == w.tokens
      np.testing.assert_allclose(g.logprobs, w.logprobs, atol=H.LOGPROB_TOL)


def test_sampling_without_shortcuts_draws_the_same_tokens():
  import jax.numpy as jnp

  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.normal(size=(6, 97)) * 3, jnp.float32)
  keys = sampling.token_keys(jnp.arange(6, dtype=jnp.uint32), jnp.zeros(6, jnp.int32),
                             jnp.zeros(6, jnp.int32))
  temperature = jnp.asarray([0.0, 0.8, 1.0, 0.0, 0.6, 1.2], jnp.float32)
  top_k = jnp.asarray([0, 0, 7, 3, 0, 0], jnp.int32)
  top_p = jnp.asarray([1.0, 0.9, 1.0, 1.0, 1.0, 0.5], jnp.float32)
  for temps in (temperature, jnp.zeros(6, jnp.float32)):  # mixed; greedy rows only
    for truncation in (True, False):
      args = (logits, keys, temps, top_k, top_p, truncation, True)
      want = jax.jit(sampling.sample_with_floors, static_argnums=(5, 6))(*args)
      got = jax.jit(lambda *a: sampling.sample_with_floors(*a, shortcuts=False),
                    static_argnums=(5, 6))(*args)
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_allclose(got[1], want[1], atol=1e-5)
      np.testing.assert_array_equal(got[2], want[2])


def _full_forward_logprobs(model, temperature):
  """fn(prompt, tokens) -> [len(tokens)] each token's logprob under a full forward of
  prompt + tokens, at `temperature` (float64)."""
  from jaxrl_post.models.transformer import params_of, with_params

  @jax.jit
  def logits(params, seq):
    m = with_params(model, params)
    return m.logits(m(seq[None], jnp.arange(seq.shape[0])[None]))[0]

  def logprobs(prompt, tokens):
    seq = jnp.asarray(list(prompt) + list(tokens), jnp.int32)
    rows = np.asarray(logits(params_of(model), seq), np.float64)[len(prompt) - 1:-1]
    return H.log_softmax(rows / temperature)[np.arange(len(tokens)), list(tokens)]
  return logprobs


def test_the_kernel_that_appends_kv_decodes_what_a_full_forward_computes(monkeypatch):
  """A GPU's decode step writes the new K/V inside the attention kernel
  (kernels.paged_append), and there norms and rotates q and k as it reads them from the
  layer's one Q/K/V product (kernels.qk_prep). Run here through the Pallas interpreter,
  every sampled token's logprob is a full forward's over the same tokens: plain, with a
  sliding window (7 keys over pages of 4), and cascade (blocks of 2 samples sharing their
  prompt's pages), with slots finishing and refilling mid-call; a Qwen3-style model (q/k
  norms, QKV biases) on 2 tensor shards, whose product lays each shard's q, k and v side
  by side, and on 4, whose 2 KV heads do not divide them: its q, k and v come rotated
  by XLA, as for a model whose layers the kernels cannot prepare."""
  from jaxrl_post.models.transformer import init_model
  from jaxrl_post.rollout import Engine, forward
  from jaxrl_post.sharding import MeshConfig, make_mesh

  prompts = H.prompts(np.random.default_rng(3), [3, 9, 17])  # 6 rows in 4 slots
  sampling = SamplingParams(temperature=0.8, max_tokens=10)
  monkeypatch.setattr(forward, "appends_in_kernel", lambda *args: True)
  prepared = []
  monkeypatch.setattr(forward, "prepares_in_kernel",
                      lambda *a, was=forward.prepares_in_kernel: prepared.append(was(*a))
                      or prepared[-1])
  qwen3 = dict(qk_norm=True, qkv_bias=True)
  mesh = lambda tensor: make_mesh(MeshConfig(data=1, fsdp=1, tensor=tensor),
                                  jax.devices()[:tensor])
  cases = [(dict(), 0, None, True), (dict(sliding_window=7), 0, None, True),
           (dict(), 2, None, True), (qwen3, 2, 2, True), (qwen3, 0, 4, False)]
  jax.clear_caches()  # Traced anew: a CPU's trace of the same shapes writes with a scatter.
  try:
    for extra, groups, tensor, prepares in cases:
      model = init_model(H.CFG.replace(head_dim=16, **extra), seed=1)  # Triton's smallest
      engine = Engine.from_model(model, dataclasses.replace(H.ENGINE, group_slots=groups),
                                 mesh=None if tensor is None else mesh(tensor))
      prepared.clear()
      full = _full_forward_logprobs(model, sampling.temperature)
      for prompt, samples in zip(prompts, generate(engine, prompts, n=2, sampling=sampling)):
        for c in samples:
          np.testing.assert_allclose(c.logprobs, full(prompt, c.tokens), atol=H.LOGPROB_TOL)
      assert prepared and set(prepared) == {prepares}, (extra, tensor, prepared)
  finally:
    jax.clear_caches()
