"""Request bodies checked and turned into the service's own types, before anything queues.

Every mistake is a UserError naming the field and value: the HTTP layer answers it with a
400 at once, so a bad request never reaches the devices and never holds up another.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from jaxrl_post.errors import UserError
from jaxrl_post.rollout.sampling import SamplingParams, check_sampling
from jaxrl_post.serve import losses, wire
from jaxrl_post.serve.adapters import AdamParams, Row


def field(body: Any, name: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
  """body[name] checked against `kind` (a missing optional field gives `default`)."""
  if not isinstance(body, dict):
    raise UserError("request body: expected a JSON object")
  if body.get(name) is None:
    if default is dataclasses.MISSING:
      raise UserError(f"{name}: missing")
    return default
  value = body[name]
  ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not ok:
    raise UserError(f"{name}: expected {kind.__name__}, got {value!r}")
  return value


def rows(req: wire.ForwardBackwardRequest, slot: int, vocab: int, max_length: int) -> list[Row]:
  """The request's datums as adapter rows, each checked against the model and the loss."""
  loss, _ = losses.resolve(req.loss_fn, req.loss_fn_config)
  if not req.data:
    raise UserError("data: forward_backward needs at least one datum")
  out = []
  for i, datum in enumerate(req.data):
    n = len(datum.tokens)
    where = f"data[{i}]"
    if not 0 < n <= max_length:
      raise UserError(f"{where}.model_input: {n} tokens (1 to {max_length} allowed)")
    _check_ids(f"{where}.model_input", datum.tokens, vocab)
    inputs = dict(datum.inputs)
    if "weights" in loss.inputs and "weights" not in inputs:
      inputs["weights"] = np.ones((n,), np.float32)  # Every position trained.
    for name in ("target_tokens",) + loss.inputs:
      if name not in inputs:
        raise UserError(f"{where}.loss_fn_inputs: {req.loss_fn} needs {name!r}")
      if inputs[name].shape != (n,):
        raise UserError(f"{where}.loss_fn_inputs[{name!r}]: shape {list(inputs[name].shape)}, "
                        f"expected [{n}] (one per model_input token)")
    _check_ids(f"{where}.loss_fn_inputs['target_tokens']", inputs["target_tokens"], vocab)
    for name in loss.inputs:
      if not np.isfinite(inputs[name]).all():
        raise UserError(f"{where}.loss_fn_inputs[{name!r}]: not all finite")
    out.append(Row(slot, datum.tokens, inputs))
  return out


def _check_ids(where: str, ids: np.ndarray, vocab: int) -> None:
  bad = ids[(ids < 0) | (ids >= vocab)]
  if bad.size:
    raise UserError(f"{where}: token id {int(bad[0])} is outside the vocabulary (0 to {vocab - 1})")


def lora_targets(lora: dict, attn: tuple[str, ...], mlp: tuple[str, ...]) -> tuple[str, ...]:
  """The matrices create_model's lora_config trains: attention's and/or the MLP's."""
  targets = ((attn if field(lora, "train_attn", bool, True) else ())
             + (mlp if field(lora, "train_mlp", bool, True) else ()))
  if not targets:
    raise UserError("lora_config: train_attn and train_mlp are both false: nothing to train")
  return targets


def adam(body: dict) -> AdamParams:
  if body.get("optimizer_params") is not None:
    given = body["optimizer_params"]
    kind = given.get("type") if isinstance(given, dict) else None
    raise UserError(f"optimizer_params: {kind!r} is not supported; send adam_params (AdamW)")
  params = field(body, "adam_params", dict, {})
  known = {f.name for f in dataclasses.fields(AdamParams)}
  unknown = sorted(set(params) - known)
  if unknown:
    raise UserError(f"adam_params: unknown fields {unknown}")
  hp = AdamParams(**{k: float(field(params, k, float)) for k in params})
  if not hp.learning_rate >= 0 or not 0 <= hp.beta1 < 1 or not 0 <= hp.beta2 < 1:
    raise UserError(f"adam_params: learning_rate >= 0 and betas in [0, 1) needed, got {hp}")
  return hp


@dataclasses.dataclass(frozen=True)
class Sample:
  """One asample request."""

  prompt: tuple[int, ...]
  num_samples: int
  sampling: SamplingParams
  seed: Optional[int]
  prompt_logprobs: bool


def sample(body: dict, vocab: int, max_length: int, default_max_tokens: int,
           eos_ids: tuple[int, ...], encode) -> Sample:
  """An asample body; `encode` turns a stop string into token ids."""
  chunks = field(field(body, "prompt", dict), "chunks", list)
  prompt = []
  for i, chunk in enumerate(chunks):
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
      raise UserError(f"prompt.chunks[{i}]: only encoded_text chunks are supported")
    prompt += field(chunk, "tokens", list)
  if not prompt or not all(isinstance(t, int) for t in prompt):
    raise UserError("prompt: expected a non-empty list of token ids")
  _check_ids("prompt", np.asarray(prompt), vocab)
  num = field(body, "num_samples", int, 1)
  if not 1 <= num <= 256:
    raise UserError(f"num_samples: {num} (1 to 256 allowed)")
  params = field(body, "sampling_params", dict, {})
  max_tokens = field(params, "max_tokens", int, default_max_tokens)
  if len(prompt) + max_tokens > max_length:
    raise UserError(f"prompt + max_tokens: {len(prompt)} + {max_tokens} tokens exceed "
                    f"{max_length}")
  top_k = field(params, "top_k", int, -1)
  temperature = field(params, "temperature", float, 1.0)
  top_p = field(params, "top_p", float, 1.0)
  check_sampling(temperature, max(top_k, 0), top_p, max_tokens,
                 name=lambda f: f"sampling_params.{f}")
  stop = _stop_ids(params.get("stop"), eos_ids, encode, vocab)
  for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
    if field(body, name, int, 0):
      raise UserError(f"{name}: top-k logprobs are not supported by this server")
  if body.get("record_stability_info"):  # Only stable_reinforce reads it (losses.REFUSED).
    raise UserError("record_stability_info: this server records no stability information "
                    "(stable_reinforce is not served)")
  sampling = SamplingParams(temperature=float(temperature), top_k=max(top_k, 0),
                            top_p=float(top_p), max_tokens=max_tokens, stop_ids=stop)
  seed = field(params, "seed", int, None)
  return Sample(tuple(prompt), num, sampling, seed, bool(body.get("prompt_logprobs")))


def _stop_ids(stop, eos_ids, encode, vocab) -> tuple[int, ...]:
  """Tinker's stop: None is the model's end-of-sequence ids, [] nothing, ints are ids and
  strings must each be one token of the tokenizer's."""
  if stop is None:
    return tuple(eos_ids)
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list):
    raise UserError(f"sampling_params.stop: expected a string or a list, got {stop!r}")
  ids = []
  for s in stop:
    if isinstance(s, int) and not isinstance(s, bool) and 0 <= s < vocab:
      ids.append(s)
    elif isinstance(s, str) and len(encode(s)) == 1:
      ids.append(encode(s)[0])
    else:
      raise UserError(f"sampling_params.stop: {s!r} is not a token id or a one-token string")
  return tuple(ids)
