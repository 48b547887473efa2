"""forward_backward throughput of `python -m jaxrl_post.serve`, driven by the tinker SDK.

Starts the server, then for each adapter count A trains A adapters for --steps steps of
(forward_backward on --datums datums of --tokens tokens, optim_step) two ways: all A
clients at once, each from its own thread (the server batches their requests into shared
programs), and the same A adapters one after another. Prints one JSON object: tokens/s of
each, and the concurrent/sequential ratio. Compile time is left out: every shape runs
once before the clock starts.

  python scripts/bench_serve.py --model tests/fixtures/hf/tiny_llama --adapters 1,2,4
  python scripts/bench_serve.py --shapes smollm2-135m    # random bf16 weights, no model file
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_ENV = dict(os.environ, PYTHONPATH=ROOT)  # The server's: the devices as given.


def _ratio(concurrent: float, sequential: float) -> float:
  """concurrent / sequential to 3 significant digits: to 2 decimals, a ratio far below 1
  (the concurrent clients timed while the host was busy) lost most of its digits, 0.037
  coming out as 0.04."""
  return float(f"{concurrent / sequential:.3g}")


def random_model(shapes: str, out_dir: str) -> str:
  """A Hugging Face directory of `shapes` (a preset) with random bf16 weights and the test
  fixture's tokenizer (the benchmark sends token ids, never text): a model to serve where
  no checkpoint is at hand. Made on the CPU (main keeps this process off the accelerator,
  which the server has to itself)."""
  from jaxrl_post import models
  from jaxrl_post.models import preset
  from jaxrl_post.models.hf_export import save_pretrained
  from jaxrl_post.models.transformer import init_model, params_of

  _, tok = models.load(os.path.join(ROOT, "tests", "fixtures", "hf", "tiny_llama"))
  cfg = preset(shapes)
  save_pretrained(out_dir, cfg, params_of(init_model(cfg, seed=0)), tok, dtype="bfloat16")
  return out_dir


def compiled_rates(shapes: str, target_name: str, counts: list[int], datums: int, tokens: int,
                   rank: int, capacity: int) -> dict:
  """Without the device: each adapter count's step (the batched forward_backward and the
  optimizer program of its adapters) compiled for `target_name` by XLA on this host, its
  FLOPs, bytes and kernels per call, and the seconds the plan's roofline predicts for it
  (each kernel's larger of FLOPs and bytes over the chip's peaks, summed, plus the chip's
  cost per kernel).
  Concurrent: A adapters in one step; sequential: A steps of one adapter."""
  from jaxrl_post.plan import targets

  target = targets.resolve(target_name)
  targets.prepare(target)
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from jaxrl_post.models import LoraConfig, preset
  from jaxrl_post.models.transformer import abstract_model, params_of
  from jaxrl_post.plan.hlo_cost import program_cost, program_launches
  from jaxrl_post.plan.report import predicted_seconds
  from jaxrl_post.rl.packing import bucket
  from jaxrl_post.rollout import weights
  from jaxrl_post.serve import adapters
  from jaxrl_post.sharding import AXES

  cfg = preset(shapes, param_dtype="bfloat16", compute_dtype="bfloat16")
  lora_cfg = cfg.replace(lora=LoraConfig(rank=rank, alpha=32.0,
                                         targets=adapters.ATTN + adapters.MLP))
  mesh = Mesh(np.asarray(targets.target_devices(target).devices[:1]).reshape((1,) * len(AXES)),
              AXES)
  spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype,
                                                   sharding=NamedSharding(mesh, P()))
  like = lambda tree: jax.tree.map(lambda x: spec(x.shape, x.dtype), tree)
  bank = like(adapters.stacked(adapters.adapter_shapes(lora_cfg), capacity))
  base = like(params_of(abstract_model(cfg)))
  if weights.engine_form(cfg, mesh) is not None:  # The form a server there holds it in.
    base = weights.abstract_split(base, cfg.num_layers)
  chip = target.chip

  def predict(compiled) -> dict:
    text = compiled.as_text()
    cost, launches = program_cost(text), program_launches(text)["total"]
    return {"flops": cost.flops, "bytes": cost.bytes, "kernels": launches,
            "seconds": predicted_seconds(cost, chip, launches)}

  def step(a: int) -> dict:  # a adapters' forward_backward and optimizer programs
    n, width = a * datums, bucket(tokens, 16)
    batch = {"slot": spec((n,), jnp.int32), "tokens": spec((n, width), jnp.int32),
             "targets": spec((n, width), jnp.int32), "mask": spec((n, width), jnp.float32),
             "inputs": {"weights": spec((n, width), jnp.float32)}}
    fb = adapters.batch_program(lora_cfg, "cross_entropy", False).trace(
        bank, bank, base, batch, {}).lower().compile()
    k = min(capacity, bucket(a, 1))
    per_slot = lambda dtype: spec((k,), dtype)
    hp = {f.name: per_slot(jnp.float32) for f in dataclasses.fields(adapters.AdamParams)}
    trains = jax.tree.map(lambda _: per_slot(jnp.bool_), bank)
    adam = adapters.adam_program.trace(bank, bank, bank, bank, per_slot(jnp.int32),
                                per_slot(jnp.bool_), trains, per_slot(jnp.float32),
                                hp).lower().compile()
    out = {"forward_backward": predict(fb), "optim_step": predict(adam)}
    out["seconds"] = out["forward_backward"]["seconds"] + out["optim_step"]["seconds"]
    return out

  one = step(1)
  results = {}
  for a in counts:
    both = step(a) if a > 1 else one
    row = {"concurrent": round(a * datums * tokens / both["seconds"], 1),
           "sequential": round(a * datums * tokens / (a * one["seconds"]), 1),
           "step": both}
    row["ratio"] = _ratio(row["concurrent"], row["sequential"])
    results[str(a)] = row
  return {"compiled_for": target_name, "chip": chip.name, "kernel_s": chip.kernel_s,
          "predicted_tokens_per_s": results}


def _server(model: str, workdir: str, port: int, max_adapters: int) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, "-m", "jaxrl_post.serve", f"--port={port}",
                           f"--model={model}", f"--workdir={workdir}",
                           f"--gin_param=ServeConfig.max_adapters={max_adapters}"],
                          env=SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  from jaxrl_post.serve.app import wait_until_serving

  if wait_until_serving(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 600):
    return proc
  raise SystemExit("bench_serve: the server " + ("exited" if proc.poll() is not None
                                                 else "did not start"))


def _steps(client, data, steps: int, types) -> None:
  for _ in range(steps):
    fb = client.forward_backward(data, "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    fb.result()


def _measure(clients, data, steps: int, concurrent: bool, types) -> float:
  start = time.perf_counter()
  if concurrent:
    threads = [threading.Thread(target=_steps, args=(c, data, steps, types)) for c in clients]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  else:
    for c in clients:
      _steps(c, data, steps, types)
  return time.perf_counter() - start


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--shapes", default=None,
                 help="serve a model of this preset's shapes (e.g. smollm2-135m) with random "
                      "weights instead of --model: needs no model file")
  p.add_argument("--adapters", default="1,2,4")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--datums", type=int, default=4)
  p.add_argument("--tokens", type=int, default=128)
  p.add_argument("--rank", type=int, default=16)
  p.add_argument("--repeats", type=int, default=3, help="each mode's best of this many")
  p.add_argument("--port", type=int, default=8791)
  p.add_argument("--compiled-for", default=None, metavar="TARGET",
                 help="no server: compile the batched programs for a plan target (e.g. "
                      "h100x1, with --shapes) and print their predicted tokens/s")
  p.add_argument("--base_url", default=None,
                 help="a server already running (--model must be what it serves)")
  args = p.parse_args(argv)
  counts = [int(a) for a in args.adapters.split(",")]
  if args.compiled_for:
    shapes = args.shapes or "smollm2-135m"
    print(json.dumps({"model": shapes, "rank": args.rank, "datums": args.datums,
                      "tokens": args.tokens, **compiled_rates(
                          shapes, args.compiled_for, counts,
                          args.datums, args.tokens, args.rank, max(counts) + 1)}))
    return
  os.environ["JAX_PLATFORMS"] = "cpu"  # The client's own arrays: the server holds the devices.
  import tinker
  from tinker import types

  os.environ.setdefault("TINKER_API_KEY", "tml-bench")
  os.environ["TINKER_TELEMETRY"] = "0"
  with tempfile.TemporaryDirectory() as workdir:
    if args.shapes:
      args.model = random_model(args.shapes, os.path.join(workdir, args.shapes))
    proc = None if args.base_url else _server(args.model, workdir, args.port, max(counts))
    try:
      service = tinker.ServiceClient(base_url=args.base_url or f"http://127.0.0.1:{args.port}")
      clients = [service.create_lora_training_client(base_model=args.model, rank=args.rank).result()
                 for _ in range(max(counts))]
      vocab = 256  # Token ids every model has.
      rng = np.random.default_rng(0)
      data = [types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                          loss_fn_inputs={"target_tokens": seq[1:].tolist(),
                                          "weights": [1.0] * args.tokens})
              for seq in rng.integers(0, vocab, (args.datums, args.tokens + 1))]
      tokens_per_step = args.datums * args.tokens
      results = {}
      for a in counts:
        for concurrent in (True, False):  # Warm: compile every batch shape first (the server
          # batches a client once it has seen its pace: two steps).
          _measure(clients[:a], data, 5, concurrent, types)
        best = {True: float("inf"), False: float("inf")}
        for _ in range(args.repeats):  # Alternating, so a slow moment of the host hits both.
          for concurrent in (True, False):
            best[concurrent] = min(best[concurrent],
                                   _measure(clients[:a], data, args.steps, concurrent, types))
        row = {("concurrent" if c else "sequential"): round(a * args.steps * tokens_per_step / t, 1)
               for c, t in best.items()}
        row["ratio"] = _ratio(row["concurrent"], row["sequential"])
        results[str(a)] = row
      service.close("success").result()
    finally:
      if proc is not None:
        proc.kill()
  print(json.dumps({"model": args.shapes or args.model, "rank": args.rank, "datums": args.datums,
                    "tokens": args.tokens, "steps": args.steps, "repeats": args.repeats,
                    "tokens_per_s": results}))


if __name__ == "__main__":
  main()
