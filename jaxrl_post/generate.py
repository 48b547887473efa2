"""Generate from a model: python -m jaxrl_post.generate --prompt TEXT [--chat] [--json],
or a file of prompts at once: --prompts IN.jsonl --out OUT.jsonl [--n K].

  --model NAME_OR_PATH   embedded name (default smollm2-135m-instruct), GGUF file or
                         Hugging Face directory
  --checkpoint WORKDIR   a training run's policy instead (its newest checkpoint, or --step N);
                         LoRA adapters are merged, the tokenizer is the run's
  --chat                 wrap the prompt as a user turn in the model's chat template
  --temperature 0        greedy decoding
  --json                 print exactly one JSON object:
                         {"prompt_token_ids", "output_token_ids", "output_text"}
  --compilation_cache=PATH|off
                         persistent XLA compilation cache (default: ~/.cache/jaxrl_post/xla)

Batch (--prompts): every line of IN.jsonl is a JSON object with a "prompt" string (or
"question" / "problem", as the tasks' files have), or chat "messages" ([{"role", "content"},
...], always rendered with the chat template). Each row gets --n completions; all rows are
decoded together with continuous batching. OUT.jsonl has one line per row read, in input
order: {"line", "prompt" or "messages", "prompt_token_ids", "completions": [{"text",
"token_ids", "logprobs", "finish_reason"}]}. Rows that cannot be used are skipped and counted
by reason. The row on line L samples with seed --seed + L - 1.

Decoding runs on the rollout engine (paged KV cache), the same code path as RL rollouts.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from typing import Any, Optional

from jaxrl_post import compile_cache
from jaxrl_post.errors import UserError
from jaxrl_post.rewards import jsonl

DEFAULT_MODEL = "smollm2-135m-instruct"

# Why a --prompts row was skipped, beside rewards.jsonl's INVALID_JSON and NOT_AN_OBJECT.
MISSING_FIELD = "missing_field"  # No "prompt" / "question" / "problem" / "messages", or empty.
BAD_MESSAGES = "bad_messages"  # "messages" is not a list of {"role": str, "content": str}.
CHAT_TEMPLATE_ERROR = "chat_template_error"  # The model's template refused the messages.
EMPTY_PROMPT = "empty_prompt"  # No tokens after tokenization.
TOO_LONG = "too_long"  # Prompt + --max-new-tokens over the model's context.
_TEXT_FIELDS = ("prompt", "question", "problem")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.generate",
                              description="Generate text from a language model.")
  p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, GGUF file or HF dir")
  p.add_argument("--checkpoint", default=None, metavar="WORKDIR",
                 help="generate from a training run's checkpoint (overrides --model)")
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  source = p.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="prompt text")
  source.add_argument("--prompts", metavar="FILE.jsonl", help="one JSON prompt per line")
  p.add_argument("--out", metavar="FILE.jsonl", help="where --prompts writes its completions")
  p.add_argument("--n", type=int, default=1, help="completions per --prompts row")
  p.add_argument("--num-slots", type=int, default=None,
                 help="sequences --prompts decodes together (default: every row's --n "
                      "completions at once, as many as the KV pool's default budget holds)")
  p.add_argument("--chat", action="store_true", help="apply the model's chat template")
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.7, help="0 means greedy")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                 help="compute dtype (auto: float32 on CPU, bfloat16 on accelerators)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  compile_cache.add_cache_flag(p)
  return p.parse_args(argv)


def _engine_for(model, longest_prompt: int, max_new_tokens: int, num_stop_ids: int,
                sequences: int = 1, num_slots: Optional[int] = None):
  """An engine for decoding `sequences` sequences, whose page pool holds a full sequence
  in every slot.

  num_slots None decodes them all at once, as many as fit the default pool budget
  (PoolConfig: a share of free device memory, or a fixed budget on the CPU) up to
  MAX_SLOTS; an explicit num_slots is used as given, no wider than the work.
  """
  from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig
  from jaxrl_post.rollout.engine import MAX_SLOTS
  from jaxrl_post.rollout.pages import sequences_held
  from jaxrl_post.rollout.pages import cdiv, host_available_bytes, resolve_num_pages

  page_size = 16
  context = model.config.max_position_embeddings
  # Whole pages, no more: every decode step attends over each slot's table of
  # max_seq_len / page_size pages (the table's floor, min_table_pages, is wider).
  max_seq_len = min(cdiv(longest_prompt + max_new_tokens, page_size) * page_size, context)
  seq_pages = cdiv(max_seq_len, page_size)
  # The prefix cache: a batch of chat prompts shares the template's system turn, which is
  # then prefilled once (on bench_generate's 300 prompts it halved the prefill). 16 prompts
  # per prefill call: half the calls of the default 8, and fewer distinct packed shapes
  # to compile (a call's row count varies less).
  config = EngineConfig(num_slots=None if num_slots is None else min(num_slots, sequences),
                        decode_steps=16, prefill_chunk=256, prefill_rows=16,
                        max_seq_len=max_seq_len, max_stop_ids=max(1, num_stop_ids),
                        prefix_cache=True)
  # Without memory stats (the CPU) the devices' memory is the host's: a quarter of what it
  # has free, if more than PoolConfig's fixed fallback. That fallback held 181 of
  # bench_generate's 300 chat prompts, which then decoded in two waves.
  fallback = max(PoolConfig.fallback_bytes, host_available_bytes() // 4)
  budget = resolve_num_pages(PoolConfig(page_size=page_size, fallback_bytes=fallback),
                             model.config, model.config.compute_dtype)
  held = max(1, sequences_held(budget, seq_pages))  # One sequence even past the budget.
  config = config.sized_for(sequences, capacity=min(held, MAX_SLOTS))
  pages = config.num_slots * seq_pages + 1  # + the page that padding writes to.
  config = dataclasses.replace(config, pool=PoolConfig(page_size=page_size, num_pages=pages))
  return Engine.from_model(model, config)


def _load(args: argparse.Namespace):
  """(model, tokenizer) from --checkpoint (a run directory) or --model."""
  import jax

  from jaxrl_post import models

  dtype = args.dtype
  if dtype == "auto":
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
  if args.checkpoint is None:
    if args.step is not None:
      raise UserError("--step needs --checkpoint WORKDIR")
    return models.load(args.model, compute_dtype=dtype)
  from jaxrl_post.pipeline.trained import load_trained

  policy = load_trained(args.checkpoint, args.step)
  return policy.model(compute_dtype=dtype), policy.tokenizer


def run(args: argparse.Namespace) -> dict:
  """One prompt: {"prompt_token_ids", "output_token_ids", "output_text"}."""
  from jaxrl_post.rollout import Request, SamplingParams, generate

  model, tok = _load(args)
  if args.chat:
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
  else:
    prompt_ids = tok.encode(args.prompt)
  sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                            stop_ids=tok.stop_ids)
  engine = _engine_for(model, len(prompt_ids), sampling.max_tokens, len(tok.stop_ids))
  completion = generate(engine, [Request(tuple(prompt_ids), seed=args.seed)],
                        sampling=sampling)[0][0]
  out = list(completion.tokens)
  return {"prompt_token_ids": prompt_ids, "output_token_ids": out,
          "output_text": tok.decode(out, skip_special_tokens=True)}


# ------------------------------------------------------------------------------ batch


@dataclasses.dataclass
class PromptRow:
  """A usable --prompts row: its 1-based line, what it asked ({"prompt": text} or
  {"messages": [...]}, echoed in the output) and, once tokenized, its ids."""

  line: int
  source: dict[str, Any]
  ids: Optional[list[int]] = None


def read_prompt_rows(path: str, skipped: collections.Counter) -> list[PromptRow]:
  """The usable rows of a prompts file; the others are counted into `skipped` by reason."""
  rows = []
  for line, raw in jsonl.lines(path, flag="--prompts"):
    try:
      rows.append(PromptRow(line, _parse_prompt_row(raw)))
    except jsonl.Skip as skip:
      skipped[skip.reason] += 1
  if not rows:
    raise UserError(f"{path}: no usable rows ({_counts(skipped) or 'the file is empty'})")
  return rows


def _parse_prompt_row(raw: bytes) -> dict[str, Any]:
  row = jsonl.json_object(raw)
  if "messages" in row:
    return {"messages": _messages(row["messages"])}
  for key in _TEXT_FIELDS:  # The first one present is the prompt, valid or not.
    if key in row:
      text = row[key]
      if not isinstance(text, str) or not text.strip():
        raise jsonl.Skip(MISSING_FIELD)
      return {"prompt": text}  # Unstripped: a completion prompt's spacing matters.
  raise jsonl.Skip(MISSING_FIELD)


def _messages(value: Any) -> list[dict[str, Any]]:
  ok = isinstance(value, list) and len(value) > 0 and all(
      isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
      for m in value)
  if not ok:
    raise jsonl.Skip(BAD_MESSAGES)
  return value


def tokenize_rows(rows: list[PromptRow], tok, *, chat: bool, max_new_tokens: int,
                  context: int, skipped: collections.Counter) -> list[PromptRow]:
  """Sets each row's ids; drops (and counts) rows that cannot be decoded in the context."""
  kept = []
  for row in rows:
    try:
      if "messages" in row.source:
        ids = tok.encode_chat(row.source["messages"])
      elif chat:
        ids = tok.encode_chat([{"role": "user", "content": row.source["prompt"]}])
      else:
        ids = tok.encode(row.source["prompt"])
    except UserError:  # The template's raise_exception, e.g. roles that do not alternate.
      skipped[CHAT_TEMPLATE_ERROR] += 1
      continue
    if not ids:
      skipped[EMPTY_PROMPT] += 1
    elif len(ids) + max_new_tokens > context:
      skipped[TOO_LONG] += 1
    else:
      row.ids = ids
      kept.append(row)
  return kept


