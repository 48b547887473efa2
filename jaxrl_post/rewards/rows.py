"""A task's data rows from JSONL or parquet, one file, a directory of shards or a glob.

A task names its data with one path. What the path means:
  - a `.parquet` file: its rows, read in batches (rewards/parquet.py);
  - any other file: JSONL, one object a line (`.gz` read through gzip; rewards/jsonl.py);
  - a directory: every `*.parquet` shard in it, in name order (how Hugging Face datasets
    ship a split: `train-00000-of-00002.parquet`, `train-00001-of-00002.parquet`);
  - a glob (`data/train-*.parquet`): the files it matches, in name order, each read by its
    own suffix. A directory that holds several splits needs the glob.
Whatever the file, a row reaches the task's parser as the same dict, and a row it cannot
use is skipped and counted by reason; `ReadReport` is what was read and skipped, per path.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Collection, Iterator, Mapping, NamedTuple, Optional

from jaxrl_post.errors import UserError
from jaxrl_post.rewards import jsonl, parquet

PARQUET_SUFFIX = ".parquet"


class Row(NamedTuple):
  """One row of a data file, not yet checked.

  Attributes:
    file: The file it is in (one shard of a directory or glob).
    position: Where in that file: the 1-based line of a JSONL row (as an editor shows
      it), the 0-based row index of a parquet row (as pyarrow and pandas count).
    data: The raw JSONL line (bytes), or the parquet row (a dict).
  """

  file: str
  position: int
  data: bytes | dict[str, Any]

  @property
  def id(self) -> str:
    """"train.jsonl:42" or "train-00000-of-00002.parquet:41": where the row came from."""
    return f"{os.path.basename(self.file)}:{self.position}"

  def object(self) -> dict[str, Any]:
    """The row as a dict; raises jsonl.Skip when a JSONL line is not a JSON object."""
    if isinstance(self.data, dict):
      return self.data
    return jsonl.json_object(self.data)


@dataclasses.dataclass(frozen=True)
class ReadReport:
  """What reading one path gave: every row seen (blank JSONL lines are not rows), and
  the ones skipped, by reason."""

  path: str
  files: int
  rows: int
  skipped: Mapping[str, int]

  def line(self) -> str:
    """"read 120 rows from data/train-*.parquet (2 files); skipped 3 (missing_field=2, ...)"."""
    shards = f" ({self.files} files)" if self.files > 1 else ""
    total = sum(self.skipped.values())
    reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items()) if v)
    return (f"read {self.rows} rows from {self.path}{shards}; skipped {total}"
            + (f" ({reasons})" if reasons else ""))


def files(path: str, kind: str = "a JSONL or parquet file") -> list[str]:
  """The data files `path` names (see the module docstring), in the order they are read."""
  path = os.fspath(path)
  if os.path.isdir(path):
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*" + PARQUET_SUFFIX)))
    if not found:
      raise UserError(f"{path}: is a directory with no *{PARQUET_SUFFIX} files, "
                      f"expected {kind} (or a directory of parquet shards)")
    return found
  if not os.path.exists(path) and glob.has_magic(path):
    found = sorted(p for p in glob.glob(path) if os.path.isfile(p))
    if not found:
      raise UserError(f"{path}: no file matches this pattern, expected {kind}")
    return found
  return [path]


def read(path: str, kind: str = "a JSONL or parquet file",
         columns: Optional[Collection[str]] = None) -> Iterator[Row]:
  """Every row of every file `path` names.

  Args:
    path: A file, directory or glob (see the module docstring).
    kind: What the file should be, for the error a missing or unreadable one raises.
    columns: The fields the task reads: a parquet file decodes only these. JSONL lines
      are parsed whole.
  """
  for name in files(path, kind):
    if name.endswith(PARQUET_SUFFIX):
      for index, row in parquet.rows(name, columns):
        yield Row(name, index, row)
    else:
      for line, raw in jsonl.lines(name, kind=kind):
        yield Row(name, line, raw)
