"""Runs one program from stdin in the sandbox and prints how it ended as one JSON object.

  python -m jaxrl_post.rewards.run_code --timeout-s 2 --memory-mb 256 [--tests t.py] < p.py

The object has status, reason, returncode, stdout, stderr, seconds and isolation (see
`jaxrl_post.rewards.sandbox.Result`). The exit code is 0 whenever the sandbox worked,
whatever the program did; 2 for bad arguments or input, 1 if the sandbox itself failed,
each with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn, Sequence

from jaxrl_post.rewards.sandbox import Limits, SandboxError, run_program

_PROG = "run_code"


class _Parser(argparse.ArgumentParser):
  """An ArgumentParser whose errors are one line (no usage block)."""

  def error(self, message: str) -> NoReturn:
    _fail(2, message)


def _fail(code: int, message: str) -> NoReturn:
  print(f"{_PROG}: error: {message}", file=sys.stderr)
  sys.exit(code)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog=_PROG, description=__doc__.splitlines()[0])
  p.add_argument("--timeout-s", type=float, required=True, help="wall-clock limit")
  p.add_argument("--memory-mb", type=int, required=True, help="address-space limit")
  p.add_argument("--tests", help="file of test code run after the program")
  p.add_argument("--cpu-s", type=int, help="CPU-time limit (default: ceil(timeout))")
  p.add_argument("--max-procs", type=int, default=Limits.max_procs,
                 help="processes plus threads")
  p.add_argument("--output-bytes", type=int, default=Limits.output_bytes,
                 help="cap on stdout plus stderr")
  p.add_argument("--disk-mb", type=int, default=Limits.disk_mb,
                 help="size of the work directory")
  p.add_argument("--no-namespaces", action="store_true",
                 help="skip Linux namespaces (rlimits, uid and audit hook only)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    limits = Limits(timeout_s=args.timeout_s, memory_mb=args.memory_mb, cpu_s=args.cpu_s,
                    max_procs=args.max_procs, output_bytes=args.output_bytes,
                    disk_mb=args.disk_mb, namespaces=not args.no_namespaces)
  except ValueError as e:
    _fail(2, str(e))
  tests = None
  try:
    source = sys.stdin.buffer.read().decode("utf-8")
    if args.tests is not None:
      with open(args.tests, encoding="utf-8") as f:
        tests = f.read()
  except (OSError, UnicodeDecodeError) as e:
    _fail(2, f"cannot read the input: {e}")
  try:
    result = run_program(source, tests, limits=limits)
  except SandboxError as e:
    _fail(1, f"sandbox failed: {e}")
  print(json.dumps(result.as_dict()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
