"""Registry and config validation: unknown names and bad values are one-line UserErrors
that name the field (and, for names, the known choices)."""

import pytest

from jaxrl_post.errors import UserError
from jaxrl_post.rl import (AdvantageConfig, KLPenaltyConfig, LossConfig,
                           OffPolicyConfig, OverlongConfig)
from jaxrl_post.rl.registry import Registry

BAD = [
    (lambda: AdvantageConfig("grpo_plus", group_size=4), ["name='grpo_plus'", "dr_grpo", "gae",
                                                          "grpo", "reinforce_pp", "rloo"]),
    (lambda: AdvantageConfig("grpo"), ["group_size >= 2"]),
    (lambda: AdvantageConfig("rloo", group_size=0), ["group_size", "0"]),
    (lambda: AdvantageConfig("gae", gamma=1.5), ["gamma", "1.5"]),
    (lambda: AdvantageConfig("gae", lam=-0.1), ["lam"]),
    (lambda: AdvantageConfig("grpo", group_size=4, eps=0.0), ["eps"]),
    (lambda: AdvantageConfig("grpo", group_size=4, std_ddof=2), ["std_ddof"]),
    (lambda: LossConfig("ppo2"), ["name='ppo2'", "cispo", "dual_clip", "gspo", "ppo"]),
    (lambda: LossConfig(aggregation="mean"), ["aggregation='mean'", "seq-mean-token-sum-norm",
                                              "token-mean"]),
    (lambda: LossConfig(kl_estimator="k4"), ["kl_estimator='k4'", "k1", "k2", "k3"]),
    (lambda: LossConfig(aggregation="seq-mean-token-sum-norm"), ["norm_length", "None"]),
    (lambda: LossConfig(clip_low=1.5), ["clip_low", "1.5"]),
    (lambda: LossConfig(clip_high=-0.1), ["clip_high"]),
    (lambda: LossConfig(clip_c=1.0), ["clip_c"]),
    (lambda: LossConfig(kl_coef=-1.0), ["kl_coef"]),
    (lambda: LossConfig(entropy_coef=-1.0), ["entropy_coef"]),
    (lambda: KLPenaltyConfig(0.1, estimator="k9"), ["estimator='k9'", "k3"]),
    (lambda: KLPenaltyConfig(0.1, level="batch"), ["level='batch'"]),
    (lambda: KLPenaltyConfig(-0.1), ["beta"]),
    (lambda: OffPolicyConfig(tis_cap=0.0), ["tis_cap"]),
    (lambda: OffPolicyConfig(seq_mask="arith"), ["seq_mask='arith'", "geometric"]),
    (lambda: OffPolicyConfig(seq_low=1.2), ["seq_low"]),
    (lambda: OffPolicyConfig(seq_high=0.9), ["seq_high"]),
    (lambda: OverlongConfig(100, 0), ["buffer"]),
    (lambda: OverlongConfig(100, 101), ["buffer"]),
]


@pytest.mark.parametrize("make,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_is_a_one_line_user_error(make, words):
  with pytest.raises(UserError) as info:
    make()
  message = str(info.value)
  assert "\n" not in message
  for word in words:
    assert word in message


def test_good_configs():
  AdvantageConfig("gae", gamma=0.99, lam=0.95)
  AdvantageConfig("reinforce_pp", group_size=2)
  LossConfig("gspo", clip_low=3e-4, clip_high=4e-4, aggregation="seq-mean-token-mean")
  LossConfig("cispo", clip_low=1.0, clip_high=0.28)
  LossConfig("dual_clip", aggregation="seq-mean-token-sum-norm", norm_length=4096)
  OffPolicyConfig(tis_cap=float("inf"), seq_mask="max")
  hash(LossConfig())  # frozen and hashable: usable as a static jit argument


def test_each_loss_defaults_to_its_papers_aggregation():
  assert LossConfig("gspo").aggregation == "seq-mean-token-mean"  # GSPO: sequence mean.
  assert LossConfig("ppo").aggregation == "token-mean"
  assert LossConfig("cispo").aggregation == "token-mean"
  assert LossConfig("gspo", aggregation="token-mean").aggregation == "token-mean"
  assert LossConfig("gspo") == LossConfig("gspo", aggregation="seq-mean-token-mean")


def test_registry_refuses_duplicates():
  registry = Registry("thing")
  registry.register("a")(len)
  with pytest.raises(ValueError, match="twice"):
    registry.register("a")(len)
  assert registry.names() == ("a",) and "a" in registry and registry.get("a") is len
