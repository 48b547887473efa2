"""Generate from a model: python -m jaxrl_post.generate --prompt TEXT [--chat] [--json],
or a file of prompts at once: --prompts IN.jsonl --out OUT.jsonl [--n K].

  --model NAME_OR_PATH   embedded name (default smollm2-135m-instruct), GGUF file or
                         Hugging Face directory
  --checkpoint WORKDIR   a training run's policy instead (its newest checkpoint, or --step N);
                         LoRA adapters are merged, the tokenizer is the run's
  --chat                 wrap the prompt as a user turn in the model's chat template
  --temperature 0        greedy decoding
  --top-k K, --top-p P   sample from the K most likely tokens / the smallest set with mass
                         >= P (after --temperature); logprobs are over that renormalised set
  --json                 print exactly one JSON object:
                         {"prompt_token_ids", "output_token_ids", "output_text"}
  --compilation_cache=PATH|off
                         persistent XLA compilation cache (default: ~/.cache/jaxrl_post/xla)

Batch (--prompts): every line of IN.jsonl is a JSON object with a "prompt" string (or
"question" / "problem", as the tasks' files have), or chat "messages" ([{"role", "content"},
...], always rendered with the chat template). Each row gets --n completions; all rows are
decoded together with continuous batching. OUT.jsonl has one line per row read:
{"line", "prompt" or "messages", "prompt_token_ids", "completions": [{"text", "token_ids",
"logprobs", "finish_reason"}]}. A row's line is written (and flushed) as soon as its
completions finish; once every row is done the file is put in input order. Rows that cannot
be used are skipped and counted by reason. The row on line L samples with seed
--seed + L - 1, so a job killed midway and rerun with --resume (rows whose "line" is already
in OUT.jsonl are kept and not decoded again) ends with the file an uninterrupted run writes.

Decoding runs on the rollout engine (paged KV cache), the same code path as RL rollouts,
data-parallel over every local device (decode slots and KV pages split between them).
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
  p.add_argument("--model", default=DEFAULT_MODEL, help="embedded name, GGUF file, HF dir or hub id")
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
  p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0: all)")
  p.add_argument("--top-p", type=float, default=1.0,
                 help="keep the smallest set of most likely tokens with mass >= P (1: all)")
  p.add_argument("--resume", action="store_true",
                 help="keep the rows already in --out and decode only the others")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                 help="compute dtype (auto: float32 on CPU, bfloat16 on accelerators)")
  p.add_argument("--json", action="store_true", help="print one JSON object")
  compile_cache.add_cache_flag(p)
  return p.parse_args(argv)


def local_mesh():
  """A data-parallel rollout mesh over this process's devices: each device decodes its own
  share of the slots from its own pages and a full copy of the weights (a generate job's
  sequences are independent, so the devices never talk during decoding)."""
  import jax

  from jaxrl_post.sharding import MeshConfig, make_mesh

  return make_mesh(MeshConfig(data=-1, fsdp=1), jax.local_devices())


def _engine_for(model, longest_prompt: int, max_new_tokens: int, num_stop_ids: int,
                sequences: int = 1, num_slots: Optional[int] = None, mesh=None):
  """An engine for decoding `sequences` sequences, whose page pool holds a full sequence
  in every slot.

  num_slots None decodes them all at once, as many as fit the default pool budget
  (PoolConfig: a share of free device memory, or a fixed budget on the CPU) up to
  MAX_SLOTS; an explicit num_slots is used as given, no wider than the work. mesh: a
  rollout mesh whose "data" shards each hold their share of the slots and pages (None:
  the first device).
  """
  from jaxrl_post.rollout import Engine, EngineConfig, PoolConfig
  from jaxrl_post.rollout.engine import MAX_SLOTS
  from jaxrl_post.rollout.layout import batch_shards
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
  shards = 1 if mesh is None else batch_shards(mesh)
  device = None if mesh is None else mesh.devices.flat[0]
  budget = resolve_num_pages(PoolConfig(page_size=page_size, fallback_bytes=fallback),
                             model.config, model.config.compute_dtype, device,
                             data_shards=shards)  # Pages per shard.
  held = max(1, sequences_held(budget, seq_pages))  # One sequence even past the budget.
  config = config.sized_for(sequences, capacity=min(held * shards, MAX_SLOTS))
  # The engine rounds the slots up to whole shards; each shard's pool holds its slots'.
  pages = cdiv(config.num_slots, shards) * seq_pages + 1  # + the page padding writes to.
  config = dataclasses.replace(config, pool=PoolConfig(page_size=page_size, num_pages=pages))
  return Engine.from_model(model, config, mesh=mesh)


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


# SamplingParams' fields as this command's flags spell them.
_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
          "max_tokens": "--max-new-tokens"}


def _check_sampling_args(args: argparse.Namespace) -> None:
  """The sampling flags' mistakes (SamplingParams' own checks), named by flag, before the
  model is loaded."""
  from jaxrl_post.rollout.sampling import check_sampling

  check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens,
                 name=_FLAGS.__getitem__)


def _sampling(args: argparse.Namespace, tok):
  """The flags' SamplingParams. Completions report the engine's behaviour logprobs: under
  --top-k / --top-p, over the kept tokens renormalised (what each token was drawn from)."""
  from jaxrl_post.rollout import SamplingParams

  return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_tokens=args.max_new_tokens, stop_ids=tok.stop_ids)


def run(args: argparse.Namespace) -> dict:
  """One prompt: {"prompt_token_ids", "output_token_ids", "output_text"}."""
  from jaxrl_post.rollout import Request, generate

  model, tok = _load(args)
  if args.chat:
    prompt_ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
  else:
    prompt_ids = tok.encode(args.prompt)
  sampling = _sampling(args, tok)
  engine = _engine_for(model, len(prompt_ids), sampling.max_tokens, len(tok.stop_ids),
                       mesh=local_mesh())
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
  {"rows", "completions", "resumed", "skipped": {reason: count}, "out"}."""
  _check_batch_args(args)
  skipped: collections.Counter = collections.Counter()
  rows = read_prompt_rows(args.prompts, skipped)
  done = _resume_rows(args.out, rows) if args.resume else {}
  rows = [row for row in rows if row.line not in done]
  written = _decode_rows(args, rows, skipped, done) if rows else 0
  if os.path.exists(args.out):
    _sort_out(args.out)
  return {"rows": written, "completions": written * args.n, "resumed": len(done),
          "out": args.out, "skipped": dict(sorted(skipped.items()))}