def _check_batch_args(args: argparse.Namespace) -> None:
  """Flag mistakes, and an --out that cannot be written, before the model is loaded."""
  if args.out is None:
    raise UserError("--prompts needs --out FILE.jsonl for the completions")
  if args.json:
    raise UserError("--json is for --prompt; --prompts writes JSON lines to --out")
  if args.n < 1:
    raise UserError(f"--n must be >= 1, got {args.n}")
  if args.num_slots is not None and args.num_slots < 1:
    raise UserError(f"--num-slots must be >= 1, got {args.num_slots}")
  out = args.out
  if os.path.isdir(out):
    raise UserError(f"{out}: is a directory; --out takes a file path")
  parent = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(parent):
    raise UserError(f"{out}: directory {parent} does not exist (--out)")
  if not os.access(parent, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
    raise UserError(f"{out}: not writable (--out)")
  both = os.path.exists(out) and os.path.exists(args.prompts)
  if both and os.path.samefile(out, args.prompts):
    raise UserError(f"{out}: is the --prompts file; write the completions elsewhere")


def run_batch(args: argparse.Namespace) -> dict:
  """--prompts: every usable row's --n completions into --out; returns a summary
  {"rows", "completions", "skipped": {reason: count}, "out"}."""
  from jaxrl_post.rollout import SamplingParams

  _check_batch_args(args)
  skipped: collections.Counter = collections.Counter()
  rows = read_prompt_rows(args.prompts, skipped)
  model, tok = _load(args)
  if args.chat and not tok.chat_template:
    raise UserError(f"{tok.source}: the model has no chat template (drop --chat)")
  rows = tokenize_rows(rows, tok, chat=args.chat, max_new_tokens=args.max_new_tokens,
                       context=model.config.max_position_embeddings, skipped=skipped)
  if not rows:
    raise UserError(f"{args.prompts}: no usable rows ({_counts(skipped)})")
  sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_new_tokens,
                            stop_ids=tok.stop_ids)
  engine = _engine_for(model, max(len(r.ids) for r in rows), sampling.max_tokens,
                       len(tok.stop_ids), len(rows) * args.n, args.num_slots)
  completions = _decode_all(engine, rows, sampling, args.n, args.seed)
  _write_rows(args.out, (_output_row(r, c, tok) for r, c in zip(rows, completions)))
  return {"rows": len(rows), "completions": len(rows) * args.n, "out": args.out,
          "skipped": dict(sorted(skipped.items()))}


