"""Benchmark the rollout engine: prefix sharing, continuous batching, decode roofline.

  python scripts/bench_rollout.py [--json]

Prints one JSON object (with --json; otherwise one "key: value" line each):

* prefix_sharing_page_ratio: peak KV pages in use when K=8 samples of one 512-token prompt
  (256-token completions) share the prompt's pages, over the peak for the same 8 as separate
  requests; read from the engine's page allocator after real prefill and decode.
* continuous_vs_static_speedup: generated tokens/s of continuous batching over static
  batching (batches of num_slots requests, each run until its longest finishes), same model,
  engine and slot count, on a workload whose completion lengths vary widely; both measured
  in this run after a warm-up pass that compiles every shape (best of 3 interleaved runs).
* cascade_prefix_read_ratio: KV pages read by decode attention with cascade attention
  (EngineConfig.group_slots=8) over without, summed over every decode step of K=8 samples
  of one 512-token prompt with 256-token completions (16-token pages). Counted from the
  engine's page tables and lengths before each step (Engine.attention_reads), so it is
  exact and deterministic; bytes scale with pages for any model, so it is also the ratio
  of KV bytes read.
* cascade_vs_paged_decode_speedup: decode tokens/s with cascade attention over plain paged
  attention, same tiny model and workload (2 prompts x K=8 samples in 16 slots, prompt 512,
  completion 256), decode calls only, best of 3 interleaved runs after a warm-up. On the
  CPU both run the plain-jnp attention path, which gathers pages into dense arrays:
  cascade gathers the shared prompt once per block instead of once per sample (and its
  tables are narrower) but adds a second attention part and the merge, while much of a
  tiny model's step is per-op overhead and the MLP. So the CPU figure measures how the jnp
  gathers compare on this host, not the kernels: on a GPU/TPU decode is bandwidth-bound and
  the read ratio above is what bounds the attention time.
* On a GPU/TPU only (jax.default_backend() != "cpu"): decode tokens/s and the share of the
  HBM roofline for a 1B-class shape (llama3.2-1b, random bf16 weights) at each `--slots`
  count (default 64, 256 and 512: an RL step decodes hundreds of sequences at once), where
  the roofline step time is (weight bytes + KV bytes read) / bandwidth (H100 3.35 TB/s,
  H200 4.8 TB/s). With `--group-slots K` the slots are groups of K samples of one prompt
  decoding with cascade attention, as a GRPO step's rollout does, and the roofline reads
  each prompt's KV once a step.

The CPU part uses a tiny model and takes a few minutes at most; absolute CPU times say
nothing about accelerators, only the ratios measured side by side count.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from jaxrl_post.models import ModelConfig, preset
from jaxrl_post.models.transformer import init_model
from jaxrl_post.rollout import (Engine, EngineConfig, PoolConfig, Request, SamplingParams,
                                Scheduler)
from jaxrl_post.rollout.pages import cdiv, page_bytes
from jaxrl_post.telemetry import peaks

TINY = ModelConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, compute_dtype="float32",
                   max_position_embeddings=1024)


def _prompts(rng, lengths, vocab):
  return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


def prefix_sharing_page_ratio(model) -> dict:
  """Peak pages for K=8 samples sharing a 512-token prompt vs 8 unshared copies."""
  k, prompt_len, completion = 8, 512, 256
  page_size = 16
  pages = k * cdiv(prompt_len + completion, page_size) + 1
  config = EngineConfig(num_slots=k, decode_steps=32, prefill_chunk=256,
                        max_seq_len=prompt_len + completion, min_table_pages=64,
                        pool=PoolConfig(page_size=page_size, num_pages=pages))
  prompt = _prompts(np.random.default_rng(0), [prompt_len], model.config.vocab_size)[0]
  sampling = SamplingParams(temperature=1.0, max_tokens=completion)

  def peak(n, copies):
    engine = Engine.from_model(model, config)
    sched = Scheduler(engine)
    for i in range(copies):
      sched.submit(prompt, sampling, n=n, seed=i)
    sched.run()
    assert engine.pages_in_use == 0
    return engine.alloc.peak_in_use

  shared, unshared = peak(k, 1), peak(1, k)
  return {"prefix_sharing_page_ratio": round(shared / unshared, 4),
          "prefix_sharing_pages": {"shared": shared, "unshared": unshared}}


CASCADE_K, CASCADE_PROMPT, CASCADE_COMPLETION, CASCADE_PAGE = 8, 512, 256, 16


def _cascade_engine(model, group_slots: int, groups: int, decode_steps: int) -> Engine:
  """An engine whose pool holds `groups` prompts with K samples each, and nothing more."""
  ps, p, c = CASCADE_PAGE, CASCADE_PROMPT, CASCADE_COMPLETION
  per_group = cdiv(p, ps) + CASCADE_K * (cdiv(p + c, ps) - p // ps)
  config = EngineConfig(num_slots=groups * CASCADE_K, decode_steps=decode_steps,
                        prefill_chunk=256, max_seq_len=p + c, group_slots=group_slots,
                        pool=PoolConfig(page_size=ps, num_pages=groups * per_group + 1))
  return Engine.from_model(model, config)


def _start_groups(engine: Engine, prompts, k: int = CASCADE_K,
                  completion: int = CASCADE_COMPLETION) -> None:
  """Prefills each prompt once and inserts its k samples into the next k slots (a block)."""
  sampling = SamplingParams(temperature=1.0, max_tokens=completion)
  for g, prompt in enumerate(prompts):
    prefix = engine.new_prefix(prompt, sampling, seed=g, sample_ids=range(k))
    while not engine.prefill(prefix):
      pass
    engine.bulk_insert(prefix, list(range(g * k, (g + 1) * k)))


def cascade_prefix_read_ratio(model) -> dict:
  """KV pages decode attention reads with cascade over without, over a whole completion."""
  engine = _cascade_engine(model, CASCADE_K, groups=1, decode_steps=1)
  _start_groups(engine, _prompts(np.random.default_rng(2), [CASCADE_PROMPT],
                                 model.config.vocab_size))
  cascade = paged = steps = 0
  while True:
    step_cascade, step_paged = engine.attention_reads()  # What the next step will read.
    if step_paged == 0:
      break
    cascade, paged, steps = cascade + step_cascade, paged + step_paged, steps + 1
    engine.generate()
  assert steps == CASCADE_COMPLETION - 1  # The first token comes from prefill.
  return {"cascade_prefix_read_ratio": round(cascade / paged, 4),
          "cascade_read_pages_per_step": {"cascade": round(cascade / steps, 1),
                                          "paged": round(paged / steps, 1)}}


def _decode_run(engine: Engine, prompts) -> tuple[int, float]:
  """(tokens, seconds) of decoding every slot to the end; prefill is not timed."""
  _start_groups(engine, prompts)
  slots = engine.max_concurrent_decodes
  finished = np.zeros((slots,), bool)
  tokens, start = 0, time.perf_counter()
  while not finished.all():
    out = engine.generate()
    tokens += int((out.tokens >= 0).sum())
    finished |= out.finished
  seconds = time.perf_counter() - start
  for slot in range(slots):
    engine.free_resource(slot)
  return tokens, seconds


def cascade_vs_paged_decode(model, groups: int = 2, repeats: int = 3) -> dict:
  """Decode tokens/s with cascade attention over plain paged, same workload, same run."""
  prompts = _prompts(np.random.default_rng(3), [CASCADE_PROMPT] * groups,
                     model.config.vocab_size)
  engines = {name: _cascade_engine(model, group_slots, groups, decode_steps=32)
             for name, group_slots in (("paged", 0), ("cascade", CASCADE_K))}
  for engine in engines.values():
    _decode_run(engine, prompts)  # Warm-up: compiles every table width.
  runs = {name: [] for name in engines}
  for _ in range(repeats):  # Interleaved; the best of each resists a busy shared machine.
    for name, engine in engines.items():
      runs[name].append(_decode_run(engine, prompts))
  best = {name: min(r, key=lambda run: run[1]) for name, r in runs.items()}
  assert best["paged"][0] == best["cascade"][0]
  tps = {name: tokens / seconds for name, (tokens, seconds) in best.items()}
  return {"cascade_vs_paged_decode_speedup": round(tps["cascade"] / tps["paged"], 3),
          "cascade_decode_tokens_per_s_tiny": round(tps["cascade"], 1),
          "paged_decode_tokens_per_s_tiny": round(tps["paged"], 1)}


def _workload(n: int, rng) -> list[Request]:
  """Short prompts; 85% short completions, 15% long: heavy length variance."""
  lengths = rng.integers(8, 65, size=n)
  long = rng.random(n) < 0.15
  max_tokens = np.where(long, rng.integers(160, 257, size=n), rng.integers(4, 25, size=n))
  prompts = _prompts(rng, lengths, TINY.vocab_size)
  return [Request(tuple(p), SamplingParams(temperature=1.0, max_tokens=int(m)), seed=i)
          for i, (p, m) in enumerate(zip(prompts, max_tokens))]


def _run(engine, requests, batch: int | None) -> tuple[int, float]:
  """(generated tokens, seconds): all at once (continuous) or `batch` at a time (static)."""
  start, tokens = time.perf_counter(), 0
  groups = [requests] if batch is None else [requests[i:i + batch]
                                             for i in range(0, len(requests), batch)]
  for group in groups:
    sched = Scheduler(engine)
    for r in group:
      sched.submit(r.prompt, r.sampling, seed=r.seed)
    results = sched.run()
    tokens += sum(len(c.tokens) for out in results.values() for c in out)
  return tokens, time.perf_counter() - start


def continuous_vs_static(model, num_requests: int, repeats: int = 3) -> dict:
  slots = 8
  config = EngineConfig(num_slots=slots, decode_steps=8, prefill_chunk=64, max_seq_len=336,
                        pool=PoolConfig(page_size=16, num_pages=slots * 21 + 1))
  engine = Engine.from_model(model, config)
  requests = _workload(num_requests, np.random.default_rng(1))
  _run(engine, requests, None)  # Warm-up: compiles every shape both runs use.
  _run(engine, requests[:2 * slots], slots)
  static, cont = [], []
  for _ in range(repeats):  # Interleaved; the best of each resists a busy shared machine.
    static.append(_run(engine, requests, slots))
    cont.append(_run(engine, requests, None))
  static_tokens, static_s = min(static, key=lambda r: r[1])
  cont_tokens, cont_s = min(cont, key=lambda r: r[1])
  assert static_tokens == cont_tokens
  static_tps, cont_tps = static_tokens / static_s, cont_tokens / cont_s
  return {"continuous_vs_static_speedup": round(cont_tps / static_tps, 3),
          "continuous_tokens_per_s_tiny": round(cont_tps, 1),
          "static_tokens_per_s_tiny": round(static_tps, 1),
          "batching_workload": {"requests": num_requests, "slots": slots,
                                "generated_tokens": cont_tokens}}


def _peak_bandwidth() -> float | None:
  return peaks.lookup(peaks.HBM_BYTES_PER_S, jax.devices()[0].device_kind)


def decode_roofline(cfg: ModelConfig, slots: int = 64, prompt_len: int = 512,
                    completion: int = 256, steps: int = 32,
                    profile_dir: str | None = None, group: int = 0) -> dict:
  """Decode tokens/s of `cfg` (bf16, random weights) and its share of the HBM roofline.

  group: 0, every slot its own prompt (plain paged attention); K, slots / K prompts of K
  samples each decoding with cascade attention (EngineConfig.group_slots = K, as every
  GRPO config runs), whose roofline reads each prompt's KV once per step, not K times."""
  model = init_model(cfg, seed=0)
  page_size = 16
  max_seq_len = prompt_len + completion
  config = EngineConfig(num_slots=slots, decode_steps=steps, prefill_chunk=prompt_len,
                        max_seq_len=max_seq_len, min_table_pages=cdiv(max_seq_len, page_size),
                        group_slots=group,
                        pool=PoolConfig(page_size=page_size,
                                        num_pages=slots * cdiv(max_seq_len, page_size) + 1))
  engine = Engine.from_model(model, config)
  k = group or 1
  prompts = _prompts(np.random.default_rng(0), [prompt_len] * (slots // k), cfg.vocab_size)
  _start_groups(engine, prompts, k, completion)
  # Step j of a slot feeds the token at position prompt_len + j: it reads that many + 1 keys.
  done = int((engine.generate().tokens[0] >= 0).sum())  # Compiles; not timed.
  timed_steps, seconds, contexts = 0, 0.0, []
  profile = None
  if profile_dir:  # One call under the profiler, not timed (the trace slows it).
    out, profile = _profile_call(engine, profile_dir)
    done += int((out.tokens[0] >= 0).sum())
  while done < completion - 1:
    start = time.perf_counter()
    out = engine.generate()  # Returns host arrays: the device work is done.
    seconds += time.perf_counter() - start
    produced = int((out.tokens[0] >= 0).sum())
    contexts += [prompt_len + done + i + 1 for i in range(produced)]
    timed_steps, done = timed_steps + produced, done + produced
  step_s = seconds / timed_steps
  weight_bytes = cfg.num_params * 2
  # Keys a step reads: each prompt once per block with cascade, every slot its own after.
  shared = prompt_len if group else 0
  keys = slots * (float(np.mean(contexts)) - shared) + slots // k * shared
  kv_bytes = keys * page_bytes(cfg, 1, "bfloat16")
  result = {"decode_slots": slots, "decode_group_slots": group,
            "decode_context": [prompt_len, prompt_len + completion],
            "decode_tokens_per_s": round(slots / step_s, 1),
            "decode_step_ms": round(1e3 * step_s, 3),
            "device": jax.devices()[0].device_kind}
  bandwidth = _peak_bandwidth()
  if bandwidth:
    roofline_s = (weight_bytes + kv_bytes) / bandwidth
    result.update(roofline_step_ms=round(1e3 * roofline_s, 3),
                  hbm_roofline_pct=round(100 * roofline_s / step_s, 1))
  if profile is not None:
    result["profile"] = profile
  return result


def _profile_call(engine: Engine, tmp: str, top: int = 25):
  """One generate() call under jax's profiler: (its output, the device's kernels by name
  with launches per decode step and share of the device-busy time), to say where a decode
  step goes."""
  import collections
  import glob
  from jax.profiler import ProfileData
  jax.profiler.start_trace(tmp)
  start = time.perf_counter()
  out = engine.generate()
  wall = time.perf_counter() - start
  jax.profiler.stop_trace()
  kernels = collections.defaultdict(lambda: [0, 0.0])
  for path in glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True):
    for plane in ProfileData.from_file(path).planes:
      if not plane.name.startswith(("/device:GPU", "/device:TPU")):
        continue
      for line in plane.lines:
        if not line.name.startswith("Stream"):
          continue
        for ev in line.events:
          kernels[ev.name][0] += 1
          kernels[ev.name][1] += ev.duration_ns * 1e-9
  produced = int((out.tokens >= 0).sum(axis=1).max())
  busy = sum(t for _, t in kernels.values())
  ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
  return out, {"decode_steps": produced, "wall_ms": round(1e3 * wall, 3),
          "device_busy_ms": round(1e3 * busy, 3),
          "launches_per_step": round(sum(n for n, _ in kernels.values()) / max(produced, 1), 1),
          "top": [{"name": name[:120], "per_step": round(n / max(produced, 1), 2),
                   "ms_per_step": round(1e3 * t / max(produced, 1), 4),
                   "busy_pct": round(100 * t / busy, 1)} for name, (n, t) in ranked[:top]]}


def _decode_figures(args) -> list:
  """decode_roofline for each --models preset (random bf16 weights) and --slots count."""
  figures = []
  for name in args.models.split(","):
    base = TINY if name == "tiny" else preset(name)  # tiny: checks the script on a CPU
    cfg = base.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    for slots in (int(s) for s in args.slots.split(",")):
      with tempfile_dir(args.profile) as tmp:
        figures.append({"model": name, **decode_roofline(cfg, slots=slots, profile_dir=tmp,
                                                         group=args.group_slots)})
  return figures


def tempfile_dir(on: bool):
  import contextlib
  import tempfile
  return tempfile.TemporaryDirectory() if on else contextlib.nullcontext(None)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--requests", type=int, default=96, help="batching workload size")
  p.add_argument("--decode-only", action="store_true",
                 help="only the accelerator decode roofline (skip the tiny-model parts)")
  p.add_argument("--slots", default="64,256,512",
                 help="comma-separated decode slot counts (an RL step decodes hundreds)")
  p.add_argument("--models", default="llama3.2-1b",
                 help="comma-separated presets for the decode roofline (or tiny)")
  p.add_argument("--group-slots", type=int, default=0,
                 help="decode roofline with cascade attention: slots / K prompts of K samples "
                      "(0: every slot its own prompt, plain paged attention)")
  p.add_argument("--profile", action="store_true",
                 help="add a per-kernel profile of one decode call to each decode figure")
  args = p.parse_args(argv)
  result = {"backend": jax.default_backend(), "jax": jax.__version__}
  if args.decode_only:
    result["decode"] = _decode_figures(args)
    print(json.dumps(result))
    return 0
  model = init_model(TINY, seed=0)
  result.update(prefix_sharing_page_ratio(model))
  result.update(continuous_vs_static(model, args.requests))
  result.update(cascade_prefix_read_ratio(model))
  result.update(cascade_vs_paged_decode(model))
  if jax.default_backend() != "cpu":  # RL batch sizes: one figure per --slots count.
    result["decode"] = _decode_figures(args)
  if args.json:
    print(json.dumps(result))
  else:
    for key, value in result.items():
      print(f"{key}: {value}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
