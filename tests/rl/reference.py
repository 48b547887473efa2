"""Hand-written NumPy references: explicit loops over rows and valid tokens, float64.

Written from the papers' definitions (min/max of surrogates, leave-one-out sums, the
GAE recursion over the list of valid positions), not as vectorised copies of the
implementation, so a sign, bound or normaliser slip in either shows up as a mismatch.
"""

import math

import numpy as np


def valid_positions(mask, b):
  return [t for t in range(mask.shape[1]) if mask[b, t]]


# ------------------------------------------------------------------------------ advantages


def grpo(rewards, k, eps, ddof):
  out = np.zeros(len(rewards))
  for g in range(len(rewards) // k):
    group = [float(r) for r in rewards[g * k:(g + 1) * k]]
    mean = sum(group) / k
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / (k - ddof))
    for i, r in enumerate(group):
      out[g * k + i] = 0.0 if max(group) == min(group) else (r - mean) / (std + eps)
  return out


def dr_grpo(rewards, k):
  out = np.zeros(len(rewards))
  for g in range(len(rewards) // k):
    group = [float(r) for r in rewards[g * k:(g + 1) * k]]
    for i, r in enumerate(group):
      out[g * k + i] = r - sum(group) / k
  return out


def rloo(rewards, k):
  out = np.zeros(len(rewards))
  for g in range(len(rewards) // k):
    group = [float(r) for r in rewards[g * k:(g + 1) * k]]
    for i, r in enumerate(group):
      others = [group[j] for j in range(k) if j != i]
      out[g * k + i] = r - sum(others) / (k - 1)
  return out


def reinforce_pp(rewards, mask, k, eps):
  centred = dr_grpo(rewards, k)
  tokens = [centred[b] for b in range(mask.shape[0]) for _ in valid_positions(mask, b)]
  mean = sum(tokens) / len(tokens)
  std = math.sqrt(sum((a - mean) ** 2 for a in tokens) / len(tokens))
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in valid_positions(mask, b):
      out[b, t] = (centred[b] - mean) / (std + eps)
  return out


def to_tokens(per_seq, mask):
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in valid_positions(mask, b):
      out[b, t] = per_seq[b]
  return out


def gae(rewards, values, mask, gamma, lam):
  """Recursion over each row's list of valid positions; bootstraps 0 after the last."""
  adv, ret = np.zeros(mask.shape), np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    pos = valid_positions(mask, b)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(pos):
      delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
      adv[b, t] = delta + gamma * lam * next_adv
      ret[b, t] = adv[b, t] + float(values[b, t])
      next_value, next_adv = float(values[b, t]), adv[b, t]
  return adv, ret


# ---------------------------------------------------------------------------------- losses


def clip(x, lo, hi):
  return min(max(x, lo), hi)


def surrogate(r, a, lo, hi):
  """(loss, d loss / d r, clipped-low, clipped-high) of -min(r a, clip(r) a)."""
  unclipped, clipped = -r * a, -clip(r, lo, hi) * a
  if clipped > unclipped:  # the clipped (constant) term is the max: no gradient
    return clipped, 0.0, r < 1.0, r > 1.0
  return unclipped, -a, False, False


def ppo(lp, old, adv, mask, cfg, dual=False):
  """Per-token loss, d loss / d lp, and clip indicators (low, high, dual)."""
  shape = mask.shape
  loss, grad, low, high, dual_on = (np.zeros(shape) for _ in range(5))
  for b in range(shape[0]):
    for t in valid_positions(mask, b):
      r, a = math.exp(float(lp[b, t]) - float(old[b, t])), float(adv[b, t])
      value, dr, lo, hi = surrogate(r, a, 1 - cfg.clip_low, 1 + cfg.clip_high)
      if dual and a < 0 and -cfg.clip_c * a < value:
        value, dr, dual_on[b, t] = -cfg.clip_c * a, 0.0, 1.0
      loss[b, t], grad[b, t], low[b, t], high[b, t] = value, dr * r, lo, hi
  return loss, grad, low, high, dual_on


def sequence_ratios(lp, old, mask):
  out = np.zeros(mask.shape[0])
  for b in range(mask.shape[0]):
    pos = valid_positions(mask, b)
    logs = [float(lp[b, t]) - float(old[b, t]) for t in pos]
    out[b] = math.exp(sum(logs) / len(logs)) if pos else 1.0
  return out


def gspo(lp, old, adv, mask, cfg):
  """Per-token loss, GSPO-token gradient (d loss_t / d lp_t = f'(s) s), indicators."""
  s = sequence_ratios(lp, old, mask)
  loss, grad, low, high = (np.zeros(mask.shape) for _ in range(4))
  for b in range(mask.shape[0]):
    for t in valid_positions(mask, b):
      value, ds, lo, hi = surrogate(s[b], float(adv[b, t]), 1 - cfg.clip_low, 1 + cfg.clip_high)
      loss[b, t], grad[b, t], low[b, t], high[b, t] = value, ds * s[b], lo, hi
  return loss, grad, low, high


def gspo_sequence_grad(lp, old, seq_adv, mask, cfg, weights):
  """Gradient of the plain sequence objective sum_t w_b f(s_b, A_b) w.r.t. each lp_t,
  through s_b = exp(mean_t log ratio): every token of b receives L_b w_b f'(s_b) s_b / L_b."""
  s = sequence_ratios(lp, old, mask)
  grad = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    pos = valid_positions(mask, b)
    _, ds, _, _ = surrogate(s[b], float(seq_adv[b]), 1 - cfg.clip_low, 1 + cfg.clip_high)
    total = sum(weights[b, t] for t in pos) * ds
    for t in pos:
      grad[b, t] = total * s[b] / len(pos)
  return grad


def cispo(lp, old, adv, mask, cfg):
  loss, grad, low, high = (np.zeros(mask.shape) for _ in range(4))
  for b in range(mask.shape[0]):
    for t in valid_positions(mask, b):
      r = math.exp(float(lp[b, t]) - float(old[b, t]))
      w = clip(r, 1 - cfg.clip_low, 1 + cfg.clip_high)
      loss[b, t] = -w * float(adv[b, t]) * float(lp[b, t])
      grad[b, t] = -w * float(adv[b, t])
      low[b, t], high[b, t] = r < 1 - cfg.clip_low, r > 1 + cfg.clip_high
  return loss, grad, low, high


def kl(lp, ref, mask, estimator):
  """Per-token KL estimate and its derivative w.r.t. lp."""
  value, grad = np.zeros(mask.shape), np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    for t in valid_positions(mask, b):
      x = float(lp[b, t]) - float(ref[b, t])  # log p - log ref
      if estimator == "k1":
        value[b, t], grad[b, t] = x, 1.0
      elif estimator == "k2":
        value[b, t], grad[b, t] = 0.5 * x * x, x
      else:
        value[b, t], grad[b, t] = math.exp(-x) + x - 1.0, 1.0 - math.exp(-x)
  return value, grad


def aggregation_weights(mask, mode, full_mask, norm_length=None):
  """w[b, t] with loss = sum_{valid b, t} w[b, t] * loss[b, t]; normalisers from full_mask."""
  lengths = [len(valid_positions(full_mask, b)) for b in range(full_mask.shape[0])]
  tokens, sequences = sum(lengths), sum(1 for n in lengths if n > 0)
  w = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    pos = valid_positions(mask, b)
    for t in pos:
      if mode == "token-mean":
        w[b, t] = 1.0 / tokens
      elif mode == "seq-mean-token-mean":
        w[b, t] = 1.0 / (len(pos) * sequences)
      elif mode == "seq-mean-token-sum":
        w[b, t] = 1.0 / sequences
      else:
        w[b, t] = 1.0 / (sequences * norm_length)
  return w


def weighted_sum(w, x, mask):
  return sum(w[b, t] * x[b, t] for b in range(mask.shape[0]) for t in valid_positions(mask, b))