def _decode_all(engine, rows: list[PromptRow], sampling, n: int, seed: int) -> list[list]:
  """Every row's n completions, all rows in one scheduler (continuous batching), with a
  progress bar on stderr. The same submissions `rollout.generate` makes; driven here step
  by step so the bar can count finished completions."""
  from jaxrl_post.rollout import Scheduler, SchedulerConfig
  from jaxrl_post.telemetry.progress import ProgressBar

  # The whole job is in hand: prefill every prompt the slots hold before decoding, so each
  # decode call runs the widest batch (interleaving, the scheduler's default for a stream
  # of requests, decoded the first prompts in narrow calls while the rest waited).
  prompt_tokens = sum(len(row.ids) for row in rows)
  config = SchedulerConfig()
  sched = Scheduler(engine, dataclasses.replace(
      config, prefill_tokens_per_step=max(config.prefill_tokens_per_step, prompt_tokens)))
  # A row's seed comes from its line, not its rank among usable rows, so skipping a bad
  # row elsewhere in the file does not change this one's samples.
  ids = [sched.submit(row.ids, sampling, n=n, seed=seed + row.line - 1) for row in rows]
  engine.compile_ahead(sampling, max(len(row.ids) for row in rows), len(rows), n)
  done = tokens = 0
  start = time.monotonic()
  with ProgressBar(len(rows) * n, label="completions") as bar:
    while not sched.idle:
      finished = sched.step()
      done += len(finished)
      tokens += sum(len(c.tokens) for *_, c in finished)
      if finished:
        bar.update(done, tokens_per_s=tokens / max(time.monotonic() - start, 1e-9))
  return [sched.results[i] for i in ids]


