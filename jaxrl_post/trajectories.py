"""Prints or filters a run's stored episodes: python -m jaxrl_post.trajectories WORKDIR.

  python -m jaxrl_post.trajectories runs/quickstart_agent --step 40 --failed --limit 3
  python -m jaxrl_post.trajectories runs/quickstart_agent --split eval --json > eval.jsonl

Without --json each episode prints as a transcript: the prompt, then each model reply and
the observation that answered it; a summary line counts what matched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from jaxrl_post.envs import store


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxrl_post.trajectories",
                              description="Print or filter a run's stored episodes.")
  p.add_argument("workdir", help=f"the run's directory (it holds {store.FILE})")
  p.add_argument("--step", type=int, help="only this RL step's episodes")
  p.add_argument("--split", choices=("train", "eval"), help="only training or evaluation")
  p.add_argument("--problem", help="only this problem id")
  solved = p.add_mutually_exclusive_group()
  solved.add_argument("--solved", action="store_true", help="only solved episodes")
  solved.add_argument("--failed", action="store_true", help="only unsolved episodes")
  p.add_argument("--limit", type=int, default=None, help="print at most this many")
  p.add_argument("--json", action="store_true", help="print the matching JSON lines")
  return p


def transcript(row: dict) -> str:
  lines = [f"step {row['step']} {row['split']} {row['problem']} sample {row['sample']}: "
           f"reward {row['reward']:g}, {'solved' if row['solved'] else 'not solved'}, "
           f"{len(row['turns'])} turns, ended: {row['ended']}",
           f"  [prompt] {row['prompt']}"]
  for n, turn in enumerate(row["turns"], 1):
    lines.append(f"  [model {n}] {turn['reply']}")
    if turn["observation"]:
      lines.append(f"  [env {n}] {turn['observation']}")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  path = os.path.join(args.workdir, store.FILE)
  if not os.path.isfile(path):
    print(f"error: {path}: no such file (a multi-turn run writes it)", file=sys.stderr)
    return 2
  solved = True if args.solved else False if args.failed else None
  shown = rewards = 0
  for row in store.read(path, args.step, args.split, solved, args.problem):
    if args.limit is not None and shown >= args.limit:
      break
    print(json.dumps(row) if args.json else transcript(row) + "\n")
    shown += 1
    rewards += row["reward"]
  if not args.json:
    print(f"{shown} episodes" + (f", mean reward {rewards / shown:.3f}" if shown else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
