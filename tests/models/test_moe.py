"""The mixture-of-experts layer: grouped matmuls vs the dense reference, routing replay,
the balance loss, experts sharded over the mesh, and Qwen3-MoE checkpoints in and out.

Logit and greedy parity of the tiny Qwen3-MoE fixture with transformers is in
test_hf_parity.py (tiny_qwen3_moe).
"""

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_post import models
from jaxrl_post.errors import UserError
from jaxrl_post.models import moe
from jaxrl_post.models.config import ModelConfig, MoeConfig
from jaxrl_post.models.hf import config_from_hf
from jaxrl_post.models.hf_export import save_pretrained
from jaxrl_post.models.tokenizer import char_tokenizer
from jaxrl_post.models.transformer import init_model, logical_axes, params_of, with_params
from jaxrl_post.sharding import (TRAINING_RULES, MeshConfig, activation_rules, make_mesh,
                                 tree_shardings)
from tests.models.test_qwen3 import TRANSFORMERS_PYTHON, _has_transformers

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAME = "tiny_qwen3_moe"
LOGIT_TOL = 1e-4  # ours vs transformers, float32 (as in test_hf_parity.py).
ROUND_TRIP_TOL = 1e-5  # ours vs ours reloaded (as in test_qwen3.py).
F32_TOL = 1e-5  # one float32 computation against another order of the same sums.


def fixture_config():
  with open(os.path.join(FIXTURES, NAME, "config.json")) as f:
    return json.load(f)


def tiny_moe(seed=0, **changes) -> models.Transformer:
  cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                    moe=MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=16),
                    **changes)
  model = init_model(cfg, seed)
  rng = np.random.default_rng(seed)  # Routers that pick clear winners (no near-ties).
  params = params_of(model)
  params["layers"]["router"] = rng.normal(0, 0.5, params["layers"]["router"].shape).astype(
      np.float32)
  return with_params(model, params)


def routed(model, ids, replay=None, segment_ids=None, apply=True):
  """The model's forward and routing, traced in the caller's program (and its mesh rules)."""
  ids = jnp.asarray(ids)
  pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  return model.forward_routed(ids, pos, segment_ids, recorded=replay, replay=apply)


def forward(model, ids, replay=None, segment_ids=None, apply=True):
  """routed() as a program of its own: eagerly, each op and the layer scan compile per call."""
  return _forward(model, jnp.asarray(ids), replay, segment_ids, apply)


_forward = nnx.jit(routed, static_argnames="apply")


# ------------------------------------------------------------------ the layer


@pytest.mark.parametrize("normalise", [True, False])
def test_grouped_matmuls_equal_the_dense_reference(normalise):
  rng = np.random.default_rng(0)
  n, d, f, e, k = 37, 16, 12, 6, 3
  x = rng.standard_normal((n, d)).astype(np.float32)
  cfg = tiny_moe().config.replace(moe=MoeConfig(e, k, f, normalise))
  ids, gates, _, _ = moe.route(cfg, x, rng.standard_normal((d, e)).astype(np.float32))
  w = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((e, d, f), (e, d, f), (e, f, d))]
  got = moe.experts_ffn(x, ids, gates, *w)
  want = moe.experts_ffn_reference(x, ids, gates, *w)
  np.testing.assert_allclose(got, want, atol=F32_TOL, rtol=F32_TOL)
  # An expert shard runs only its own experts: two halves sum to the whole.
  halves = [moe.experts_ffn(x, ids, gates, *(a[s] for a in w), first_expert=s.start)
            for s in (slice(0, 3), slice(3, 6))]
  np.testing.assert_allclose(halves[0] + halves[1], want, atol=F32_TOL, rtol=F32_TOL)
  if normalise:
    np.testing.assert_allclose(np.sum(gates, axis=-1), 1.0, atol=1e-6)


def test_balance_loss_is_one_when_uniform_and_larger_when_skewed():
  e, n = 4, 8
  uniform_probs = jnp.full((n, e), 1 / e)
  ids = jnp.asarray([[i % e, (i + 1) % e] for i in range(n)])
  valid = jnp.ones((n,), bool)
  assert float(moe.balance_loss(uniform_probs, ids, valid, e)) == pytest.approx(1.0)
  skewed = jnp.tile(jnp.asarray([[0.7, 0.2, 0.05, 0.05]]), (n, 1))
  same = jnp.tile(jnp.asarray([[0, 1]]), (n, 1))
  assert float(moe.balance_loss(skewed, same, valid, e)) > 1.5
  # Padding tokens do not count.
  pad = jnp.concatenate([ids, same]), jnp.concatenate([uniform_probs, skewed])
  mask = jnp.concatenate([valid, jnp.zeros((n,), bool)])
  assert float(moe.balance_loss(pad[1], pad[0], mask, e)) == pytest.approx(1.0)


