"""Optimizer: AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses

import optax

from jaxrl_post.errors import UserError


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 1e-6
  warmup_steps: int = 0
  total_steps: int = 1000  # Cosine decay horizon, in optimizer steps.
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  max_grad_norm: float = 1.0

  def __post_init__(self):
    if self.learning_rate <= 0:
      raise UserError(f"optimizer config: learning_rate must be > 0, got {self.learning_rate}")
    if not 0 <= self.warmup_steps < self.total_steps:
      raise UserError(f"optimizer config: need 0 <= warmup_steps ({self.warmup_steps}) < "
                      f"total_steps ({self.total_steps})")
    if self.max_grad_norm <= 0:
      raise UserError(f"optimizer config: max_grad_norm must be > 0, got {self.max_grad_norm}")


def learning_rate_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if cfg.warmup_steps else cfg.learning_rate,
      peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=cfg.total_steps, end_value=cfg.learning_rate * cfg.final_lr_fraction)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                  weight_decay=cfg.weight_decay))
