"""Generation on the rollout engine against transformers' `generate`, same job, same run.

  python scripts/bench_generate.py [--json] [--prompts 300] [--new_tokens 24]
      [--peer_python PATH | --no_peer] [--peer_batch 50] [--repeats 2]
      [--num_slots N] [--decode_steps N] [--prefill_chunk N] [--prefill_rows N]
      [--prefill_tokens_per_step N] [--page_size 16] [--decode_buckets 16]
      [--overlap auto|on|off] [--no_prefix_cache] [--no_cli]

The job: the embedded SmolLM2-135M-Instruct (float32 weights and compute), N distinct chat
prompts (user turns put through the model's own chat template), greedy, at most new_tokens
new tokens, stopping at EOS. Both sides get the same prompt token ids.

* ours: `jaxrl_post.rollout.generate` on one engine (continuous batching, paged KV), on
  jax's first device. The job runs once untimed on the engine, which compiles every shape
  the job meets (prefill row counts, chunk and page-table widths depend on how the
  scheduler happens to batch, so a smaller warm-up job misses some);
  compiles_in_timed_run says none was left for the timed passes. Prefill and decode time
  are the engine's prefill and decode calls, each waited on; the rest of the wall time
  (other_s) is the scheduler on the host. With overlapped decode (the scheduler's default
  on accelerators; --overlap on) the scheduler launches the next decode call before it
  waits for the last, and decode time is the host's time launching and waiting for calls:
  the host work done meanwhile is hidden behind the devices and counts in neither, and a
  prefill call waits for the decode calls queued before it. On a CPU the default waits
  for every call.
  The engine's prefix cache is on (a prompt's leading tokens that an earlier prompt of
  the pass shares, the chat template's system turn and beyond, are not prefilled again);
  every timed pass starts with an empty cache, and
  prefill_tokens_cached says how many prompt tokens came from it. --no_prefix_cache
  prefills every prompt whole.
* transformers (the peer): `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in
  float32 on the same GGUF, left-padded batches of peer_batch prompts, `generate` with
  do_sample=False, torch threads = cores, one untimed warm-up batch. Prefill time is each
  batch's first forward (until its first new token), decode the rest.

* the batch CLI, first pass (what a user meets): `python -m jaxrl_post.generate --prompts
  FILE --out FILE --temperature 0 --max-new-tokens N` on the job's prompts (chat
  "messages" rows) with every engine setting at its default, in a new process with an
  empty compilation cache, timed from the interpreter's start to its exit; then the same
  command again (second run: the cache the first pass filled). Beside it, transformers'
  first pass in a new process: load the model, run the job once with no warm-up batch.
  first_pass_wall_ratio is the CLI's first pass over transformers'; cli_greedy_agreement
  compares their completions. The CLI's seconds are split into the interpreter's start,
  set-up (imports, model load, tokenization, engine build, until the engine's first call),
  prefill and decode calls (each with the seconds jax spent tracing, lowering and
  compiling inside it, and the programs compiled), and the rest (the scheduler, writing
  the output).

Each side makes --repeats timed passes, interleaved with the other's and alternating which
goes first, and the fastest pass of each side counts: other work on a shared host slows
single passes by up to several times, and the fastest is the least disturbed. Every pass's
wall time is in the JSON (wall_s_runs, wall_ratio_per_repeat).

The peer runs when torch and transformers import here, or in another interpreter given with
--peer_python (this file again, in a mode that imports only numpy, torch and
transformers), so neither becomes a dependency of the project. See docs/BENCHMARKS.md
for how the peer's environment is made.

Token counts: prefill_tokens are the prompts' real tokens (no padding); generated_tokens
are the completions' tokens up to and including EOS; decode_tokens leave out each
completion's first token, which the prefill produces. wall_ratio is ours / transformers;
greedy_agreement is the share of prompts whose completions are identical on both sides
(both compute in float32, so only near-ties in the logits may differ). cpu_s is the
process's CPU time over the timed job: with cpu_s / wall_s well under the core count, other
work on the host took cores from the run.

On the CPU only the ratio measured in one run means anything: the host is shared, and
absolute times say nothing about accelerators.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

MODEL = "smollm2-135m-instruct"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_TOPICS = ("the sea", "a cat", "autumn leaves", "coffee", "the moon", "a library", "rain",
           "mountains", "a train journey", "fresh bread", "friendship", "the desert",
           "honey bees", "a lighthouse", "winter", "music", "a vegetable garden",
           "a city at night", "snow", "an old map")
_INSTRUCTIONS = ("Write one sentence about {}.", "Give three words that describe {}.",
                 "Write a haiku about {}.", "Explain {} to a child in one sentence.",
                 "Tell me one fact about {}.")
_ARITHMETIC = "What is {a} {op} {b}? Answer with just the number."


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--prompts", type=int, default=300, help="distinct chat prompts")
  p.add_argument("--new_tokens", type=int, default=24, help="most new tokens per prompt")
  p.add_argument("--peer_batch", type=int, default=50, help="transformers' batch size")
  p.add_argument("--peer_python", help="interpreter with torch and transformers for the peer")
  p.add_argument("--no_peer", action="store_true", help="time our side only")
  p.add_argument("--repeats", type=int, default=2,
                 help="timed passes per side, interleaved; the fastest of each counts")
  p.add_argument("--num_slots", type=int, default=320,
                 help="engine decode slots (the default decodes all 300 prompts at once)")
  p.add_argument("--decode_steps", type=int, default=8, help="decode steps per engine call")
  p.add_argument("--prefill_chunk", type=int, default=128, help="most tokens per prefill row")
  p.add_argument("--prefill_rows", type=int, default=16,
                 help="prompts per prefill call (where the engine has the setting)")
  p.add_argument("--prefill_tokens_per_step", type=int, default=2048,
                 help="prompt tokens prefilled between two decode calls")
  p.add_argument("--page_size", type=int, default=16,
                 help="KV page size")
  p.add_argument("--decode_buckets", type=int, default=16,
                 help="widths a decode call may run its live slots at (1: every slot); "
                      "each is one more decode program, compiled in the untimed warm-up")
  p.add_argument("--no_prefix_cache", action="store_true",
                 help="prefill every prompt whole (no reuse of shared leading tokens)")
  p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                 help="queue the next decode call before reading the last (auto: on for "
                      "accelerators, off on a CPU)")
  p.add_argument("--no_cli", action="store_true",
                 help="skip the first pass of the batch CLI on its defaults (see module doc)")
  p.add_argument("--_peer", help=argparse.SUPPRESS)  # The peer's job file (child mode).
  p.add_argument("--_peer_cold", help=argparse.SUPPRESS)  # Load and run once (child mode).
  p.add_argument("--_cli", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # CLI child.
  args = p.parse_args(argv)
  for name in ("prompts", "new_tokens", "peer_batch", "repeats", "num_slots", "decode_steps",
               "prefill_chunk", "prefill_rows", "prefill_tokens_per_step", "page_size"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  return args


# ---------------------------------------------------------------------- the job


def chat_prompts(n: int) -> list[str]:
  """n distinct user turns: two arithmetic questions to one short instruction, interleaved,
  so any leading subset mixes short-answer and free-text completions."""
  instructions = [i.format(t) for t in _TOPICS for i in _INSTRUCTIONS]
  rng = np.random.default_rng(0)
  seen, out = set(instructions), []
  while len(out) < n:
    if len(out) % 3 == 2 and instructions:
      out.append(instructions.pop(0))
      continue
    a, b = (int(x) for x in rng.integers(0, 1000, size=2))
    text = _ARITHMETIC.format(a=a, op="+-*"[int(rng.integers(0, 3))], b=b)
    if text not in seen:
      seen.add(text)
      out.append(text)
  return out


def completion_lists(outputs) -> list[list[int]]:
  return [list(samples[0].tokens) for samples in outputs]


def trim_at_stop(row, stop_ids, limit: int) -> list[int]:
  """A completion as generated: up to and including its first stop id, at most limit."""
  out = []
  for t in list(row)[:limit]:
    out.append(int(t))
    if int(t) in stop_ids:
      break
  return out


def rates(wall: float, prefill_s: float, decode_s: float, prefill_tokens: int,
          completions: list[list[int]]) -> dict:
  """One side's figures, counted the same way for both (see the module docstring)."""
  generated = sum(len(c) for c in completions)
  decode_tokens = generated - sum(1 for c in completions if c)
  per_s = lambda n, s: round(n / s, 1) if s > 0 else None
  return {"wall_s": round(wall, 3), "prefill_s": round(prefill_s, 3),
          "decode_s": round(decode_s, 3),
          "other_s": round(max(wall - prefill_s - decode_s, 0.0), 3),
          "prefill_tokens": prefill_tokens,
          "prefill_tokens_per_s": per_s(prefill_tokens, prefill_s),
          "decode_tokens": decode_tokens, "decode_tokens_per_s": per_s(decode_tokens, decode_s),
          "generated_tokens": generated, "generated_tokens_per_s": per_s(generated, wall)}


