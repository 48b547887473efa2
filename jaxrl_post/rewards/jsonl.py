"""Reading JSONL files a row at a time, where a bad row is skipped and counted, not fatal.

The tasks' data files and `generate --prompts` share it: lines are read as bytes (a line
that is not UTF-8 is one skipped row, not a crash), blank lines are not rows, and a file
that cannot be opened at all is one UserError naming it.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Iterator

from jaxrl_post.errors import UserError

# Skip reasons every reader shares (each adds its own).
INVALID_JSON = "invalid_json"  # Not JSON, or not UTF-8.
NOT_AN_OBJECT = "not_an_object"


class Skip(Exception):
  """A row that cannot be used; `reason` is the skip reason it is counted under."""

  def __init__(self, reason: str):
    super().__init__(reason)
    self.reason = reason


def lines(path: str, kind: str = "a JSONL file", flag: str = "") -> Iterator[tuple[int, bytes]]:
  """(1-based line number, raw bytes) of each non-blank line; `.gz` files are read
  through gzip. `kind` names what the file should be and `flag` the option that gave it,
  in the error a missing or unreadable file raises."""
  suffix = f" ({flag})" if flag else ""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as handle:
      for line, raw in enumerate(handle, 1):
        if raw.strip():
          yield line, raw
  except FileNotFoundError:
    raise UserError(f"{path}: no such file{suffix}") from None
  except IsADirectoryError:
    raise UserError(f"{path}: is a directory, expected {kind}{suffix}") from None
  except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError; a cut file, EOFError.
    raise UserError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def json_object(raw: bytes) -> dict[str, Any]:
  """One line's JSON object; raises Skip(INVALID_JSON or NOT_AN_OBJECT) otherwise."""
  try:
    row = json.loads(raw)
  except ValueError:  # JSONDecodeError and UnicodeDecodeError both derive from it.
    raise Skip(INVALID_JSON) from None
  if not isinstance(row, dict):
    raise Skip(NOT_AN_OBJECT)
  return row
