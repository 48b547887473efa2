"""FLOPs and memory bytes of a compiled program, loops counted by their trip counts.

XLA's `cost_analysis()` counts a while loop's body once, so a decode loop of 32 steps over
32 scanned layers reports the cost of one layer of one step. This walker reads the
optimized HLO text of a compiled program (`compiled.as_text()`) and sums, per
instruction that the device executes:

* bytes: what a top-level op (a fusion, a copy, a collective, a kernel) reads from and
  writes to HBM (buffers the compiler placed in on-chip memory, TPU VMEM, excluded).
  A fusion operand that the fusion only slices (the per-layer slice of a scanned weight
  stack) counts as the slice it reads, and an in-place dynamic-update-slice as the update
  it writes, as the memory system sees them;
* flops: 2 x output elements x contracted elements of every dot, fused or not;
* collective bytes: the payload of all-gather, all-reduce, reduce-scatter, all-to-all and
  collective-permute;
* a Pallas kernel (custom call) by the cost estimate it carries (Mosaic), by its own
  count from its operands' shapes (the Triton paged and packed attention kernels), else its
  operands and outputs;

and multiplies a while body by its trip count, read from the loop condition's bound
(`i < N` against a constant: fori_loop and scan) or from XLA's known_trip_count. A loop
whose bound is not a constant counts once and is listed in `unknown_loops`.

It also keeps each launched op's own FLOPs and bytes (`ProgramCost.launched`): a device
runs a program's kernels one after another, so a compute-bound matmul and the
memory-bound fusion after it do not overlap, and the program takes at least the sum of
each kernel's own roofline (plan.report), not the larger of its total FLOPs' and bytes'.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Optional

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_LAYOUT = re.compile(r"\{[^{}]*\}")  # the layout right after an array's dims
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s+=\s+(.*)$")
# Ops that move no data of their own (views, tuples, control, scalars from the runtime).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "fusion-done",
         "partition-id", "replica-id", "iota", "copy-done", "slice-done", "all-gather-done",
         "all-reduce-done", "collective-permute-done", "send-done", "recv-done",
         "opt-barrier", "add-dependency", "domain"}
_COLLECTIVES = {"all-gather", "all-gather-start", "all-reduce", "all-reduce-start",
                "reduce-scatter", "all-to-all", "collective-permute",
                "collective-permute-start", "ragged-all-to-all"}
_SLICES = {"dynamic-slice", "slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
# Ops a fusion computes element by element: only for the elements its output needs.
_ELEMENTWISE = {"abs", "add", "and", "clamp", "compare", "convert", "cosine", "divide",
                "exponential", "exponential-minus-one", "log", "log-plus-one", "maximum",
                "minimum", "multiply", "negate", "not", "or", "power", "rsqrt", "select",
                "sine", "sqrt", "subtract", "tanh", "xor"}


@dataclasses.dataclass
class Cost:
  flops: float = 0.0
  bytes: float = 0.0
  collective_bytes: float = 0.0

  def add(self, other: "Cost", times: float = 1.0) -> None:
    self.flops += times * other.flops
    self.bytes += times * other.bytes
    self.collective_bytes += times * other.collective_bytes


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  shape: str  # the result type, e.g. "bf16[4,64]{1,0}" or a tuple "(s32[], ...)"
  opcode: str
  operands: tuple[str, ...]
  args: str  # the operand list as written: "%a, %b", or a parameter's index, a constant
  attrs: str  # everything after the operand list
  root: bool


@dataclasses.dataclass
class ProgramCost:
  """A program's totals, loops counted, plus what could not be counted exactly.

  launched: (FLOPs, bytes, launches per call) of each distinct kind of launched op (ops of
    equal FLOPs and bytes merged); their FLOPs and bytes times launches sum to the totals.
    Empty where the cost was not read from a program.
  """

  flops: float
  bytes: float
  collective_bytes: float
  unknown_loops: list[str]
  launched: tuple[tuple[float, float, float], ...] = ()
  # (collective bytes, starts per call, the (FLOPs, bytes, launches) of the kernels the
  # schedule runs between its start and its done) of each asynchronous collective
  overlapped: tuple[tuple[float, float, tuple[tuple[float, float, float], ...]], ...] = ()

  @property
  def launches(self) -> float:
    """Ops the device launches per call (loops counted by their trip counts)."""
    return sum(n for _, _, n in self.launched)


def shape_bytes(shape: str) -> float:
  """HBM bytes of the arrays in an HLO type (tuples summed). An array whose layout names a
  memory space other than 0 (`S(1)`: a TPU's on-chip VMEM) costs no HBM traffic."""
  return sum((size for size, in_hbm in _tuple_arrays(shape) if in_hbm), 0.0)


def _tuple_arrays(shape: str) -> list[tuple[float, bool]]:
  """(bytes, in HBM) of each array of an HLO type, in order (nested tuples flattened)."""
  arrays = []
  for match in _ARRAY.finditer(shape):
    layout = _LAYOUT.match(shape, match.end())
    dims = match.group(2)
    size = _DTYPE_BYTES[match.group(1)] * math.prod(int(d) for d in dims.split(",") if d)
    arrays.append((size, not (layout and re.search(r"S\([1-9]\d*\)", layout.group(0)))))
  return arrays


def _async_copy_bytes(instr: Instr, operand_shape: str) -> float:
  """HBM bytes of an asynchronous copy's start (XLA:TPU's prefetches into VMEM): its type
  is a tuple that also names its source (an alias, not a write) and a context scalar, and
  its -done moves nothing. copy-start: (destination, source, context); slice-start:
  ((source), destination, context), the destination being the slice read."""
  arrays = _tuple_arrays(instr.shape)
  if instr.opcode == "copy-start":
    dest = arrays[0]
    read = shape_bytes(operand_shape)
  else:
    dest = arrays[1]
    source = _tuple_arrays(operand_shape)
    read = dest[0] if not source or source[0][1] else 0.0
  return read + (dest[0] if dest[1] else 0.0)


def _dims(shape: str) -> list[int]:
  match = _ARRAY.search(shape)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


def _split_type(rest: str) -> tuple[str, str]:
  """("type", "opcode(...)...") of an instruction's right-hand side: the type may be a
  tuple with nested parentheses and layouts with braces."""
  depth, i = 0, 0
  while i < len(rest):
    c = rest[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == " " and depth == 0:
      return rest[:i], rest[i + 1:]
    i += 1
  return rest, ""


def _operands(call: str) -> tuple[str, str, str]:
  """(opcode, operand text, attributes) of "opcode(a, b), attr=..."."""
  open_ = call.index("(")
  depth = 0
  for i in range(open_, len(call)):
    depth += call[i] == "("
    depth -= call[i] == ")"
    if depth == 0:
      return call[:open_], call[open_ + 1:i], call[i + 1:]
  return call[:open_], call[open_ + 1:], ""


# Kept for the last texts: plan reads each program's text three ways (cost, launches, bytes
# by source), and at 8B a parse takes a quarter of a second. Callers only read the result.
@functools.lru_cache(maxsize=2)
def parse(text: str) -> tuple[dict[str, list[Instr]], Optional[str]]:
  """Computations by name, and the entry computation's name."""
  computations: dict[str, list[Instr]] = {}
  entry, current = None, None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      if header.group(1):
        entry = current
      continue
    match = _INSTR.match(line)
    if match is None or current is None:
      continue
    shape, call = _split_type(match.group(3))
    if "(" not in call:
      continue
    opcode, args, attrs = _operands(call)
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    computations[current].append(Instr(match.group(2), shape, opcode, operands, args, attrs,
                                       bool(match.group(1))))
  return computations, entry


class _Walker:
  def __init__(self, computations: dict[str, list[Instr]],
               segment_tokens: Optional[int] = None):
    self.comps = computations
    self.segment_tokens = segment_tokens
    self.shapes = {i.name: i.shape for instrs in computations.values() for i in instrs}
    self.unknown_loops: list[str] = []
    self._memo: dict[str, Cost] = {}

  def computation(self, name: str) -> Cost:
    if name not in self._memo:
      total = Cost()
      for instr in self.comps.get(name, []):
        total.add(self.instruction(instr))
      self._memo[name] = total
    return self._memo[name]

  def instruction(self, instr: Instr) -> Cost:
    op = instr.opcode
    if op == "while":
      body = _attr(instr.attrs, "body")
      cond = _attr(instr.attrs, "condition")
      trips = self.trip_count(instr, cond)
      cost = Cost()
      cost.add(self.computation(body), trips)
      cost.add(self.computation(cond), trips)
      return cost
    if op == "conditional":
      costs = [self.computation(b) for b in _branches(instr)] or [Cost()]
      return max(costs, key=lambda c: c.bytes)
    if op == "call":
      return self.computation(_attr(instr.attrs, "to_apply"))
    if op == "fusion":
      return self.fusion(instr)
    if op == "fusion-start":  # XLA:GPU's async fusion (a layer's weight slice, say)
      return self.async_fusion(instr)
    if op == "custom-call":
      return self.custom_call(instr)
    if op in _FREE:
      return Cost()
    cost = Cost(bytes=self.io_bytes(instr))
    if op in ("dot", "convolution"):
      cost.flops = self.dot_flops(instr)
    if op in _COLLECTIVES:
      cost.collective_bytes = max(shape_bytes(instr.shape),
                                  sum(shape_bytes(self.shapes.get(o, "")) for o in instr.operands))
    return cost

  def io_bytes(self, instr: Instr) -> float:
    if instr.opcode in ("copy-start", "slice-start"):
      return _async_copy_bytes(instr, self.shapes.get(instr.operands[0], ""))
    if instr.opcode in _SLICES:  # Reads only what it returns.
      return 2 * shape_bytes(instr.shape)
    if instr.opcode in _IN_PLACE:  # Reads and writes only the update.
      return 2 * self.update_bytes(instr)
    reads = sum(shape_bytes(self.shapes.get(o, "")) for o in instr.operands)
    return reads + shape_bytes(instr.shape)

  def dot_flops(self, instr: Instr) -> float:
    """2 x output elements x contracted elements. TPU programs write dots as convolutions
    (dim_labels "bf_io->bf"): there the contracted lhs dims are those labelled "f"."""
    lhs = _dims(self.shapes.get(instr.operands[0], ""))
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    labels = re.search(r"dim_labels=([\w]+)_", instr.attrs)
    if contracting:
      dims = [int(d) for d in contracting.group(1).split(",") if d]
    elif labels:
      dims = [i for i, c in enumerate(labels.group(1)) if c == "f"]
    else:
      dims = []
    k = math.prod(lhs[d] for d in dims if d < len(lhs))
    return 2.0 * math.prod(_dims(instr.shape)) * k

  def fusion(self, instr: Instr) -> Cost:
    body = self.comps.get(_attr(instr.attrs, "calls"), [])
    cost = Cost(flops=self.fused_flops(body))
    for index, operand in enumerate(instr.operands):
      cost.bytes += self.param_read(body, index, shape_bytes(self.shapes.get(operand, "")))
    root = next((i for i in body if i.root), None)
    in_place = root is not None and root.opcode in _IN_PLACE
    cost.bytes += self.update_bytes(root) if in_place else shape_bytes(instr.shape)
    return cost

  def async_fusion(self, instr: Instr) -> Cost:
    """A fusion-start: the fusion it calls, its result the tuple's second element."""
    result = _tuple_elements(instr.shape)
    shape = result[1] if len(result) > 1 else instr.shape
    return self.fusion(dataclasses.replace(instr, shape=shape))

  def fused_flops(self, body: list[Instr]) -> float:
    flops = 0.0
    for i in body:
      if i.opcode in ("dot", "convolution"):
        flops += self.dot_flops(i)
      elif i.opcode == "fusion":
        flops += self.fused_flops(self.comps.get(_attr(i.attrs, "calls"), []))
    return flops

  def update_bytes(self, instr: Instr) -> float:
    """What an in-place update writes: a dynamic-update-slice's update, a scatter's."""
    update = instr.operands[1] if instr.opcode == "dynamic-update-slice" else instr.operands[-1]
    return shape_bytes(self.shapes.get(update, ""))

  def param_read(self, body: list[Instr], index: int, full: float) -> float:
    """Bytes a fusion reads of its operand `index`: the slices it takes when it only
    slices it (through views, elementwise ops and nested fusions too), nothing when it is
    only the buffer an in-place update writes into, else all of it."""
    param = next((i for i in body if i.opcode == "parameter" and i.args == str(index)), None)
    if param is None:
      return full
    return self._read_through(body, param, full, in_place_ok=True)

  def _read_through(self, body: list[Instr], value: Instr, full: float,
                    in_place_ok: bool = False) -> float:
    """Bytes of `full` (a fused operand) read through `value` (the operand, or a view or
    elementwise op of it): a fusion computes such ops only for the elements its slices
    take (a row's chosen logits gathered out of an op over the whole row reads those
    elements only), so what each path ends in decides; the fusion's own output is every
    element's."""
    if value.root:
      return full
    per_element = full / max(1, math.prod(_dims(value.shape)))
    read = 0.0
    for user in (i for i in body if value.name in i.operands):
      first = user.operands[0] == value.name
      if user.opcode in _SLICES and first:
        read += per_element * math.prod(_dims(user.shape))
      elif (in_place_ok and user.opcode in _IN_PLACE and first
            and user.operands.count(value.name) == 1):
        continue
      elif user.opcode == "bitcast" or (user.opcode in _ELEMENTWISE
                                        and _dims(user.shape) == _dims(value.shape)):
        read += self._read_through(body, user, full)
      elif user.opcode == "fusion":
        nested = self.comps.get(_attr(user.attrs, "calls"), [])
        read += sum(self.param_read(nested, k, full)
                    for k, o in enumerate(user.operands) if o == value.name)
      else:
        return full
      if read >= full:
        return full
    return read

  def custom_call(self, instr: Instr) -> Cost:
    estimate = re.search(r'"cost_estimate":\s*(\{[^}]*\})', instr.attrs)
    if estimate:  # Mosaic calls carry the kernel's own pl.CostEstimate.
      fields = json.loads(estimate.group(1))
      return Cost(flops=float(fields.get("flops", 0)),
                  bytes=float(fields.get("bytes_accessed", 0)))
    # Triton calls carry none: the kernels' own estimates. The prefill kernel's text names
    # the decode kernel's module too (helpers it shares), so it is matched first.
    packed = re.search(r"/(packed_attention_(fwd|dkv|dq))(?:_window(\d+))?/pallas_call",
                       instr.attrs)
    if packed:
      return self.packed_attention(instr, packed.group(2), packed.group(3))
    if "paged_prefill_attention" in instr.attrs:
      return self.paged_attention(instr, table=5)
    if "paged_attention_append" in instr.attrs:
      return self.paged_append(instr)
    if "paged_attention" in instr.attrs:
      return self.paged_attention(instr, table=3)
    return Cost(bytes=self.io_bytes(instr))

  def paged_attention(self, instr: Instr, table: int) -> Cost:
    """A paged kernel's operands: q first, the pool k, v [Hkv, P, ps, D] next, each row's
    page list [rows, M] at index `table` (decode: kernels.paged_attention._cost; prefill:
    kernels.paged_prefill._cost, an upper bound where a window reads fewer). K and V of
    each row's listed pages once per KV head. Prefill's q is [rows, Hkv, queries per KV
    head, D]; a decode kernel's queries per row and KV head are read off its first result
    ([splits, rows, ..., Hkv, G, D]: cascade's block prefix reads R rows' queries a
    program from the rows' q/k/v array)."""
    q, k, pages = (self.shapes.get(instr.operands[i], "") for i in (0, 1, table))
    hkv, d, rows = _dims(k)[0], _dims(k)[-1], _dims(pages)[0]
    per = _dims(q) if table != 3 else _dims(_tuple_elements(instr.shape)[0])[1:]
    queries = math.prod(per) // (rows * hkv * d)
    keys = _dims(pages)[1] * _dims(k)[2]
    kv = 2 * shape_bytes(k) / math.prod(_dims(k)) * rows * hkv * keys * d
    return Cost(flops=4.0 * rows * hkv * queries * keys * d,
                bytes=kv + shape_bytes(q) + shape_bytes(instr.shape) + shape_bytes(pages))

  def paged_append(self, instr: Instr) -> Cost:
    """kernels.paged_append: qkv [rows, Hq + 2 Hkv, D] first, the pools k, v [Hkv, P, ps,
    D] next (updated in place: only the new tokens' rows are written), each row's page
    list [rows, M] at index 3; its results are the attention and log-sum-exp, then the
    aliased pools, which are not traffic. K and V of each row's pages once per KV head,
    and the prior parts (cascade's prefix, operands 7 on) once."""
    qkv, k, pages = (self.shapes.get(instr.operands[i], "") for i in (0, 1, 3))
    prior = sum(shape_bytes(self.shapes.get(o, "")) for o in instr.operands[7:])
    rows, heads, d = _dims(qkv)
    hkv, keys = _dims(k)[0], _dims(pages)[1] * _dims(k)[2]
    itemsize = shape_bytes(k) / math.prod(_dims(k))
    results = sum(shape_bytes(s) for s in _tuple_elements(instr.shape)[:2])
    kv = 2 * itemsize * rows * hkv * (keys + 1) * d  # read, and the new token written
    return Cost(flops=4.0 * rows * (heads - 2 * hkv) * keys * d,
                bytes=kv + shape_bytes(qkv) + results + shape_bytes(pages) + prior)

  def packed_attention(self, instr: Instr, kind: str, window: Optional[str]) -> Cost:
    """kernels.packed_attention's Triton calls, q [B, T, Hq, D] first: 4 FLOPs per query,
    key and head dim in the forward (scores, then values), 8 for dK/dV (the scores again,
    dV, dP, dK) and 6 for dQ. The kernels skip key blocks outside a query's segment, so
    the keys a query sees are those of a segment of `segment_tokens` (the longest
    sequence the program packs; the whole row if not given) up to it, or its window."""
    b, t, hq, d = _dims(self.shapes.get(instr.operands[0], ""))
    length = min(t, self.segment_tokens or t)
    keys = (length + 1) / 2  # on average over a segment's queries
    if window is not None and int(window) < length:
      w = int(window)
      keys = w - w * (w - 1) / (2 * length)
    per_key = {"fwd": 4, "dkv": 8, "dq": 6}[kind]
    return Cost(flops=per_key * b * t * keys * hq * d, bytes=self.io_bytes(instr))

  def trip_count(self, instr: Instr, cond: str) -> float:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
    if known:
      return float(known.group(1))
    instrs = self._with_fused(cond)
    consts = {i.name: i for i in instrs if i.opcode == "constant"}
    for i in instrs:
      if i.opcode != "compare":
        continue
      direction = re.search(r"direction=(\w+)", i.attrs)
      bound = [consts[o].args for o in i.operands if o in consts]
      if bound and re.fullmatch(r"-?\d+", bound[0]) and direction and (
          direction.group(1) in ("LT", "LE", "GT", "GE")):
        n = int(bound[0])
        return float(n + 1 if direction.group(1) in ("LE", "GE") else n)
    self.unknown_loops.append(instr.name)
    return 1.0

  def _with_fused(self, name: str) -> list[Instr]:
    """A computation's instructions and those of the fusions it calls (a loop condition
    like `i < n & any(active)` is one fusion on some backends)."""
    instrs = list(self.comps.get(name, []))
    for i in list(instrs):
      if i.opcode == "fusion":
        instrs.extend(self._with_fused(_attr(i.attrs, "calls")))
    return instrs


def _tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple type "(a, (b, c), d)" (a non-tuple: itself)."""
  if not shape.startswith("("):
    return [shape]
  parts, depth, start = [], 0, 1
  for i, c in enumerate(shape):
    depth += c in "([{"
    depth -= c in ")]}"
    if c == "," and depth == 1:
      parts.append(shape[start:i].strip())
      start = i + 1
  parts.append(shape[start:shape.rindex(")")].strip())
  return [p for p in parts if p]


def _attr(attrs: str, key: str) -> str:
  match = re.search(rf"\b{key}=%?([\w.\-]+)", attrs)
  return match.group(1) if match else ""


def _branches(instr: Instr) -> list[str]:
  """A conditional's branch computations: an indexed one lists them, a predicated one
  (lax.cond on a bool) names its true and false computations."""
  named = [_attr(instr.attrs, f"{side}_computation") for side in ("true", "false")]
  return re.findall(r"%([\w.\-]+)", _attr_list(instr.attrs, "branch_computations")) + [
      b for b in named if b]


def _attr_list(attrs: str, key: str) -> str:
  match = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
  return match.group(1) if match else ""


def program_cost(hlo_text: str, segment_tokens: Optional[int] = None) -> ProgramCost:
  """The whole program's cost per device (an SPMD program's HLO is one device's);
  `segment_tokens`: the longest sequence its packed rows hold (_Walker.packed_attention)."""
  computations, entry = parse(hlo_text)
  walker = _Walker(computations, segment_tokens)
  total = walker.computation(entry) if entry else Cost()
  leaves, overlapped = _walk_leaves(computations, entry, walker)
  return ProgramCost(total.flops, total.bytes, total.collective_bytes,
                     list(dict.fromkeys(walker.unknown_loops)),
                     tuple(sorted(_by_cost((cost, n) for _, n, cost in leaves))),
                     tuple((b, n, _by_cost(cover)) for b, n, cover in overlapped))


def leaf_costs(hlo_text: str) -> list[tuple[Instr, float, Cost]]:
  """(instruction, times per program call, cost of one) for every instruction the device
  executes (fusions, kernels, copies, collectives), control flow walked as program_cost
  walks it: a while body at its trip count, a conditional's costliest branch. Their costs
  times `times` sum to program_cost's."""
  computations, entry = parse(hlo_text)
  return _walk_leaves(computations, entry, _Walker(computations))[0]


def _walk_leaves(computations, entry: Optional[str], walker: "_Walker") -> tuple[list, list]:
  """(leaf_costs' list, ProgramCost.overlapped's records with their covers as (cost,
  launches per start) pairs). An asynchronous collective (an all-gather-start, say) covers
  the kernels the scheduled program runs between it and its done, which its transfer can
  hide behind; a start whose done is in another computation covers nothing."""
  overlapped = []

  def walk(name: str, times: float) -> list:  # -> the leaves it ran, in order
    ran, pending = [], {}
    for instr in computations.get(name, []):
      op, inner = instr.opcode, []
      if op == "while":
        trips = walker.trip_count(instr, _attr(instr.attrs, "condition"))
        inner = (walk(_attr(instr.attrs, "body"), times * trips) +
                 walk(_attr(instr.attrs, "condition"), times * trips))
      elif op == "conditional":
        branches = _branches(instr)
        if branches:
          inner = walk(max(branches, key=lambda b: walker.computation(b).bytes), times)
      elif op == "call":
        inner = walk(_attr(instr.attrs, "to_apply"), times)
      elif op.endswith("-done") and instr.operands and instr.operands[0] in pending:
        overlapped.append(pending.pop(instr.operands[0]))
      elif op not in _FREE:
        inner = [(instr, times, walker.instruction(instr))]
        if op in _COLLECTIVES and op.endswith("-start"):
          ran.extend(inner)
          pending[instr.name] = (inner[0][2].collective_bytes, times, [])
          continue
      for _, starts, cover in pending.values():
        cover.extend((cost, n / starts) for leaf, n, cost in inner
                     if leaf.opcode not in _COLLECTIVES)
      ran.extend(inner)
    overlapped.extend(pending.values())
    return ran

  return (walk(entry, 1.0) if entry else []), overlapped


def _by_cost(pairs) -> tuple[tuple[float, float, float], ...]:
  """(Cost, launches) pairs merged by equal FLOPs and bytes: ((FLOPs, bytes, launches))."""
  merged: dict[tuple[float, float], float] = {}
  for cost, n in pairs:
    key = (cost.flops, cost.bytes)
    merged[key] = merged.get(key, 0.0) + n
  return tuple((f, b, n) for (f, b), n in merged.items())


_KERNEL_CALLS = {"tpu_custom_call": "mosaic", "__gpu$xla.gpu.triton": "triton"}


def kernels_in(hlo_text: str) -> tuple[str, ...]:
  """The Pallas kernels a compiled program calls, as "name lowering" ("paged_attention
  mosaic", "splash_mha_fwd mosaic"): the op_name component before the kernel's
  pallas_call, else the instruction's own name (which XLA takes from the kernel)."""
  found = set()
  for line in hlo_text.splitlines():
    target = re.search(r'custom_call_target="([^"]+)"', line)
    if not target or target.group(1) not in _KERNEL_CALLS:
      continue
    op_name = re.search(r'op_name="([^"]+)"', line)
    parts = op_name.group(1).split("/") if op_name else []
    if "pallas_call" in parts[1:]:
      name = parts[parts.index("pallas_call") - 1]
    else:
      name = re.match(r"\s*(?:ROOT\s+)?%([\w\-]+?)(?:\.\d+)*\s", line).group(1)
      name = re.sub(r"_(segmented|no_residuals|residuals)", "", name)
    name = re.sub(r"_(mosaic|triton)$", "", name)
    found.add(f"{name} {_KERNEL_CALLS[target.group(1)]}")
  return tuple(sorted(found))


# Ops that launch nothing on the device (views, tuples, scalars the runtime supplies, the
# ends of async pairs) or that hand over to another computation counted on its own.
_NO_LAUNCH = _FREE | {"while", "conditional", "call"}


def _launch_kind(instr: Instr, comps: dict[str, list[Instr]]) -> str:
  """What a top-level op launches: matmul, attention (a Pallas kernel), update (an
  in-place scatter: the KV write), slice_copy (a dynamically indexed slice copied into a
  buffer of its own: a scanned layer's weights on XLA:GPU), copy, collective or fusion."""
  if instr.opcode == "custom-call":
    if "triton" in instr.attrs or "tpu_custom_call" in instr.attrs:
      return "attention" if "attention" in instr.attrs else "kernel"
    return "matmul" if ("cublas" in instr.attrs or "matmul" in instr.attrs) else "custom_call"
  if instr.opcode in _COLLECTIVES:
    return "collective"
  if instr.opcode in ("copy", "copy-start", "slice-start"):
    return "copy"
  if instr.opcode == "dynamic-slice":
    return "slice_copy"
  if instr.opcode in ("fusion", "fusion-start"):
    called = _attr(instr.attrs, "calls")
    body = comps.get(called, [])
    if "gemm" in called or "dynamic-slice-fusion" in called or any(
        i.opcode in ("dot", "convolution") for i in body):
      return "matmul"
    root = next((i for i in body if i.root), None)
    if root is not None and root.opcode in _IN_PLACE:
      return "update"
    if root is not None and root.opcode == "dynamic-slice":
      return "slice_copy"
    return "fusion"
  return instr.opcode


def _add_counts(into: dict[str, float], more: dict[str, float]) -> None:
  for kind, n in more.items():
    into[kind] = into.get(kind, 0) + n


def _known_trips(loop: Instr) -> bool:
  return '"known_trip_count"' in loop.attrs


def loop_launches(hlo_text: str) -> Optional[dict]:
  """Device launches per iteration of the entry computation's main while loop (the decode
  loop: per decode step), by kind, nested loops counted by their trip counts; None when
  the program has no loop. Each launch costs a few microseconds of scheduling whatever
  it computes, which is what a decode step at small batch is made of.

  Also `flag_reads`: control-flow flags read per iteration -- each conditional, and the
  exit test of each loop XLA does not know the trip count of. A GPU copies each to the
  host and waits for the device to drain before it launches further: a stall per read.
  """
  computations, entry = parse(hlo_text)
  loops = [i for i in computations.get(entry, []) if i.opcode == "while"]
  if not loops:
    return None
  size = lambda loop: len(computations.get(_attr(loop.attrs, "body"), []))
  loop = max(loops, key=size)
  count = functools.partial(_launch_counts, computations, _Walker(computations))
  counts = count(_attr(loop.attrs, "body"), 1.0)
  _add_counts(counts, count(_attr(loop.attrs, "condition"), 1.0))
  reads = counts.pop("flag_reads", 0.0) + (0.0 if _known_trips(loop) else 1.0)
  return {"total": sum(counts.values()), "by_kind": dict(sorted(counts.items())),
          "flag_reads": reads}


def program_launches(hlo_text: str) -> dict:
  """Device launches of one run of the whole program, by kind, loops counted by their trip
  counts (and its flag reads), as loop_launches counts one iteration of its loop."""
  computations, entry = parse(hlo_text)
  counts = _launch_counts(computations, _Walker(computations), entry, 1.0)
  reads = counts.pop("flag_reads", 0.0)
  return {"total": sum(counts.values()), "by_kind": dict(sorted(counts.items())),
          "flag_reads": reads}


def _launch_counts(computations, walker, name: str, times: float) -> dict[str, float]:
  """Launches by kind of `times` runs of computation `name`, and its flag reads."""
  counts: dict[str, float] = {}
  add = functools.partial(_add_counts, counts)
  count = functools.partial(_launch_counts, computations, walker)
  for instr in computations.get(name, []):
    if instr.opcode == "while":
      trips = walker.trip_count(instr, _attr(instr.attrs, "condition"))
      add({"flag_reads": 0.0 if _known_trips(instr) else times * (trips + 1)})
      add(count(_attr(instr.attrs, "body"), times * trips))
      add(count(_attr(instr.attrs, "condition"), times * trips))
    elif instr.opcode == "conditional":  # The branch that launches most.
      add({"conditional": times, "flag_reads": times})
      taken = [count(b, times) for b in _branches(instr)]
      add(max(taken, key=lambda c: sum(n for k, n in c.items() if k != "flag_reads"),
              default={}))
    elif instr.opcode == "call":
      add(count(_attr(instr.attrs, "to_apply"), times))
    elif instr.opcode not in _NO_LAUNCH:
      add({_launch_kind(instr, computations): times})
  return counts