def _decode_rows(args: argparse.Namespace, rows: list[PromptRow],
                 skipped: collections.Counter, kept: dict[int, str]) -> int:
  """Loads the model, decodes the rows and writes each to --out (after the `kept` rows)
  as it finishes; returns how many were written (the others are counted into `skipped`).
  --out is opened only once the model and prompts are ready: a mistake found before that
  leaves it untouched."""
  model, tok = _load(args)
  if args.chat and not tok.chat_template:
    raise UserError(f"{tok.source}: the model has no chat template (drop --chat)")
  rows = tokenize_rows(rows, tok, chat=args.chat, max_new_tokens=args.max_new_tokens,
                       context=model.config.max_position_embeddings, skipped=skipped)
  if not rows:
    if args.resume:
      return 0  # What is left cannot be decoded; the rows already there stand.
    raise UserError(f"{args.prompts}: no usable rows ({_counts(skipped)})")
  sampling = _sampling(args, tok)
  engine = _engine_for(model, max(len(r.ids) for r in rows), sampling.max_tokens,
                       len(tok.stop_ids), len(rows) * args.n, args.num_slots,
                       mesh=local_mesh())
  with open_out(args.out, kept) as out:
    _decode_all(engine, rows, sampling, args.n, args.seed,
                on_row=lambda row, completions: out.write(_output_row(row, completions, tok)))
  return len(rows)


def _decode_all(engine, rows: list[PromptRow], sampling, n: int, seed: int,
                on_row=None) -> list[list]:
  """Every row's n completions, all rows in one scheduler (continuous batching), with a
  progress bar on stderr. The same submissions `rollout.generate` makes; driven here step
  by step so the bar can count finished completions, and so that on_row(row, completions)
  gets each row as soon as its n completions are done (a killed job keeps them)."""
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
  row_of = dict(zip(ids, rows))
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
      for rid in sched.completed(finished) if on_row is not None else []:
        on_row(row_of[rid], sched.results[rid])
  return [sched.results[i] for i in ids]