# ---------------------------------------------------------------------- ours


class PhaseClock:
  """Seconds spent in the engine's prefill and decode calls, each waited on to the end.

  It wraps the engine instance's own methods, so the scheduler and engine run unchanged;
  the wait after a prefill call costs nothing where the engine already read its first
  tokens back (it then needed the result anyway).
  """

  def __init__(self, engine):
    import jax
    self.seconds = {"prefill": 0.0, "decode": 0.0}
    self.calls = {"prefill": 0, "decode": 0}
    self._wrap(engine, "prefill_batch", "prefill",
               lambda: jax.block_until_ready(getattr(engine, "pool", None)))
    # Decode calls: `generate` is `launch` then `collect`; with overlapped decode the
    # scheduler launches calls and later collects them. Only the host's time in those two
    # (launching, and blocked until a call is done) counts as decode, each call once.
    self._wrap(engine, "launch", "decode", lambda: None)
    self._wrap(engine, "collect", "decode", lambda: None, count=False)

  def _wrap(self, engine, method: str, phase: str, wait, count: bool = True) -> None:
    inner = getattr(engine, method)

    def timed(*args, **kwargs):
      start = time.perf_counter()
      out = inner(*args, **kwargs)
      wait()
      self.seconds[phase] += time.perf_counter() - start
      self.calls[phase] += count
      return out

    setattr(engine, method, timed)

  def reset(self) -> None:
    self.seconds = dict.fromkeys(self.seconds, 0.0)
    self.calls = dict.fromkeys(self.calls, 0)


