"""Supervised warm-up: the loss is the completion tokens' mean NLL, and steps lower it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.models import init_model
from jaxrl_post.models.transformer import params_of
from jaxrl_post.rl.forward import PackedInputs
from jaxrl_post.rl.packing import Trajectory, pack
from jaxrl_post.rl.sft import SftConfig, SftTrainer, sft_loss
from tests.rl.toy_task import CFG

EXAMPLES = [Trajectory([1, x], [x, x]) for x in range(2, 10)]


def test_loss_is_mean_nll_of_completion_tokens():
  model = init_model(CFG, 0)
  inputs = PackedInputs.from_packed(pack(EXAMPLES, 16, 4, 2))
  loss = sft_loss(model, params_of(model), inputs)
  want = []
  for t in EXAMPLES:
    seq = jnp.asarray([list(t.prompt) + list(t.completion)])
    logits = model.logits(model(seq, jnp.arange(seq.shape[1])[None], jnp.ones_like(seq)))
    logp = jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)
    p = len(t.prompt)
    want += [float(logp[p - 1 + i, c]) for i, c in enumerate(t.completion)]
  np.testing.assert_allclose(float(loss), -np.mean(want), rtol=1e-5)


def test_steps_lower_the_loss():
  model = init_model(CFG, 0)
  trainer = SftTrainer(model, SftConfig(steps=20, learning_rate=1e-2, row_tokens=16))
  params = jax.tree.map(jnp.array, params_of(model))
  opt = trainer.init(params)
  inputs = PackedInputs.from_packed(pack(EXAMPLES, 16, 4, 2))
  losses = []
  for _ in range(20):
    params, opt, loss = trainer.step(params, opt, inputs)
    losses.append(float(loss))
  assert losses[-1] < 0.5 * losses[0]


def test_steps_on_a_mesh_compile_one_program():
  """The first step's parameters carry specs with trailing Nones, as the rules table gives
  them; its outputs must come back with the same shardings, or the second step compiles
  the whole step again."""
  model = init_model(CFG, 0)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("fsdp",))

  def place(x):
    spec = ("fsdp",) + (None,) * (x.ndim - 1) if x.ndim and x.shape[0] % 8 == 0 else ()
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        *spec)))

  params = jax.tree.map(place, params_of(model))
  assert any(len(x.sharding.spec) > 1 for x in jax.tree.leaves(params))
  trainer = SftTrainer(model, SftConfig(learning_rate=1e-2, row_tokens=16))
  opt = trainer.init(params)
  inputs = PackedInputs.from_packed(pack(EXAMPLES, 16, 4, 2))
  for _ in range(3):
    params, opt, loss = trainer.step(params, opt, inputs)
  assert trainer._step._cache_size() == 1


def test_config_validation():
  with pytest.raises(UserError, match="learning_rate"):
    SftConfig(learning_rate=0.0)


def test_greedy_matches_is_greedy_decoding_writing_the_completion():
  model = init_model(CFG, 0)

  def greedy(prompt, n):  # Dense greedy decoding, one token at a time.
    seq = list(prompt)
    for _ in range(n):
      x = jnp.asarray([seq])
      logits = model.logits(model(x, jnp.arange(len(seq))[None], jnp.ones_like(x)))
      seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt):]

  examples, want = [], []
  for x in range(2, 8):
    own = greedy([1, x], 3)
    examples += [Trajectory([1, x], own), Trajectory([1, x], own[:2]),
                 Trajectory([1, x], [own[0], (own[1] + 1) % CFG.vocab_size, own[2]])]
    want += [True, True, False]  # A wrong middle token fails, even with the last right.
  inputs = PackedInputs.from_packed(pack(examples, 32, max_completion=3))
  got = SftTrainer(model, SftConfig()).greedy_matches(params_of(model), inputs)
  assert [bool(g) for g in np.asarray(got)] == want