def _output_row(row: PromptRow, completions: list, tok) -> dict[str, Any]:
  return {"line": row.line, **row.source, "prompt_token_ids": row.ids,
          "completions": [{"text": tok.decode(c.tokens, skip_special_tokens=True),
                           "token_ids": list(c.tokens),
                           "logprobs": [float(x) for x in c.logprobs],
                           "finish_reason": c.finish_reason} for c in completions]}


# ------------------------------------------------------------------------------ --out


def _read_out(path: str) -> dict[int, str]:
  """The complete rows of an --out file by line: {line: its JSON text}. A line that does
  not parse (the half-written last line of a killed job) is dropped; the first row of a
  line wins."""
  rows: dict[int, str] = {}
  try:
    with open(path, "rb") as f:
      for raw in f:
        try:
          row = json.loads(raw)
        except ValueError:
          continue
        line = row.get("line") if isinstance(row, dict) else None
        if isinstance(line, int) and raw.endswith(b"\n"):
          rows.setdefault(line, raw.decode("utf-8").rstrip("\n"))
  except OSError as e:
    raise UserError(f"{path}: cannot be read ({e.strerror}) (--out)") from None
  return rows


def _resume_rows(path: str, rows: list[PromptRow]) -> dict[int, str]:
  """The rows of --out that --resume keeps. Each must echo the prompt on its line of the
  prompts file: a different file would otherwise mix two jobs' completions silently."""
  if not os.path.exists(path):
    return {}
  done = _read_out(path)
  source = {row.line: row.source for row in rows}
  for line, text in done.items():
    row = json.loads(text)
    if line not in source or any(row.get(k) != v for k, v in source[line].items()):
      raise UserError(f"{path}: its row for line {line} does not match that line of the "
                      "--prompts file (--resume continues the same job)")
  return done


class open_out:
  """--out opened for rows as they finish: emptied, or with --resume rewritten to the kept
  rows (dropping a half-written line, which appending would otherwise extend). Each row is
  flushed as it is written, so a killed job loses only the rows it was decoding."""

  def __init__(self, path: str, kept: dict[int, str]):
    self.path = path
    try:
      _replace(path, kept.values())
      self.file = open(path, "a", encoding="utf-8")
    except OSError as e:
      raise UserError(f"{path}: cannot be written ({e.strerror})") from None

  def write(self, row: dict[str, Any]) -> None:
    try:
      self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
      self.file.flush()
    except OSError as e:
      raise UserError(f"{self.path}: cannot be written ({e.strerror})") from None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.file.close()


def _sort_out(path: str) -> None:
  """Puts a finished --out in input order (rows were written in the order they finished)."""
  rows = _read_out(path)
  try:
    _replace(path, (rows[line] for line in sorted(rows)))
  except OSError as e:
    raise UserError(f"{path}: cannot be written ({e.strerror})") from None


def _replace(path: str, lines) -> None:
  """Writes `lines` beside `path` then renames: a kill leaves the old file or the new."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def _counts(skipped: dict[str, int]) -> str:
  return ", ".join(f"{reason}={count}" for reason, count in sorted(skipped.items()))


def _summary_line(summary: dict) -> str:
  """'wrote 8 rows, 16 completions to out.jsonl; skipped 2 rows (invalid_json=1, ...)'."""
  skipped = sum(summary["skipped"].values())
  reasons = f" ({_counts(summary['skipped'])})" if skipped else ""
  resumed = f" ({summary['resumed']} rows already there)" if summary["resumed"] else ""
  return (f"wrote {summary['rows']} rows, {summary['completions']} completions to "
          f"{summary['out']}{resumed}; skipped {skipped} rows{reasons}")


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
  args = parse_args(argv)
  compile_cache.enable(args.compilation_cache)
  try:
    _check_sampling_args(args)
    if args.prompts is not None:
      summary = run_batch(args)
    else:
      if args.out is not None or args.n != 1 or args.resume:
        raise UserError("--out, --n and --resume are for --prompts FILE.jsonl")
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