def test_replaying_the_models_own_choice_changes_nothing_and_others_change_the_output():
  model = tiny_moe()
  ids = np.random.default_rng(1).integers(0, 128, (2, 12))
  h, routing = forward(model, ids)
  own = jnp.moveaxis(routing.experts, 0, 2)  # [B, T, L, k]
  h_same, r_same = forward(model, ids, replay=own)
  np.testing.assert_allclose(h_same, h, atol=F32_TOL)
  assert np.all(np.asarray(r_same.agree) == np.asarray(r_same.recorded))
  assert np.all(np.asarray(r_same.recorded) == 24)  # 2 x 12 tokens in each layer
  other = (own + 1) % 8
  h_other, r_other = forward(model, ids, replay=other)
  assert np.abs(np.asarray(h_other - h)).max() > 1e-2
  assert np.all(np.asarray(r_other.agree) < np.asarray(r_other.recorded))
  # Recorded but not replayed: the model's own routing, compared with the record.
  h_free, r_free = forward(model, ids, replay=other, apply=False)
  np.testing.assert_allclose(h_free, h, atol=F32_TOL)
  np.testing.assert_array_equal(r_free.agree, r_other.agree)
  # Unrecorded tokens (NO_EXPERT) route themselves.
  partial = own.at[:, 5:].set(moe.NO_EXPERT)
  np.testing.assert_allclose(forward(model, ids, replay=partial)[0], h, atol=F32_TOL)


def test_the_router_gets_a_gradient_under_replay():
  model = tiny_moe()
  ids = np.random.default_rng(2).integers(0, 128, (1, 10))
  own = jnp.moveaxis(forward(model, ids)[1].experts, 0, 2)
  params = params_of(model)

  def loss(p):
    h, _ = forward(with_params(model, p), ids, replay=(own + 3) % 8)
    return jnp.sum(h ** 2)

  grad = jax.grad(loss)(params)["layers"]["router"]
  assert np.abs(np.asarray(grad)).max() > 0


EXPERT_MESHES = {  # Tokens over (data, expert) and experts over "expert", as a user sets.
    "fsdp2_expert2_tensor2": MeshConfig(data=1, fsdp=2, expert=2, tensor=2),
    "expert4_data2": MeshConfig(data=2, fsdp=1, expert=4),
    "expert8": MeshConfig(fsdp=1, expert=8),
}


