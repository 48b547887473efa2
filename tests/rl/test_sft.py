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


def test_config_validation():
  with pytest.raises(UserError, match="learning_rate"):
    SftConfig(learning_rate=0.0)