class CompileCounter:
  """Counts XLA compilations, to show the timed job compiled nothing."""

  def __init__(self):
    import jax
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
      self.count += 1


def engine_config(args, prompt_lens: list[int]):
  """The engine for this job: tables and pool sized to its longest sequence, so attention
  gathers only the pages a sequence can have and the pool holds every slot at once."""
  import dataclasses

  from jaxrl_post.rollout import EngineConfig, PoolConfig
  from jaxrl_post.rollout.pages import cdiv

  longest = max(prompt_lens) + args.new_tokens
  ps = args.page_size
  pages = cdiv(longest, ps)
  knobs = dict(num_slots=args.num_slots, decode_steps=args.decode_steps,
               prefill_chunk=args.prefill_chunk, max_seq_len=pages * ps,
               min_table_pages=1,
               pool=PoolConfig(page_size=ps, num_pages=(args.num_slots + 1) * pages + 1))
  fields = {f.name for f in dataclasses.fields(EngineConfig)}
  if "prefill_rows" in fields:
    knobs["prefill_rows"] = args.prefill_rows
  if "prefix_cache" in fields:
    knobs["prefix_cache"] = not args.no_prefix_cache
  if "decode_buckets" in fields:
    knobs["decode_buckets"] = args.decode_buckets
  return EngineConfig(**knobs)


