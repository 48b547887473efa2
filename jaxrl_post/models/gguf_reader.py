"""A GGUF file's metadata and tensor table, parsed in one pass over its header.

The `gguf` package's reader builds a numpy view per field part: for a tokenizer's 49152
tokens and 48900 merges that is about a million small arrays and seconds of every
command's start-up. This reader walks the same layout with `struct` over the header bytes
and maps the tensor data once; `gguf.quants` still dequantises (see models/gguf_file).

Layout (little-endian, GGUF v2 and v3): magic "GGUF", uint32 version, uint64 tensor count,
uint64 key-value count; the key-value pairs (string key, uint32 type, value; arrays are
uint32 element type, uint64 count, elements); the tensor infos (string name, uint32 dims,
uint64 sizes innermost first, uint32 ggml type, uint64 offset); the tensor data, aligned to
`general.alignment` (32 by default), each tensor at its offset from the data's start.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Scalar value types: struct format and numpy dtype.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16),
            3: ("<h", np.int16), 4: ("<I", np.uint32), 5: ("<i", np.int32),
            6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64),
            11: ("<q", np.int64), 12: ("<d", np.float64)}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor: `shape` innermost first (as GGUF stores it), `data` its raw bytes as
  uint8 [outer dims..., bytes per innermost row] (what gguf.quants.dequantize takes)."""

  name: str
  shape: tuple[int, ...]
  tensor_type: GGMLQuantizationType
  data: np.ndarray


class _Cursor:
  def __init__(self, buf):
    self.buf, self.pos = buf, 0

  def unpack(self, fmt: str):
    value = struct.unpack_from(fmt, self.buf, self.pos)[0]
    self.pos += struct.calcsize(fmt)
    return value

  def string(self) -> str:
    n = self.unpack("<Q")
    if self.pos + n > len(self.buf):
      raise ValueError(f"a string of {n} bytes at offset {self.pos} runs past the file's end")
    text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
    self.pos += n
    return text

  def value(self, kind: int) -> Any:
    if kind == _STRING:
      return self.string()
    if kind == _ARRAY:
      return self.array()
    if kind not in _SCALARS:
      raise ValueError(f"unknown GGUF value type {kind} at offset {self.pos}")
    return self.unpack(_SCALARS[kind][0])

  def array(self) -> list:
    kind, count = self.unpack("<I"), self.unpack("<Q")
    if kind == _STRING:
      return [self.string() for _ in range(count)]
    if kind == _ARRAY:
      return [self.array() for _ in range(count)]
    if kind not in _SCALARS:
      raise ValueError(f"unknown GGUF array element type {kind} at offset {self.pos}")
    dtype = np.dtype(_SCALARS[kind][1]).newbyteorder("<")
    values = np.frombuffer(self.buf, dtype, count, self.pos)  # Raises past the end.
    self.pos += count * dtype.itemsize
    return values.tolist()


def read_gguf(path: str) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
  """(metadata, tensors by name) of the GGUF file at `path`. Raises ValueError (or
  struct.error) on a file that is not GGUF or is cut short; the caller names the file."""
  with open(path, "rb") as f:
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  cur = _Cursor(memoryview(buf))
  if bytes(cur.buf[:4]) != _MAGIC:
    raise ValueError("not a GGUF file (no GGUF magic)")
  cur.pos = 4
  version, n_tensors, n_kv = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
  if version < 2:
    raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
  meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                          "GGUF.kv_count": n_kv}
  for _ in range(n_kv):
    key = cur.string()
    meta[key] = cur.value(cur.unpack("<I"))
  infos = []
  for _ in range(n_tensors):
    name = cur.string()
    dims = tuple(cur.unpack("<Q") for _ in range(cur.unpack("<I")))
    infos.append((name, dims, GGMLQuantizationType(cur.unpack("<I")), cur.unpack("<Q")))
  align = int(meta.get("general.alignment", 32))
  start = -(-cur.pos // align) * align
  data = np.frombuffer(buf, np.uint8)
  return meta, {name: _tensor(data, start, name, dims, kind, offset)
                for name, dims, kind, offset in infos}


def _tensor(data: np.ndarray, start: int, name: str, dims: tuple[int, ...],
            kind: GGMLQuantizationType, offset: int) -> GGUFTensor:
  block, block_bytes = GGML_QUANT_SIZES[kind]
  if dims[0] % block:
    raise ValueError(f"tensor {name}: {dims[0]} values per row is not a multiple of "
                     f"{kind.name}'s block of {block}")
  row_bytes = dims[0] // block * block_bytes
  outer = tuple(reversed(dims[1:]))
  size = int(np.prod(outer, dtype=np.int64)) * row_bytes
  begin = start + offset
  if begin + size > data.size:
    raise ValueError(f"tensor {name}: its {size} bytes at offset {begin} run past the end "
                     f"of the file ({data.size} bytes)")
  raw = data[begin:begin + size].reshape(*outer, row_bytes)
  return GGUFTensor(name, dims, kind, raw)