def _output_row(row: PromptRow, completions: list, tok) -> dict[str, Any]:
  return {"line": row.line, **row.source, "prompt_token_ids": row.ids,
          "completions": [{"text": tok.decode(c.tokens, skip_special_tokens=True),
                           "token_ids": list(c.tokens),
                           "logprobs": [float(x) for x in c.logprobs],
                           "finish_reason": c.finish_reason} for c in completions]}


def _write_rows(path: str, rows) -> None:
  """Writes beside `path` then renames, so a failed run leaves no half-written file."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
  except OSError as e:
    raise UserError(f"{path}: cannot be written ({e.strerror})") from None
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _counts(skipped: dict[str, int]) -> str:
  return ", ".join(f"{reason}={count}" for reason, count in sorted(skipped.items()))


def _summary_line(summary: dict) -> str:
  """'wrote 8 rows, 16 completions to out.jsonl; skipped 2 rows (invalid_json=1, ...)'."""
  skipped = sum(summary["skipped"].values())
  reasons = f" ({_counts(summary['skipped'])})" if skipped else ""
  return (f"wrote {summary['rows']} rows, {summary['completions']} completions to "
          f"{summary['out']}; skipped {skipped} rows{reasons}")


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache)
  try:
    if args.prompts is not None:
      summary = run_batch(args)
    else:
      if args.out is not None or args.n != 1:
        raise UserError("--out and --n are for --prompts FILE.jsonl")
      result = run(args)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.prompts is not None:
    print(_summary_line(summary))
  elif args.json:
    print(json.dumps(result, ensure_ascii=False))
  else:
    print(result["output_text"])
  return 0


if __name__ == "__main__":
  sys.exit(main())
