"""Reading parquet files a batch of rows at a time, as Python dicts like JSONL rows.

Datasets ship as parquet (Hugging Face's `train-00000-of-00002.parquet` shards, verl's
preprocessed files), so a task reads them beside JSONL. Rows come out as `to_pylist` makes
them (a struct is a dict, a list of structs a list of dicts, null is None), which is what
the JSONL line of the same row parses to, so one row parser serves both.

pyarrow is imported here, not at the top of the package: only tasks that read parquet
pay for it, and verifier worker processes never do.
"""

from __future__ import annotations

from typing import Any, Collection, Iterator, Optional

from jaxrl_post.errors import UserError

# Rows converted to Python at a time: the whole file never sits in memory as dicts, and
# a batch is large enough that the per-batch overhead stays small.
BATCH_ROWS = 1024


def rows(path: str, columns: Optional[Collection[str]] = None,
         batch_rows: int = BATCH_ROWS) -> Iterator[tuple[int, dict[str, Any]]]:
  """(0-based row index, row) of every row of one parquet file, across its row groups.

  Args:
    path: The parquet file.
    columns: The columns worth reading; the file's others are never decoded (verl's
      `extra_info`, say). Ones the file lacks are simply absent from the rows, so the row
      parser counts them as missing, as for JSONL. None reads every column.
    batch_rows: Rows converted to dicts at a time.

  Raises:
    UserError: One line naming the file when it is missing, not parquet, truncated or
      corrupt, whether that shows in its footer (at open) or in a page (while reading).
  """
  import pyarrow  # Here: see the module docstring.
  import pyarrow.parquet as pq

  try:
    handle = pq.ParquetFile(path)
    names = handle.schema_arrow.names
    wanted = names if columns is None else [name for name in names if name in columns]
    index = 0
    for batch in handle.iter_batches(batch_size=batch_rows, columns=wanted):
      for row in batch.to_pylist():
        yield index, row
        index += 1
  except FileNotFoundError:
    raise UserError(f"{path}: no such file") from None
  except IsADirectoryError:
    raise UserError(f"{path}: is a directory, expected a parquet file") from None
  # A truncated footer raises ArrowInvalid (a ValueError); a damaged page, OSError.
  except (pyarrow.ArrowException, OSError) as e:
    raise UserError(f"{path}: cannot be read as parquet ({_first_line(e)})") from None


def _first_line(error: BaseException) -> str:
  text = str(getattr(error, "strerror", None) or error).strip()
  return text.splitlines()[0] if text else type(error).__name__
