"""The protobuf messages of the Tinker API that travel as protobuf: forward_backward's
request, and the results of forward_backward and sampling.

A small codec of the wire format rather than generated classes: the schema ships only
inside the client SDK, which the server does not depend on. Field numbers follow the
SDK's `tinker_public` package; tests/serve/test_wire.py checks both directions against the
SDK's own generated classes.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Iterator

import numpy as np

from jaxrl_post.errors import UserError

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# DType enum values -> numpy dtypes (BFLOAT16 arrives widened by the client only as output).
DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}
FLOAT32, INT64 = 1, 2
STOP, LENGTH = 0, 1  # StopReason


# ------------------------------------------------------------------ decoding


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  shift = value = 0
  while True:
    if i >= len(buf):
      raise UserError("forward_backward: the protobuf body is cut off")
    b = buf[i]
    value |= (b & 0x7F) << shift
    i += 1
    if b < 0x80:
      return value, i
    shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
  """(field number, wire type, value) of each field of a message: ints for varints and
  fixed widths (raw bits), bytes for length-delimited fields."""
  i = 0
  while i < len(buf):
    key, i = _varint(buf, i)
    number, kind = key >> 3, key & 7
    if kind == _VARINT:
      value, i = _varint(buf, i)
    elif kind == _I64:
      value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
    elif kind == _I32:
      value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
    elif kind == _LEN:
      n, i = _varint(buf, i)
      if i + n > len(buf):
        raise UserError("forward_backward: the protobuf body is cut off")
      value, i = buf[i:i + n], i + n
    else:
      raise UserError(f"forward_backward: protobuf wire type {kind} is not supported")
    yield number, kind, value


def _int64s(kind: int, value) -> list[int]:  # a repeated int64, packed or not
  if kind == _VARINT:
    return [_signed(value)]
  out, i = [], 0
  while i < len(value):
    v, i = _varint(value, i)
    out.append(_signed(v))
  return out


def _signed(v: int) -> int:
  return v - (1 << 64) if v >= 1 << 63 else v


def _double(bits: int) -> float:
  return struct.unpack("<d", bits.to_bytes(8, "little"))[0]


def _map_entry(buf: bytes) -> tuple[str, object, int]:
  key, value, kind = "", b"", _LEN
  for number, k, v in fields(buf):
    if number == 1:
      key = v.decode()
    elif number == 2:
      value, kind = v, k
  return key, value, kind


def tensor(buf: bytes, name: str) -> np.ndarray:
  """A Tensor message (dense bytes or sparse CSR) as a numpy array."""
  dense, csr, dtype, shape = None, None, 0, []
  for number, kind, value in fields(buf):
    if number == 1:
      dense = value
    elif number == 2:
      csr = {n: v for n, _, v in fields(value)}
    elif number == 3:
      dtype = value
    elif number == 4:
      shape += _int64s(kind, value)
  if dtype not in DTYPES:
    raise UserError(f"loss_fn_inputs[{name!r}]: dtype {dtype} is not float32, int64 or int32")
  dt = DTYPES[dtype]
  if csr is not None:
    return _densify(csr, dt, shape, name)
  data = np.frombuffer(dense or b"", dt)
  if shape and int(np.prod(shape)) != data.size:
    raise UserError(f"loss_fn_inputs[{name!r}]: {data.size} values for shape {shape}")
  return data.reshape(shape) if shape else data


def _densify(csr: dict, dt: np.dtype, shape: list[int], name: str) -> np.ndarray:
  if len(shape) != 2:
    raise UserError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D, got {shape}")
  values = np.frombuffer(csr.get(1, b""), dt)
  crow = np.frombuffer(csr.get(2, b""), "<i8")
  cols = np.frombuffer(csr.get(3, b""), "<i8")
  if len(crow) != shape[0] + 1 or len(cols) != len(values) or (cols >= shape[1]).any():
    raise UserError(f"loss_fn_inputs[{name!r}]: the sparse rows do not fit shape {shape}")
  out = np.zeros(shape, dt)
  rows = np.repeat(np.arange(shape[0]), np.diff(crow))
  out[rows, cols] = values
  return out


@dataclasses.dataclass
class Datum:
  tokens: np.ndarray  # [N] int32, the model input
  inputs: dict[str, np.ndarray]  # loss_fn_inputs by name


@dataclasses.dataclass
class ForwardBackwardRequest:
  model_id: str = ""
  seq_id: int = 0
  data: list[Datum] = dataclasses.field(default_factory=list)
  loss_fn: str = ""
  loss_fn_config: dict[str, float | str] = dataclasses.field(default_factory=dict)
  forward_only: bool = False


def _datum(buf: bytes) -> Datum:
  chunks, inputs = [], {}
  for number, _, value in fields(buf):
    if number == 1:  # Chunk: only encoded text is a model input this server reads.
      for kind_number, _, chunk in fields(value):
        if kind_number != 1:
          raise UserError("model_input: only encoded_text chunks are supported "
                          "(no image or audio input)")
        for n, _, tokens in fields(chunk):
          if n == 1:
            chunks.append(np.frombuffer(tokens, "<i4"))
    elif number == 2:
      name, value, _ = _map_entry(value)
      inputs[name] = tensor(value, name)
  tokens = np.concatenate(chunks) if chunks else np.zeros((0,), np.int32)
  return Datum(tokens.astype(np.int32), inputs)


def forward_backward_request(buf: bytes) -> ForwardBackwardRequest:
  """Parses a ForwardBackwardRequest body."""
  req, config, config_v2 = ForwardBackwardRequest(), {}, {}
  for number, kind, value in fields(buf):
    if number == 1:
      req.model_id = value.decode()
    elif number == 2:
      req.seq_id = _signed(value)
    elif number == 3:
      req.data.append(_datum(value))
    elif number == 4:
      req.loss_fn = value.decode()
    elif number == 5:
      key, bits, _ = _map_entry(value)
      config[key] = _double(bits) if isinstance(bits, int) else 0.0
    elif number == 6:
      req.forward_only = bool(value)
    elif number == 7:
      key, entry, _ = _map_entry(value)
      for n, _, v in fields(entry):  # LossConfigValue: number (1) or text (2)
        config_v2[key] = _double(v) if n == 1 else v.decode()
  req.loss_fn_config = {**config, **config_v2}
  return req


# ------------------------------------------------------------------ encoding


def _put_varint(out: bytearray, value: int) -> None:
  value &= (1 << 64) - 1
  while True:
    b = value & 0x7F
    value >>= 7
    out.append(b | (0x80 if value else 0))
    if not value:
      return


def _key(out: bytearray, number: int, kind: int) -> None:
  _put_varint(out, number << 3 | kind)


def _bytes(out: bytearray, number: int, data: bytes) -> None:
  _key(out, number, _LEN)
  _put_varint(out, len(data))
  out += data


def _int(out: bytearray, number: int, value: int) -> None:
  _key(out, number, _VARINT)
  _put_varint(out, value)


def _packed(values) -> bytes:
  out = bytearray()
  for v in values:
    _put_varint(out, int(v))
  return bytes(out)


def _batched_tensor(arrays: list[np.ndarray], dtype: int) -> bytes:
  """BatchedTensor: the datums' arrays back to back, with int64 byte offsets."""
  dt = DTYPES[dtype]
  parts = [np.ascontiguousarray(a, dt).tobytes() for a in arrays]
  offsets = np.cumsum([0] + [len(p) for p in parts]).astype("<i8")
  out = bytearray()
  _bytes(out, 1, b"".join(parts))
  _bytes(out, 2, offsets.tobytes())
  _int(out, 3, dtype)
  trailing = arrays[0].shape[1:] if arrays else ()
  if trailing:
    _bytes(out, 4, _packed(trailing))
  return bytes(out)


