"""Time how long the code sandbox takes to stop each hostile program.

  python scripts/bench_sandbox.py [--json] [--no-namespaces]

Runs every case of `jaxrl_post.rewards.sandbox_cases.HOSTILE` once under its small
limits (2 s wall time, 256 MB) and prints case, status and seconds (from start until no
process of the run is left), as a table or, with --json, a JSON list of
{case, status, seconds, expected, reason, escaped}. `expected` is null for a case whose
outcome rests on a layer this OS did not give (e.g. read-only mounts, which need a mount
namespace). The isolation layers the OS allowed go to stderr. A file a case managed to
write outside its directory is listed in `escaped` and removed. Exits 1 if any case with
its layers given ended with a status it does not expect, or escaped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Sequence

from jaxrl_post.rewards.sandbox import run_program
from jaxrl_post.rewards.sandbox_cases import ESCAPE_PATHS, HOSTILE, LIMITS


def run_case(name: str, limits) -> dict:
  case = HOSTILE[name]
  r = run_program(case.source, case.tests, limits=limits)
  expected = r.status in case.statuses
  if case.needs is not None and case.needs not in r.isolation:
    expected = None  # Nothing here enforces what the case tests.
  escaped = [path for path in ESCAPE_PATHS if os.path.exists(path)]
  for path in escaped:
    os.remove(path)
  return {"case": name, "status": r.status, "seconds": r.seconds,
          "expected": expected and not escaped, "reason": r.reason,
          "escaped": escaped, "isolation": r.isolation}


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json", action="store_true", help="print a JSON list")
  p.add_argument("--no-namespaces", action="store_true",
                 help="run without Linux namespaces (rlimits, uid and audit hook only)")
  args = p.parse_args(argv)
  limits = dataclasses.replace(LIMITS, namespaces=not args.no_namespaces)
  rows = [run_case(name, limits) for name in HOSTILE]
  layers = sorted({layer for row in rows for layer in row.pop("isolation")})
  print(f"isolation: {' '.join(layers) or 'none'}", file=sys.stderr)
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    print(f"{'case':<22} {'status':<13} {'seconds':>7}  reason")
    for row in rows:
      flag = {True: "", None: "  (not enforced here)", False: "  (UNEXPECTED)"}
      escaped = f"  (WROTE {', '.join(row['escaped'])})" if row["escaped"] else ""
      print(f"{row['case']:<22} {row['status']:<13} {row['seconds']:>7.3f}  "
            f"{row['reason'][:60]}{flag[row['expected']]}{escaped}")
  return 0 if all(row["expected"] is not False for row in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