def ours_runner(model, prompts: list[list[int]], stop_ids, args):
  """Builds the engine and runs the job once untimed (compiling every shape); returns a
  function that times one more pass and gives (figures, completions)."""
  from jaxrl_post.rollout import Engine, SamplingParams, SchedulerConfig, generate

  config = engine_config(args, [len(p) for p in prompts])
  engine = Engine.from_model(model, config)
  clock, compiles = PhaseClock(engine), CompileCounter()
  sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens,
                            stop_ids=tuple(stop_ids))
  overlap = {"auto": None, "on": True, "off": False}[args.overlap]
  sched = SchedulerConfig(prefill_tokens_per_step=args.prefill_tokens_per_step,
                          overlap=overlap)
  start = time.perf_counter()
  generate(engine, prompts, sampling=sampling, scheduler=sched)
  warmup_s = time.perf_counter() - start

  def run() -> tuple[dict, list[list[int]]]:
    clock.reset()
    if hasattr(engine, "drop_prefix_cache"):
      engine.drop_prefix_cache()  # Every pass prefills the job's prompts itself.
    cached_before = getattr(engine, "cached_prompt_tokens", 0)
    compiled_before = compiles.count
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = generate(engine, prompts, sampling=sampling, scheduler=sched)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    completions = completion_lists(outputs)
    figures = rates(wall, clock.seconds["prefill"], clock.seconds["decode"],
                    sum(len(p) for p in prompts), completions)
    figures.update(cpu_s=round(cpu, 1), prefill_calls=clock.calls["prefill"],
                   prefill_tokens_cached=getattr(engine, "cached_prompt_tokens", 0)
                   - cached_before,
                   decode_calls=clock.calls["decode"],
                   compiles_in_timed_run=compiles.count - compiled_before,
                   warmup_s=round(warmup_s, 1),
                   engine={k: getattr(config, k) for k in
                           ("num_slots", "decode_steps", "prefill_chunk", "max_seq_len",
                            "prefill_rows", "prefix_cache", "decode_buckets")
                            if hasattr(config, k)},
                   prefill_tokens_per_step=args.prefill_tokens_per_step,
                   overlap=sched.overlaps(engine.layout.mesh))
    return figures, completions

  return run


# ---------------------------------------------------------------------- the batch CLI


class FirstPassClock:
  """Where a CLI process's seconds go: set-up (imports, model load, tokenization, engine
  build) until the engine's first call, then prefill and decode calls (each waited on),
  and inside each the seconds jax spent tracing, lowering and compiling."""

  PHASES = ("prefill", "decode")
  COMPILE_EVENTS = (COMPILE_EVENT, "/jax/core/compile/jaxpr_trace_duration",
                    "/jax/core/compile/jaxpr_to_mlir_module_duration")

  def __init__(self, start: float):
    import jax

    from jaxrl_post.rollout import Engine
    self.start, self.first_call, self.phase = start, None, "setup"
    self.seconds = dict.fromkeys(self.PHASES, 0.0)
    self.compile_s = dict.fromkeys(("setup",) + self.PHASES, 0.0)
    self.compiles = dict.fromkeys(("setup",) + self.PHASES, 0)
    jax.monitoring.register_event_duration_secs_listener(self._on_event)
    for method, phase in (("prefill_batch", "prefill"), ("launch", "decode"),
                          ("collect", "decode")):
      self._wrap(Engine, method, phase)

  def _on_event(self, event: str, duration: float, **_) -> None:
    if event in self.COMPILE_EVENTS:
      self.compile_s[self.phase] += duration
      self.compiles[self.phase] += event == COMPILE_EVENT

  def _wrap(self, cls, method: str, phase: str) -> None:
    import jax
    inner = getattr(cls, method)

    def timed(engine, *args, **kwargs):
      if self.first_call is None:
        self.first_call = time.perf_counter()
      self.phase, start = phase, time.perf_counter()
      out = inner(engine, *args, **kwargs)
      if phase == "prefill":
        jax.block_until_ready(engine.pool)
      self.seconds[phase] += time.perf_counter() - start
      self.phase = "other"
      return out

    setattr(cls, method, timed)

  def figures(self, end: float) -> dict:
    setup = (self.first_call or end) - self.start
    out = {"setup_s": round(setup, 3), "setup_compile_s": round(self.compile_s["setup"], 3)}
    for phase in self.PHASES:
      out[f"{phase}_s"] = round(self.seconds[phase], 3)
      out[f"{phase}_compile_s"] = round(self.compile_s[phase], 3)
      out[f"{phase}_programs_compiled"] = self.compiles[phase]
    out["other_s"] = round(end - self.start - setup - sum(self.seconds.values()), 3)
    return out


