"""`python -m jaxrl_post.serve`: a Tinker-compatible training and sampling service.

  python -m jaxrl_post.serve --port 8000 --model smollm2-135m-instruct --workdir serve_runs
  TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python my_tinker_program.py

Every local device serves: adapters' rows and the sampler's slots split over them.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Optional, Sequence

from jaxrl_post import compile_cache
from jaxrl_post.errors import UserError, make_directory


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.serve",
                              description="A Tinker-compatible LoRA training and sampling "
                                          "service over one base model.")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=_port, default=8000)
  p.add_argument("--model", default="smollm2-135m-instruct",
                 help="an embedded model name, a Hugging Face model directory or a GGUF file")
  p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                 help="compute dtype (default: float32 on a CPU, bfloat16 on accelerators)")
  p.add_argument("--workdir", default="serve_runs",
                 help="where saved adapters (tinker:// paths) and the tokenizer live")
  p.add_argument("--gin_file", action="append", default=[], help="gin file binding ServeConfig.*")
  p.add_argument("--gin_param", action="append", default=[], help="one gin binding")
  compile_cache.add_cache_flag(p)
  return p


def _port(text: str) -> int:
  """An argparse type: a TCP port (uvicorn hangs on one past 65535 instead of failing)."""
  port = int(text)
  if not 1 <= port <= 65535:
    raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
  return port


def listen(host: str, port: int) -> socket.socket:
  """A socket bound to host:port, taken before the model loads: a port in use or a host
  that is not this machine's is a one-line error at once, not after a minute of loading."""
  try:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
  except OSError as e:
    raise UserError(f"--host={host}: {e.strerror or e}") from None
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise UserError(f"--host={host} --port={port}: cannot listen there "
                    f"({e.strerror or e})") from None
  return sock


def build_service(args: argparse.Namespace):
  """The Service for parsed flags (loads the model; compiles nothing yet)."""
  import jax

  from jaxrl_post import models
  from jaxrl_post.models.hf_export import write_tokenizer
  from jaxrl_post.models.transformer import params_of
  from jaxrl_post.pipeline import config
  from jaxrl_post.serve.config import ServeConfig
  from jaxrl_post.serve.service import Served, Service
  from jaxrl_post.sharding import MeshConfig, make_mesh

  for path in args.gin_file:
    if not os.path.isfile(path):
      raise UserError(f"{path}: no such gin file")
  workdir = os.path.abspath(args.workdir)
  make_directory(workdir, "--workdir")
  config.parse(args.gin_file, args.gin_param)
  cfg = config.build(ServeConfig.__name__)
  dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  model, tok = models.load(args.model, compute_dtype=dtype)
  if model.config.moe is not None:
    raise UserError(f"--model {args.model}: mixture-of-experts models are not served yet "
                    "(LoRA covers attention and dense MLP matrices)")
  tokenizer_dir = os.path.join(workdir, "tokenizer")
  os.makedirs(tokenizer_dir, exist_ok=True)
  write_tokenizer(tok, tokenizer_dir)  # What the client's get_tokenizer() loads.
  source = os.path.realpath(args.model) if os.path.exists(args.model) else args.model
  served = Served(name=args.model, cfg=model.config, params=params_of(model),
                  tokenizer_dir=tokenizer_dir, eos_ids=tok.stop_ids,
                  encode=lambda s: tok.encode(s, add_special_tokens=False),
                  aliases=(source, os.path.realpath(tokenizer_dir)))
  mesh = make_mesh(MeshConfig(data=jax.device_count(), fsdp=1))
  return Service(served, cfg, workdir, mesh)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  try:
    sock = listen(args.host, args.port)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  with sock:
    try:
      compile_cache.enable(args.compilation_cache)
      service = build_service(args)
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    import uvicorn

    from jaxrl_post.serve.app import build

    print(f"serving {args.model} at http://{args.host}:{args.port} "
          f"(workdir {service.store.root})", flush=True)
    try:
      uvicorn.Server(uvicorn.Config(build(service), log_level="warning")).run(sockets=[sock])
    finally:
      service.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
