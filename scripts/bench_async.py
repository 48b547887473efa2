"""Step throughput of the asynchronous driver against the synchronous loop, side by side.

  python scripts/bench_async.py [--json] [--model tiny-llama] [--batch 8x8] [--steps 8]
                                [--mode bounded] [--max-staleness 2] [--quick]

Both runs are the training command's own (`pipeline.loop.run`, with RLRun or
pipelined.AsyncRLRun as `python -m jaxrl_post.train` picks them), one after the other in
this process on the same devices, from the same random weights and prompts. The workload is
rollout-heavy with long-tailed completion lengths: bench_step's model and shapes (no
warm-up, random weights), every sample drawn until one of --stop-tokens token ids spread
over the vocabulary comes up (about 1 in vocab / stop-tokens per token) or --new-tokens
are reached, so most completions are short and a few run to the cap, as reasoning
rollouts do.

Keys:
  async_vs_sync_throughput: trained completion tokens per second, asynchronous over
    synchronous, over the steps after --warmup (the first compile everything).
  sync, async: per run, tokens_per_s (completion tokens trained / wall seconds of the
    timed steps), step_s (median), wait_data_s (median seconds the trainer waited for a
    batch; the whole rollout for the synchronous loop), rollout_s (median seconds drawing
    a batch), completion_len (mean, p50, p90, max over the timed steps), staleness (the
    asynchronous run's histogram of completion tokens per optimizer-step staleness).
  device, devices, versions.

On the CPU both sides share the same cores, so the overlap gains what the host threads
leave idle (dispatch, verifier calls, packing); report it, don't tune to it. On a GPU the
rollout's long tail is what the asynchronous driver hides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import bench_step  # noqa: E402
from jaxrl_post.pipeline import loop, pipelined  # noqa: E402
from jaxrl_post.pipeline.config import AsyncSpec, ASYNC_MODES  # noqa: E402
from jaxrl_post.telemetry import read_metrics  # noqa: E402


def long_tailed(base: type, stop_ids: tuple[int, ...]) -> type:
  """The run class with the bench's stop tokens (random weights never say EOS)."""

  class LongTailed(base):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      self.sampling = dataclasses.replace(self.sampling, stop_ids=stop_ids)

  return LongTailed


def stop_tokens(vocab: int, count: int) -> tuple[int, ...]:
  return tuple(range(vocab // count // 2, vocab, vocab // count))[:count]


def one_run(exp, spec: AsyncSpec, stop_ids, warmup: int, workdir: str) -> dict[str, Any]:
  exp = dataclasses.replace(exp, steps=warmup + exp.steps, asynchronous=spec)
  base = pipelined.run_class(exp)
  loop.run(exp, workdir, log=lambda message: None, run_cls=long_tailed(base, stop_ids))
  records = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
             if r["step"] > warmup]
  lengths = np.array([r["rollout/completion_len_mean"] for r in records])
  maxes = [r["rollout/completion_len_max"] for r in records]
  tokens = sum(r["rollout/tokens"] for r in records)
  seconds = sum(r["time/step"] for r in records)
  wait = "time/wait_data" if spec.mode != "sync" else "time/rollout"
  out = {"mode": spec.mode, "steps": len(records), "tokens_per_s": tokens / seconds,
         "step_s": float(np.median([r["time/step"] for r in records])),
         "wait_data_s": float(np.median([r.get(wait, 0.0) for r in records])),
         "rollout_s": float(np.median([r["async/rollout_s"] if "async/rollout_s" in r
                                       else r["time/rollout"] for r in records])),
         "completion_len": {"mean_of_step_means": float(lengths.mean()), "max": max(maxes)}}
  if spec.mode != "sync":
    hist = np.sum([np.pad(r["async/staleness_hist"], (0, 16))[:16] for r in records], axis=0)
    out["staleness"] = {"hist_tokens": np.trim_zeros(hist, "b").tolist(),
                        "max": max(r["async/staleness"] for r in records)}
  return out


def run(args) -> dict[str, Any]:
  prompts, samples = (int(x) for x in args.batch.lower().split("x"))
  w = bench_step.Workload(args.model, prompts, samples, args.prompt_tokens, args.new_tokens,
                          devices=args.devices)
  exp = dataclasses.replace(bench_step.experiment(w), steps=args.steps)
  vocab = bench_step.MODELS[w.model].overrides.get("vocab_size", 1024)
  stops = stop_tokens(vocab, args.stop_tokens)
  engine = dataclasses.replace(exp.rollout.engine, max_stop_ids=max(len(stops), 1))
  exp = dataclasses.replace(exp, rollout=dataclasses.replace(exp.rollout, engine=engine))
  spec = AsyncSpec(mode=args.mode, max_staleness=args.max_staleness)
  with tempfile.TemporaryDirectory() as tmp:
    sync = one_run(exp, AsyncSpec(), stops, args.warmup, os.path.join(tmp, "sync"))
    ahead = one_run(exp, spec, stops, args.warmup, os.path.join(tmp, "async"))
  return {"async_vs_sync_throughput": ahead["tokens_per_s"] / sync["tokens_per_s"],
          "sync": sync, "async": ahead,
          "workload": {**dataclasses.asdict(w), "stop_tokens": len(stops),
                       "max_staleness": args.max_staleness},
          "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "versions": {"jax": jax.__version__}}


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", action="store_true", help="print one JSON object")
  p.add_argument("--model", default="tiny-llama", choices=sorted(bench_step.MODELS))
  p.add_argument("--batch", default="8x8", help="PxK: prompts per step x samples each")
  p.add_argument("--new-tokens", type=int, default=128, help="the completion cap")
  p.add_argument("--prompt-tokens", type=int, default=32, help="the prompt budget")
  p.add_argument("--stop-tokens", type=int, default=32,
                 help="token ids that end a sample (spread over the vocabulary)")
  p.add_argument("--steps", type=int, default=8, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=2, help="steps before timing (compiles)")
  p.add_argument("--mode", default="bounded", choices=[m for m in ASYNC_MODES if m != "sync"])
  p.add_argument("--max-staleness", type=int, default=2, help="bounded mode, optimizer steps")
  p.add_argument("--devices", type=int, default=0, help="the first N devices (0: all)")
  p.add_argument("--quick", action="store_true", help="micro model, 4x4, 3 steps (smoke)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  if args.quick:
    args.model, args.batch, args.steps, args.warmup = "micro", "4x4", 3, 1
    args.new_tokens, args.stop_tokens = 32, 8
  out = run(args)
  if args.json:
    print(json.dumps(out))
  else:
    for name in ("sync", "async"):
      r = out[name]
      print(f"{name:5s} ({r['mode']}): {r['tokens_per_s']:.0f} completion tok/s, "
            f"step {r['step_s']:.2f} s, waiting for data {r['wait_data_s']:.2f} s")
    print(f"async / sync throughput: {out['async_vs_sync_throughput']:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
