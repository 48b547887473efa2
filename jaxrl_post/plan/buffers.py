"""The largest buffers of a compiled program: what its peak memory is made of.

Two sources, by backend. XLA's CPU and GPU clients put the buffer assignment in a compiled
executable's memory stats, as a serialized `BufferAssignmentProto` (xla/service/hlo.proto);
its few fields read here are decoded from the protobuf wire format directly, since jaxlib
ships no Python bindings for XLA's protos, and the values' shapes come from the optimized
module's proto. That needs no dump, which on the CPU also writes an object file per kernel
from XLA's parallel codegen threads: slow, and it has crashed the compiling process.
libtpu reports no assignment, but a dumped TPU module comes with a memory-usage report
(text files only), which `reported_allocations` reads.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re


@dataclasses.dataclass(frozen=True)
class Allocation:
  """One buffer of XLA's assignment: its size and the values that share it over time.

  Attributes:
    bytes: the allocation's size.
    values: the shapes of the values placed in it, e.g. "bf16[8], 5xf32[32,4096,1792]".
  """

  bytes: int
  values: str


# Field numbers of the messages read (xla/service/hlo.proto).
_LOGICAL_BUFFERS, _ALLOCATIONS = 1, 3                  # BufferAssignmentProto
_LB_ID, _LB_DEFINED_AT, _LB_COLOR = 1, 3, 4              # LogicalBufferProto
_LOC_SHAPE_INDEX, _LOC_ID = 3, 4                         # LogicalBufferProto.Location
_AL_SIZE, _AL_THREAD_LOCAL, _AL_COLOR, _AL_ASSIGNED = 2, 3, 8, 9  # BufferAllocationProto
_AS_BUFFER_ID, _AS_OFFSET, _AS_SIZE = 1, 2, 3            # BufferAllocationProto.Assigned


def _varint(data: bytes, i: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    byte = data[i]
    i += 1
    value |= (byte & 0x7F) << shift
    shift += 7
    if byte < 0x80:
      return value, i


def _message(data: bytes) -> dict[int, list]:
  """A protobuf message as {field number: [values]}: varints as ints, the length-delimited
  (nested messages, strings, packed repeats) as bytes. Fixed-width fields are skipped."""
  fields: dict[int, list] = collections.defaultdict(list)
  i = 0
  while i < len(data):
    key, i = _varint(data, i)
    number, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(data, i)
    elif wire == 2:
      size, i = _varint(data, i)
      value, i = data[i:i + size], i + size
    elif wire in (1, 5):
      i += 8 if wire == 1 else 4
      continue
    else:
      raise ValueError(f"buffer assignment: unsupported protobuf wire type {wire}")
    fields[number].append(value)
  return fields


def _ints(values: list) -> list[int]:
  """A repeated int64 field, packed (one bytes value) or not."""
  out = []
  for value in values:
    if isinstance(value, int):
      out.append(value)
      continue
    i = 0
    while i < len(value):
      v, i = _varint(value, i)
      out.append(v)
  return out


# PrimitiveType of xla_data.proto, as HLO text spells it.
_DTYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32",
           9: "u64", 10: "f16", 11: "f32", 12: "f64", 15: "c64", 16: "bf16", 18: "c128",
           19: "f8e5m2", 20: "f8e4m3fn", 21: "s4", 22: "u4", 28: "f8e4m3"}
_COMPUTATIONS, _INSTRUCTIONS = 3, 2                    # HloModuleProto, HloComputationProto
_IN_SHAPE, _IN_ID = 3, 35                              # HloInstructionProto
_SH_TYPE, _SH_DIMS, _SH_TUPLE = 2, 3, 4                # ShapeProto


def _instruction_shapes(module_proto: bytes) -> dict[int, bytes]:
  """Instruction id (64-bit, as the buffer assignment names it) -> its ShapeProto."""
  shapes = {}
  for computation in _message(module_proto).get(_COMPUTATIONS, []):
    for raw in _message(computation).get(_INSTRUCTIONS, []):
      instruction = _message(raw)
      if _IN_ID in instruction and _IN_SHAPE in instruction:
        shapes[instruction[_IN_ID][0]] = instruction[_IN_SHAPE][0]
  return shapes


def _shape_text(shape: bytes, index: list[int]) -> str:
  """The array at `index` of a (tuple) ShapeProto, spelled like HLO: "f32[2,64,192]"."""
  fields = _message(shape)
  for i in index:
    tuple_shapes = fields.get(_SH_TUPLE, [])
    if i >= len(tuple_shapes):
      return "?"
    fields = _message(tuple_shapes[i])
  dtype = fields.get(_SH_TYPE, [0])[0]
  dims = ",".join(str(d) for d in _ints(fields.get(_SH_DIMS, [])))
  return f"{_DTYPES.get(dtype, f'type{dtype}')}[{dims}]"


def _value_shapes(assignment: dict, module_proto: bytes) -> dict[int, str]:
  """Logical buffer id -> the shape of the value it holds."""
  instruction_shapes = _instruction_shapes(module_proto)
  out = {}
  for raw in assignment.get(_LOGICAL_BUFFERS, []):
    buffer = _message(raw)
    location = _message(buffer[_LB_DEFINED_AT][0]) if _LB_DEFINED_AT in buffer else {}
    shape = instruction_shapes.get(location.get(_LOC_ID, [None])[0])
    out[buffer.get(_LB_ID, [0])[0]] = (
        "?" if shape is None else _shape_text(shape, _ints(location.get(_LOC_SHAPE_INDEX, []))))
  return out


def largest_allocations(compiled, top: int) -> tuple[Allocation, ...]:
  """The `top` largest buffers of the default memory space, each with the shapes of the
  values that occupy it over the program; () where the backend reports no assignment.

  A buffer is one offset of an allocation: XLA packs a program's temporaries into one
  large allocation, at offsets its heap simulation chose, and values that are not live at
  the same time share an offset."""
  stats = compiled.memory_analysis()
  proto = getattr(stats, "serialized_buffer_assignment_proto", b"") if stats else b""
  if top <= 0 or not proto:
    return ()
  assignment = _message(proto)
  modules = compiled.runtime_executable().hlo_modules()
  shapes = _value_shapes(assignment, modules[0].as_serialized_hlo_module_proto())
  chunks: dict[tuple[int, int], list] = {}
  for number, raw in enumerate(assignment.get(_ALLOCATIONS, [])):
    alloc = _message(raw)
    if alloc.get(_AL_COLOR, [0])[0] != 0 or alloc.get(_AL_THREAD_LOCAL, [0])[0]:
      continue
    for assigned in map(_message, alloc.get(_AL_ASSIGNED, [])):
      chunk = chunks.setdefault((number, assigned.get(_AS_OFFSET, [0])[0]), [0, []])
      chunk[0] = max(chunk[0], assigned.get(_AS_SIZE, [0])[0])
      chunk[1].append(shapes.get(assigned.get(_AS_BUFFER_ID, [0])[0], "?"))
  rows = [Allocation(size, _grouped(values)) for size, values in chunks.values()]
  return tuple(sorted(rows, key=lambda a: -a.bytes)[:top])


def _grouped(shapes: list[str]) -> str:
  """"f32[8], 2xbf16[4,4]": each distinct shape once, with its count."""
  counts = collections.Counter(shapes)
  return ", ".join(shape if n == 1 else f"{n}x{shape}"
                   for shape, n in sorted(counts.items(), key=lambda kv: (kv[1], kv[0])))


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_REPORT_ROW = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*\d+;\s*(.*)$")


def reported_allocations(dump_dir: str, top: int) -> tuple[Allocation, ...]:
  """The `top` largest buffers of the default memory space, from the memory-usage report
  XLA writes beside a dumped module (its first table; later ones are sub-buffers)."""
  reports = sorted(glob.glob(os.path.join(dump_dir, "*memory-usage-report.txt")))
  if not reports:
    return ()
  rows = []
  with open(reports[0]) as f:
    for line in f:
      if rows and not line.strip():
        break
      match = _REPORT_ROW.match(line)
      if match:
        size, unit, values = match.groups()
        rows.append(Allocation(int(float(size) * _UNITS.get(unit, 1)),
                               values.strip().replace("\u00d7", "x")))
  return tuple(sorted(rows, key=lambda a: -a.bytes)[:top])