def forward_backward_output(per_datum: dict[str, list[np.ndarray]],
                            metrics: dict[str, float]) -> bytes:
  """ForwardBackwardOutput with one ArrayRecord holding each named per-datum output
  (float32), and the metrics (`name:reduction` keys)."""
  record = bytearray()
  _bytes(record, 1, b"ArrayRecord")
  num = 0
  for name, arrays in per_datum.items():
    entry = bytearray()
    _bytes(entry, 1, name.encode())
    _bytes(entry, 2, _batched_tensor(arrays, FLOAT32))
    _bytes(record, 2, bytes(entry))
    num = len(arrays)
  _int(record, 3, num)
  out = bytearray()
  _bytes(out, 1, b"ArrayRecord")
  _bytes(out, 2, bytes(record))
  for key, value in metrics.items():
    entry = bytearray()
    _bytes(entry, 1, key.encode())
    _key(entry, 2, _I64)
    entry += struct.pack("<d", float(value))
    _bytes(out, 3, bytes(entry))
  return bytes(out)


@dataclasses.dataclass
class Sequence:
  tokens: list[int]
  logprobs: list[float]
  stop: bool  # ended by a stop token (else by max_tokens)


def sample_response(sequences: list[Sequence], prompt_logprobs: np.ndarray | None) -> bytes:
  """SampleResponse: each sequence's int32 tokens and float32 logprobs, and the prompt's
  logprobs (NaN where there is none) when asked for."""
  out = bytearray()
  for seq in sequences:
    s = bytearray()
    _int(s, 1, STOP if seq.stop else LENGTH)
    _bytes(s, 2, np.asarray(seq.tokens, "<i4").tobytes())
    _bytes(s, 3, np.asarray(seq.logprobs, "<f4").tobytes())
    _bytes(out, 1, bytes(s))
  if prompt_logprobs is not None:
    _bytes(out, 2, np.asarray(prompt_logprobs, "<f4").tobytes())
  return bytes(out)
