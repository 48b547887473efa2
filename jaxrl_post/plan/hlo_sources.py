"""Where a compiled program's memory bytes go, by the Python function that traced them.

The plan predicts most programs from their HBM bytes (plan.hlo_cost); to make one faster
you need to know which code those bytes come from. A compiled program's text keeps jax's
source locations: each instruction's `stack_frame_id` names a frame in the module's
StackFrames table, whose innermost entry is the function that emitted the op (jax leaves
its own frames out). This sums each executed instruction's bytes (loops at their trip
counts, as plan.hlo_cost counts them) under that function, e.g. "rms_norm
(models/layers.py:40)": norms, RoPE, the SwiGLU product, the attention kernels and the
matmuls of a train step each get their share.
"""

from __future__ import annotations

import collections
import re

from jaxrl_post.plan.hlo_cost import leaf_costs

_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_FIELDS = re.compile(r"(\w+)=(\d+)")


def _table(text: str, name: str) -> list[str]:
  """The lines of a module's `name` table (FileNames, FunctionNames, FileLocations,
  StackFrames): from the line after its title to the first blank one."""
  match = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
  return match.group(1).splitlines() if match else []


def _quoted(lines: list[str]) -> dict[int, str]:
  return {int(line.split(None, 1)[0]): line.split(None, 1)[1].strip().strip('"')
          for line in lines if line.strip()}


def frame_labels(text: str) -> dict[int, str]:
  """stack_frame_id -> "function (dir/file.py:line)" of the frame's innermost location."""
  files, funcs = _quoted(_table(text, "FileNames")), _quoted(_table(text, "FunctionNames"))
  locations = {}
  for line in _table(text, "FileLocations"):
    fields = dict(_FIELDS.findall(line))
    path = files.get(int(fields.get("file_name_id", 0)), "?")
    short = "/".join(path.split("/")[-2:])
    locations[int(line.split(None, 1)[0])] = (
        f"{funcs.get(int(fields.get('function_name_id', 0)), '?')} ({short}:"
        f"{fields.get('line', '?')})")
  labels = {}
  for line in _table(text, "StackFrames"):
    fields = dict(_FIELDS.findall(line))
    labels[int(line.split(None, 1)[0])] = locations.get(int(fields.get("file_location_id", 0)),
                                                        "?")
  return labels


def bytes_by_source(hlo_text: str, top: int = 8) -> list[dict]:
  """The `top` functions by the bytes of the instructions they traced, per program call:
  [{"source", "share", "bytes", "launches"}], largest first, shares of the program's
  bytes; instructions without a source location count as "(no source)"."""
  labels = frame_labels(hlo_text)
  total, by, launches = 0.0, collections.Counter(), collections.Counter()
  for instr, times, cost in leaf_costs(hlo_text):
    if not cost.bytes:
      continue
    frame = _FRAME.search(instr.attrs)
    source = labels.get(int(frame.group(1)), "?") if frame else "(no source)"
    by[source] += times * cost.bytes
    launches[source] += times
    total += times * cost.bytes
  return [{"source": s, "share": round(b / total, 4), "bytes": b, "launches": launches[s]}
          for s, b in by.most_common(top)] if total else []