def cli_child(argv: list[str]) -> None:
  """Child mode: `python -m jaxrl_post.generate argv` in this process under a
  FirstPassClock; prints the clock's figures as the last line."""
  start = time.perf_counter()
  from jaxrl_post import generate as cli
  clock = FirstPassClock(start)
  status = cli.main(argv)
  figures = clock.figures(time.perf_counter())
  figures["exit_status"] = status
  print(json.dumps(figures), flush=True)


def cli_pass(args, prompt_file: str, out_file: str, cache_dir: str) -> dict:
  """One run of the batch CLI on its defaults (only the job's own options), timed from
  the interpreter's start to its exit; the completions it wrote come back too."""
  argv = ["--prompts", prompt_file, "--out", out_file, "--temperature", "0",
          "--max-new-tokens", str(args.new_tokens), f"--compilation_cache={cache_dir}"]
  start = time.perf_counter()
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--_cli", *argv],
                        capture_output=True, text=True)
  wall = time.perf_counter() - start
  if proc.returncode != 0:
    raise RuntimeError(f"python -m jaxrl_post.generate {' '.join(argv)} failed:\n"
                       f"{proc.stderr[-4000:]}")
  figures = json.loads(proc.stdout.strip().splitlines()[-1])
  figures["wall_s"] = round(wall, 3)
  figures["interpreter_s"] = round(wall - sum(
      figures[k] for k in ("setup_s", "prefill_s", "decode_s", "other_s")), 3)
  with open(out_file, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  figures["prompt_token_ids"] = [r["prompt_token_ids"] for r in rows]
  figures["completions"] = [r["completions"][0]["token_ids"] for r in rows]
  return figures


def cli_runs(args, texts: list[str]) -> tuple[dict, dict]:
  """The CLI's first pass (an empty compilation cache: what a new user meets) and a
  second run of the same command (the cache the first filled)."""
  with tempfile.TemporaryDirectory() as work:
    prompt_file = os.path.join(work, "prompts.jsonl")
    with open(prompt_file, "w", encoding="utf-8") as f:
      for t in texts:
        f.write(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n")
    cache = os.path.join(work, "xla_cache")
    first = cli_pass(args, prompt_file, os.path.join(work, "out1.jsonl"), cache)
    second = cli_pass(args, prompt_file, os.path.join(work, "out2.jsonl"), cache)
  return first, second


# ---------------------------------------------------------------------- transformers


def peer_runner(spec: dict):
  """Loads transformers' model and runs one untimed batch; returns a function that times
  the whole job and gives its figures (completions included). Imports only numpy, torch
  and transformers: it also runs in an interpreter without jax (see --peer_python)."""
  import torch
  import transformers
  from transformers.generation.streamers import BaseStreamer

  transformers.logging.set_verbosity_error()
  torch.set_num_threads(spec["threads"])
  folder, name = os.path.split(spec["gguf"])
  dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
  model = transformers.AutoModelForCausalLM.from_pretrained(
      folder, gguf_file=name, **{dtype_kw: torch.float32})
  # On a GPU host the peer runs on the GPU too: the comparison is device against device.
  device = torch.device(spec.get("device", "cpu"))
  model.to(device).eval()
  sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
  eos, new_tokens, prompts = spec["eos_id"], spec["new_tokens"], spec["prompts"]
  stop_ids = set(spec["stop_ids"])

  class FirstToken(BaseStreamer):
    """Notes when generate hands out its first new tokens (the prefill's end)."""

    def __init__(self):
      self.puts, self.first = 0, None

    def put(self, value):
      self.puts += 1
      if self.puts == 2:  # The first put is the prompt itself.
        sync()  # On a GPU the prefill is done only once its token is.
        self.first = time.perf_counter()

    def end(self):
      pass

  def run_batch(batch):
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), eos, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, p in enumerate(batch):  # Left padding: every row's last token is its prompt's.
      ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
      mask[r, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    clock = FirstToken()
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos,
                         streamer=clock)
    sync()
    end = time.perf_counter()
    rows = [trim_at_stop(r, stop_ids, new_tokens) for r in out[:, width:].tolist()]
    return rows, clock.first - start, end - clock.first

  batches = [prompts[i:i + spec["batch"]] for i in range(0, len(prompts), spec["batch"])]
  if spec.get("warmup", True):
    with torch.inference_mode():
      run_batch(batches[0])  # Warm-up: first-call allocations and kernel selection.

  def run() -> dict:
    completions, prefill_s, decode_s = [], 0.0, 0.0
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
      for batch in batches:
        rows, p, d = run_batch(batch)
        completions += rows
        prefill_s, decode_s = prefill_s + p, decode_s + d
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    figures = rates(wall, prefill_s, decode_s, sum(len(p) for p in prompts), completions)
    figures.update(cpu_s=round(cpu, 1), batch=spec["batch"], threads=spec["threads"],
                   device=str(device),
                   versions={"torch": torch.__version__,
                             "transformers": transformers.__version__},
                   completions=completions)
    return figures

  return run


def peer_child(spec_path: str) -> None:
  """Child mode: loads the peer, says "ready", then times the job once per input line."""
  with open(spec_path) as f:
    run = peer_runner(json.load(f))
  print("ready", flush=True)
  for _ in sys.stdin:
    print(json.dumps(run()), flush=True)


def peer_cold_child(spec_path: str) -> None:
  """Child mode: transformers' first pass as a user meets it, from the interpreter's start:
  load the model, run the job once (no warm-up batch), exit."""
  with open(spec_path) as f:
    spec = json.load(f)
  print(json.dumps(peer_runner(dict(spec, warmup=False))()), flush=True)


def peer_first_pass(python: str, spec: dict) -> dict:
  """transformers' first pass in a new interpreter, timed from its start to its exit."""
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(spec, f)
  try:
    start = time.perf_counter()
    proc = subprocess.run([python, os.path.abspath(__file__), "--_peer_cold", f.name],
                          capture_output=True, text=True, env=peer_env())
    wall = time.perf_counter() - start
  finally:
    os.unlink(f.name)
  if proc.returncode != 0:
    raise RuntimeError(f"the transformers first pass in {python} failed:\n"
                       f"{proc.stderr[-4000:]}")
  figures = json.loads(proc.stdout.strip().splitlines()[-1])
  figures["first_pass_wall_s"] = round(wall, 3)
  return figures


def peer_env() -> dict:
  """The environment without PYTHONPATH: the peer needs nothing of this project, and a
  checkout on the path shadows with its top-level `kernels` folder the package of that
  name that transformers imports when it is there."""
  return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def torch_here() -> bool:
  import importlib.util
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


class PeerProcess:
  """The peer in another interpreter, loaded once and timed on request (so its passes can
  interleave with ours); its stderr goes to a file, read back if it fails."""

  def __init__(self, python: str, spec: dict):
    self.python = python
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
      json.dump(spec, f)
    self._spec_path = f.name
    self._stderr = tempfile.TemporaryFile("w+")
    self._proc = subprocess.Popen([python, os.path.abspath(__file__), "--_peer", f.name],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self._stderr, text=True, env=peer_env())
    self._expect("ready")

  def _expect(self, what: str) -> str:
    line = self._proc.stdout.readline()
    if not line:
      self._proc.wait()
      self._stderr.seek(0)
      raise RuntimeError(f"the transformers run in {self.python} failed (waiting for "
                         f"{what}):\n{self._stderr.read()[-4000:]}")
    return line

  def __call__(self) -> dict:
    self._proc.stdin.write("run\n")
    self._proc.stdin.flush()
    return json.loads(self._expect("figures"))

  def close(self) -> None:
    self._proc.stdin.close()
    self._proc.wait()
    self._stderr.close()
    os.unlink(self._spec_path)


def open_peer(spec: dict, args):
  """(run, close) for the peer: in another interpreter if one is given, else here if it
  can import torch and transformers; None if neither or with --no_peer."""
  if args.no_peer:
    return None
  if args.peer_python:
    peer = PeerProcess(args.peer_python, spec)
    return peer, peer.close
  return (peer_runner(spec), lambda: None) if torch_here() else None


def best_of(runs: list[dict]) -> dict:
  """The run with the least wall time (the least disturbed by other work on the host),
  with every run's wall time beside it."""
  best = dict(min(runs, key=lambda r: r["wall_s"]))
  best["wall_s_runs"] = [r["wall_s"] for r in runs]
  return best


# ---------------------------------------------------------------------- report


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
  same = sum(a == b for a, b in zip(ours, theirs))
  return round(same / len(ours), 4)


def cores() -> int:
  """CPU cores this process may run on (the peer's torch threads)."""
  from jaxrl_post import host
  return host.cpus()


def device_line() -> str:
  import jax
  d = jax.devices()[0]
  cpu = platform.processor() or platform.machine()
  return (f"{jax.default_backend()} ({d.device_kind}; {jax.device_count()} device(s) seen, "
          f"one used), host {cpu} with {cores()} cores")


def print_human(result: dict) -> None:
  job = result["job"]
  print(f"job: {job['prompts']} chat prompts ({job['prompt_tokens']['min']}-"
        f"{job['prompt_tokens']['max']} tokens), greedy, <= {job['new_tokens']} new tokens, "
        f"stop at EOS, float32; {result['device']}")
  for name in ("ours", "transformers"):
    r = result[name]
    if r is None:
      print(f"{name}: not run (--no_peer, or no torch and transformers here and no "
            f"--peer_python)")
      continue
    print(f"{name}: wall {r['wall_s']:.2f} s (passes: {r['wall_s_runs']}) | prefill "
          f"{r['prefill_tokens']} tok in {r['prefill_s']:.2f} s = "
          f"{r['prefill_tokens_per_s']} tok/s | decode "
          f"{r['decode_tokens']} tok in {r['decode_s']:.2f} s = {r['decode_tokens_per_s']} "
          f"tok/s | other {r['other_s']:.2f} s | cpu {r['cpu_s']} s")
  if result["wall_ratio"] is not None:
    print(f"wall_ratio (ours / transformers): {result['wall_ratio']} "
          f"(target <= 0.5); greedy_agreement: {result['greedy_agreement']}")
  first = result.get("cli_first_pass")
  if first:
    for name, r in (("CLI first pass", first), ("CLI second run", result["cli_second_run"])):
      print(f"{name}: wall {r['wall_s']:.2f} s = interpreter {r['interpreter_s']:.2f} + "
            f"set-up {r['setup_s']:.2f} + prefill {r['prefill_s']:.2f} (compiling "
            f"{r['prefill_compile_s']:.2f}, {r['prefill_programs_compiled']} programs) + "
            f"decode {r['decode_s']:.2f} (compiling {r['decode_compile_s']:.2f}, "
            f"{r['decode_programs_compiled']} programs) + other {r['other_s']:.2f}")
    peer = result["transformers_first_pass"]
    if peer:
      print(f"transformers first pass: wall {peer['first_pass_wall_s']:.2f} s; "
            f"first_pass_wall_ratio {result['first_pass_wall_ratio']} (target <= 0.5), "
            f"second_run_wall_ratio {result['second_run_wall_ratio']}; "
            f"cli_greedy_agreement {result['cli_greedy_agreement']}")
  if result["ours"]["compiles_in_timed_run"]:
    print(f"warning: {result['ours']['compiles_in_timed_run']} compilation(s) in the timed run")


def interleave(time_ours, peer, repeats: int) -> tuple[list, list]:
  """`repeats` timed passes of each side, alternating which goes first, so that both meet
  the same spells of load from other work on the host."""
  our_runs, peer_runs = [], []
  try:
    for r in range(repeats):
      for side in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
        if side == "ours":
          our_runs.append(time_ours())
        elif peer is not None:
          peer_runs.append(peer[0]())
  finally:
    if peer is not None:
      peer[1]()
  return our_runs, peer_runs


def run(args) -> dict:
  import jax

  from jaxrl_post import models
  from jaxrl_post.models.presets import embedded_path

  model, tok = models.load(MODEL, param_dtype="float32", compute_dtype="float32")
  texts = chat_prompts(args.prompts)
  prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
  time_ours = ours_runner(model, prompts, tok.stop_ids, args)
  spec = {"gguf": embedded_path(MODEL), "prompts": prompts, "eos_id": tok.eos_id,
          "stop_ids": list(tok.stop_ids), "new_tokens": args.new_tokens,
          "batch": args.peer_batch, "threads": cores(),
          "device": "cuda" if jax.default_backend() == "gpu" else "cpu"}
  our_runs, peer_runs = interleave(time_ours, open_peer(spec, args), args.repeats)
  our_completions = our_runs[0][1]
  ours = best_of([f for f, _ in our_runs])
  lens = [len(p) for p in prompts]
  result = {
      "job": {"model": MODEL, "prompts": len(prompts), "new_tokens": args.new_tokens,
              "greedy": True, "stop_ids": list(tok.stop_ids), "dtype": "float32",
              "prompt_tokens": {"min": min(lens), "max": max(lens),
                                "mean": round(float(np.mean(lens)), 1)}},
      "ours": ours, "transformers": None, "wall_ratio": None, "wall_ratio_per_repeat": None,
      "greedy_agreement": None,
      "device": device_line(),
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "date": datetime.date.today().isoformat(),
  }
  if not args.no_cli:
    result.update(first_pass(args, texts, prompts, spec))
  if peer_runs:
    theirs = [r.pop("completions") for r in peer_runs][0]
    theirs_best = best_of(peer_runs)
    result["versions"].update(theirs_best.pop("versions"))
    result.update(transformers=theirs_best,
                  wall_ratio=round(ours["wall_s"] / theirs_best["wall_s"], 4),
                  wall_ratio_per_repeat=[round(a["wall_s"] / b["wall_s"], 4)
                                         for (a, _), b in zip(our_runs, peer_runs)],
                  greedy_agreement=agreement(our_completions, theirs))
  return result


def first_pass(args, texts: list[str], prompts: list[list[int]], spec: dict) -> dict:
  """The batch CLI's first pass and second run beside transformers' first pass (each a
  new process, timed from its start to its exit), and whether they decode alike."""
  first, second = cli_runs(args, texts)
  out = {"cli_first_pass": first, "cli_second_run": second,
         "cli_prompt_ids_match": first.pop("prompt_token_ids") == prompts,
         "transformers_first_pass": None, "first_pass_wall_ratio": None,
         "second_run_wall_ratio": None, "cli_greedy_agreement": None}
  second.pop("prompt_token_ids")
  cli_completions = first.pop("completions")
  second.pop("completions")
  python = None if args.no_peer else args.peer_python or (sys.executable if torch_here()
                                                           else None)
  if python is not None:
    peer = peer_first_pass(python, spec)
    theirs = peer.pop("completions")
    peer.pop("versions", None)
    out.update(transformers_first_pass=peer,
               first_pass_wall_ratio=round(first["wall_s"] / peer["first_pass_wall_s"], 4),
               second_run_wall_ratio=round(second["wall_s"] / peer["first_pass_wall_s"], 4),
               cli_greedy_agreement=agreement(cli_completions, theirs))
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  if args._peer:  # Child mode: no jax here, only the peer's job.
    peer_child(args._peer)
    return 0
  if args._peer_cold:
    peer_cold_child(args._peer_cold)
    return 0
  if args._cli is not None:
    cli_child(args._cli)
    return 0
  result = run(args)
  if args.json:
    print(json.dumps(result))
  else:
    print_human(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