@pytest.mark.parametrize("mesh_cfg", list(EXPERT_MESHES.values()), ids=list(EXPERT_MESHES))
def test_experts_sharded_over_the_expert_axis_equal_one_device_forward_and_gradient(mesh_cfg):
  model = tiny_moe()
  ids = np.random.default_rng(3).integers(0, 128, (4, 16))
  segments = jnp.ones((4, 16), jnp.int32)
  params = params_of(model)

  def loss(p):
    h, routing = routed(with_params(model, p), ids, segment_ids=segments)
    return jnp.sum(h ** 2) + jnp.sum(routing.balance), h

  (want_loss, want_h), want_g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  mesh = make_mesh(mesh_cfg, jax.devices())
  axes = logical_axes(model)
  assert axes["layers"]["we_gate"] == ("layers", "expert", "embed", "mlp")
  shardings = tree_shardings(axes, params, TRAINING_RULES, mesh)
  assert shardings["layers"]["we_up"].spec[1] == "expert"
  placed = jax.device_put(params, shardings)

  def traced(p):
    with activation_rules(TRAINING_RULES, mesh):
      return jax.value_and_grad(loss, has_aux=True)(p)

  (got_loss, got_h), got_g = jax.jit(traced)(placed)
  np.testing.assert_allclose(got_h, want_h, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for name in ("router", "we_gate", "we_down", "wq"):
    np.testing.assert_allclose(got_g["layers"][name], want_g["layers"][name], atol=1e-4,
                               rtol=1e-3, err_msg=name)


def test_expert_parallel_forward_splits_every_layers_flops_over_the_expert_axis():
  """Per-device FLOPs of the compiled forward with experts over 8 devices: an eighth of one
  device's (attention, dense layers and experts alike), not one device's attention plus an
  eighth of the experts as when tokens were replicated over "expert"."""
  model = tiny_moe()
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, (8, 32)))
  params = params_of(model)

  def flops(mesh):
    shardings = tree_shardings(logical_axes(model), params, TRAINING_RULES, mesh)

    def run(p, ids):
      with activation_rules(TRAINING_RULES, mesh):
        return routed(with_params(model, p), ids)[0]

    compiled = jax.jit(run).lower(jax.device_put(params, shardings), ids).compile()
    return compiled.cost_analysis()["flops"]

  one = flops(make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
  eight = flops(make_mesh(MeshConfig(fsdp=1, expert=8), jax.devices()))
  assert eight <= 1.3 * one / 8, (one, eight)


def test_moe_config_errors_are_one_line():
  with pytest.raises(UserError, match="experts_per_token=3 exceeds num_experts=2"):
    MoeConfig(num_experts=2, experts_per_token=3)
  with pytest.raises(UserError, match="LoRA targets .*w_gate"):
    tiny_moe(lora=models.LoraConfig(rank=2, targets=("wq", "w_gate")))


# ------------------------------------------------------------------ Hugging Face


def test_config_reads_experts_and_refuses_dense_layers_between():
  cfg = config_from_hf(fixture_config(), "config.json")
  assert cfg.moe == MoeConfig(num_experts=8, experts_per_token=2, intermediate_size=48,
                              norm_topk_prob=True)
  assert cfg.qk_norm and cfg.head_dim == 32
  for change in ({"decoder_sparse_step": 2}, {"mlp_only_layers": [0]}):
    with pytest.raises(UserError) as info:
      config_from_hf({**fixture_config(), **change}, "/m/config.json")
    assert str(info.value).startswith("/m/config.json: ") and "every layer" in str(info.value)
  with pytest.raises(UserError, match="'moe_intermediate_size'"):
    config_from_hf({k: v for k, v in fixture_config().items()
                    if k != "moe_intermediate_size"}, "config.json")


def test_param_count_and_missing_expert_tensor_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  model, _ = models.load(os.path.join(FIXTURES, NAME), compute_dtype="float32")
  assert sum(x.size for x in jax.tree.leaves(params_of(model))) == model.config.num_params
  d = tmp_path / "m"
  import shutil
  shutil.copytree(os.path.join(FIXTURES, NAME), d)
  w = load_file(str(d / "model.safetensors"))
  del w["model.layers.1.mlp.experts.5.up_proj.weight"]
  save_file(w, str(d / "model.safetensors"))
  with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
    models.load(str(d))


def _logits(model, ids):
  h, _ = forward(model, ids)
  return np.asarray(model.logits(h))


def test_export_round_trip_gives_the_same_logits(tmp_path):
  model, tok = models.load(os.path.join(FIXTURES, NAME), compute_dtype="float32")
  save_pretrained(str(tmp_path), model.config, params_of(model), tok)
  with open(tmp_path / "config.json") as f:
    c = json.load(f)
  assert (c["model_type"], c["num_experts"], c["moe_intermediate_size"]) == ("qwen3_moe", 8, 48)
  back, _ = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config == model.config
  expected = np.load(os.path.join(FIXTURES, NAME, "expected.npz"))
  ours = _logits(model, expected["input_ids"])
  assert np.abs(_logits(back, expected["input_ids"]) - ours).max() <= ROUND_TRIP_TOL
  assert np.abs(ours - expected["logits"]).max() <= LOGIT_TOL


def test_mixtral_layout_round_trips(tmp_path):
  model = tiny_moe(seed=4)
  save_pretrained(str(tmp_path), model.config, params_of(model), char_tokenizer())
  with open(tmp_path / "config.json") as f:
    c = json.load(f)
  assert (c["model_type"], c["num_local_experts"], c["intermediate_size"]) == ("mixtral", 8, 16)
  back, _ = models.load(str(tmp_path), compute_dtype="float32")
  assert back.config.moe == model.config.moe
  ids = np.arange(30).reshape(2, 15)
  assert np.abs(_logits(back, ids) - _logits(model, ids)).max() <= ROUND_TRIP_TOL


_HF_SCRIPT = """
import sys, numpy as np, torch, transformers
ids = torch.tensor(np.load(sys.argv[1]))
for i, d in enumerate(sys.argv[3:]):
  m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                        attn_implementation="eager")
  with torch.no_grad():
    np.save(f"{sys.argv[2]}/{i}.npy", m(ids).logits.float().numpy())
"""


@pytest.mark.skipif(not _has_transformers(), reason=f"no transformers at {TRANSFORMERS_PYTHON}")
def test_transformers_loads_our_moe_exports_with_our_logits(tmp_path):
  ids = np.arange(40).reshape(2, 20) % 96  # Within both vocabularies.
  qwen, tok = models.load(os.path.join(FIXTURES, NAME), compute_dtype="float32")
  mixtral = tiny_moe(seed=5)
  dirs = [tmp_path / "qwen3_moe", tmp_path / "mixtral"]
  save_pretrained(str(dirs[0]), qwen.config, params_of(qwen), tok)
  save_pretrained(str(dirs[1]), mixtral.config, params_of(mixtral), char_tokenizer())
  np.save(tmp_path / "ids.npy", ids)
  done = subprocess.run([TRANSFORMERS_PYTHON, "-c", _HF_SCRIPT, str(tmp_path / "ids.npy"),
                         str(tmp_path), *map(str, dirs)], capture_output=True, text=True,
                        timeout=600, cwd=tmp_path, env={"PATH": os.environ.get("PATH", "")})
  assert done.returncode == 0, done.stderr[-3000:]
  for i, model in enumerate((qwen, mixtral)):
    diff = np.abs(np.load(tmp_path / f"{i}.npy") - _logits(model, ids)).max()
    assert diff <= LOGIT_TOL, (dirs[i], diff)
