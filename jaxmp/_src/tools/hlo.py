"""Reading XLA's optimized HLO text: computations, instructions, array types, bytes.

The text that ``jax.jit(f).trace(*args).lower().compile().as_text()`` returns is the
module *after* the backend's passes: fusion, layout assignment, GEMM rewriting. Each
instruction of the entry computation that is not a parameter, constant, tuple,
get-tuple-element or bitcast runs as (at least) one kernel; a fusion's body is a
separate computation named by ``calls=``. This module parses that text into plain
Python objects and answers the questions :mod:`jaxmp.tools.audit` asks of it; it
does not interpret kernels (that is the audit's job).

Types are written ``f32[4096,4096]{1,0}``, ``(bf16[8]{0}, s8[4]{0})`` for tuples, and
on TPUs with tiled layouts ``bf16[8,128]{1,0:T(8,128)(2,1)}``.

Example:
  >>> from jaxmp._src.tools import hlo
  >>> text = '''HloModule m
  ...
  ... ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  ...   %a = f32[4,8]{1,0} parameter(0)
  ...   %b = f32[8,2]{1,0} parameter(1)
  ...   ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ... }
  ... '''
  >>> module = hlo.Module(text)
  >>> [i.opcode for i in module.entry_instructions()]
  ['parameter', 'parameter', 'dot']
  >>> hlo.arrays(module.instruction("d").type)
  [('f32', (4, 2))]
  >>> hlo.dot_flops(module, module.instruction("d"))
  128
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of the HLO primitive types (pred is stored as a byte).
_DTYPE_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3": 1, "f8e3m4": 1, "f8e4m3b11fnuz": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1, "token": 0,
}

# HLO type names as numpy/JAX spell them.
DTYPE_NAMES = {
    "pred": "bool", "s8": "int8", "u8": "uint8", "s16": "int16", "u16": "uint16",
    "s32": "int32", "u32": "uint32", "s64": "int64", "u64": "uint64", "f16": "float16",
    "bf16": "bfloat16", "f32": "float32", "f64": "float64", "c64": "complex64",
    "c128": "complex128", "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
    "f8e4m3fnuz": "float8_e4m3fnuz", "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3": "float8_e4m3",
    "f8e3m4": "float8_e3m4", "f8e8m0fnu": "float8_e8m0fnu", "f4e2m1fn": "float4_e2m1fn",
    "s4": "int4", "u4": "uint4",
}

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|called_computations|"
    r"true_computation|false_computation)="
    r"(\{[^}]*\}|%[\w.\-]+)")

# Instructions that launch no kernel of their own.
NO_KERNEL_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "bitcast", "tuple", "opt-barrier",
    "after-all", "partition-id", "replica-id", "iota", "add-dependency",
})


def arrays(type_str: str) -> list[tuple[str, tuple[int, ...]]]:
  """``[(hlo dtype, dims)]`` of every array in a (possibly tuple) HLO type string."""
  # Layout annotations such as {1,0:T(8,128)(2,1)} hold no dtype[...] patterns.
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _ARRAY.findall(type_str) if dt in _DTYPE_BYTES]


def nbytes(type_str: str) -> int:
  """Bytes of every array in an HLO type string."""
  return sum(math.prod(dims) * _DTYPE_BYTES[dt] for dt, dims in arrays(type_str))


def dtype_bytes(hlo_dtype: str) -> int:
  """Bytes per element of an HLO primitive type."""
  return _DTYPE_BYTES[hlo_dtype]


def _matching_paren(s: str, start: int) -> int:
  depth = 0
  for j in range(start, len(s)):
    if s[j] == "(":
      depth += 1
    elif s[j] == ")":
      depth -= 1
      if depth == 0:
        return j
  return len(s)


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``name = type opcode(operands), attributes``."""

  name: str
  type: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  computation: str
  # What stands between the opcode's parentheses: operand names, or a
  # parameter's index and a constant's literal.
  raw_operands: str = ""

  @classmethod
  def parse(cls, line: str, computation: str) -> Instruction | None:
    body = line.strip()
    if body.startswith("ROOT "):
      body = body[5:]
    name, sep, rest = body.partition(" = ")
    if not sep:
      return None
    if rest.startswith("("):
      end = _matching_paren(rest, 0)
      type_str, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
      type_str, _, rest = rest.partition(" ")
    match = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
    if not match:
      return None
    open_paren = match.end() - 1
    close_paren = _matching_paren(rest, open_paren)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[open_paren + 1:close_paren]))
    return cls(name.lstrip("%"), type_str, match.group(1), operands,
               rest[close_paren + 1:], computation, rest[open_paren + 1:close_paren])

  def attribute(self, pattern: str) -> str | None:
    """The first group of ``pattern`` searched in the attributes, or None."""
    match = re.search(pattern, self.attributes)
    return match.group(1) if match else None

  @property
  def called(self) -> tuple[str, ...]:
    """Names of the computations this instruction calls (fusion body, loop body...)."""
    names = []
    for group in _CALLED.findall(self.attributes):
      names += re.findall(r"%?([\w.\-]+)", group.strip("{}"))
    return tuple(names)

  @property
  def custom_call_target(self) -> str | None:
    return self.attribute(r'custom_call_target="([^"]+)"')

  @property
  def fusion_kind(self) -> str | None:
    """``kLoop``, ``kInput``, ``kOutput`` or ``kCustom`` for a fusion."""
    return self.attribute(r"\bkind=(k\w+)")

  @property
  def backend_kind(self) -> str | None:
    """The backend's name for a custom fusion, e.g. ``__triton_gemm``."""
    return self.attribute(r'"(?:fusion_backend_config|fusion_config)":\{"kind":"([^"]+)"')

  @property
  def first_array(self) -> tuple[str, tuple[int, ...]]:
    """The (dtype, dims) of the result, or of its first element for a tuple."""
    found = arrays(self.type)
    return found[0] if found else ("token", ())


class Module:
  """An optimized HLO module: computations by name, instructions by name."""

  def __init__(self, text: str):
    self.text = text
    self.computations: dict[str, list[Instruction]] = {}
    entry = None
    current = None
    for line in text.splitlines():
      if current is None:
        match = _COMPUTATION.match(line)
        if match and not line.startswith("HloModule"):
          current = match.group(2)
          self.computations[current] = []
          if match.group(1):
            entry = current
        continue
      if line.startswith("}"):
        current = None
        continue
      instruction = Instruction.parse(line, current)
      if instruction is not None:
        self.computations[current].append(instruction)
    if entry is None:
      raise ValueError("Not an HLO module: no ENTRY computation found in the text.")
    self.entry: str = entry
    self._by_name = {i.name: i for body in self.computations.values() for i in body}

  def instruction(self, name: str) -> Instruction:
    return self._by_name[name]

  def entry_instructions(self) -> list[Instruction]:
    return self.computations[self.entry]

  def body(self, computation: str) -> list[Instruction]:
    """Every instruction of ``computation`` and of the computations it calls."""
    seen, todo, out = set(), [computation], []
    while todo:
      name = todo.pop()
      if name in seen or name not in self.computations:
        continue
      seen.add(name)
      for instruction in self.computations[name]:
        out.append(instruction)
        todo.extend(instruction.called)
    return out

  def root(self, computation: str) -> Instruction:
    """The instruction a computation returns (printed last)."""
    return self.computations[computation][-1]

  def parameter_source(self, parameter: Instruction, caller: Instruction) -> Instruction:
    """What a called computation's ``parameter(i)`` is bound to at ``caller``."""
    return self.instruction(caller.operands[int(parameter.raw_operands)])


def dot_flops(module: Module, dot: Instruction) -> int:
  """``2 * output elements * contracted size`` of a ``dot`` instruction."""
  out = math.prod(dot.first_array[1])
  lhs = arrays(module.instruction(dot.operands[0]).type)[0][1]
  dims = dot.attribute(r"lhs_contracting_dims=\{([0-9,]*)\}") or ""
  contracted = math.prod(lhs[int(d)] for d in dims.split(",") if d)
  return 2 * out * contracted


def convolution_flops(module: Module, conv: Instruction) -> int:
  """``2 * output elements * (kernel elements / output features)`` of a convolution.

  The kernel's ``o`` dimension (from ``dim_labels=..._<kernel>->...``) is the output
  feature count, so the quotient is the window size times the input features each
  output sums over (already divided by the feature groups in the kernel's shape).
  """
  out = math.prod(conv.first_array[1])
  kernel = arrays(module.instruction(conv.operands[1]).type)[0][1]
  labels = conv.attribute(r"dim_labels=[^_]+_([^-]+)->") or ""
  o = labels.find("o")
  per_output = math.prod(kernel) // kernel[o] if 0 <= o < len(kernel) else math.prod(kernel)
  return 2 * out * per_output


def _through_bitcasts(module: Module, name: str) -> Instruction:
  instruction = module.instruction(name)
  while instruction.opcode == "bitcast":
    instruction = module.instruction(instruction.operands[0])
  return instruction


def _users(body: list[Instruction]) -> dict[str, list[Instruction]]:
  users: dict[str, list[Instruction]] = {}
  for instruction in body:
    for operand in instruction.operands:
      users.setdefault(operand, []).append(instruction)
  return users


def _only_updated(name: str, users: dict[str, list[Instruction]]) -> bool:
  """Whether ``name`` is only the buffer of ``dynamic-update-slice``s (through bitcasts)."""
  return all(r.opcode == "dynamic-update-slice" and r.operands[0] == name
             or r.opcode == "bitcast" and _only_updated(r.name, users)
             for r in users.get(name, []))


def kernel_bytes(module: Module, kernel: Instruction) -> int:
  """The HBM bytes one execution of a non-GEMM kernel moves: what it reads and writes.

  Every operand is read once and every result written once, except in the two forms a
  loop over stacked layers is made of, where a fusion touches part of a buffer:

  * an operand the fusion only slices (``dynamic-slice``/``slice`` of the parameter,
    as a scanned layer reads its weights from the stack): the slices are read;
  * a result that is a ``dynamic-update-slice`` of a parameter (as a scan writes one
    layer's gradient or residual into the stack): XLA updates that buffer in place,
    so only the update is written and the rest of the buffer is neither read nor
    written.

  Counting the whole buffers instead charges each trip of a loop over ``L`` layers
  for all ``L`` layers' slices.

  Args:
    module: the module ``kernel`` belongs to.
    kernel: a fusion, copy, reduction or other instruction that runs as a kernel.

  Returns:
    Bytes read plus bytes written.

  Example:
    >>> text = '''HloModule m
    ...
    ... %layer (p: f32[4,8], i: s32[]) -> f32[1,8] {
    ...   %p = f32[4,8]{1,0} parameter(0)
    ...   %i = s32[] parameter(1)
    ...   %z = s32[] constant(0)
    ...   %s = f32[1,8]{1,0} dynamic-slice(%p, %i, %z), dynamic_slice_sizes={1,8}
    ...   ROOT %n = f32[1,8]{1,0} negate(%s)
    ... }
    ...
    ... ENTRY %main (w: f32[4,8], j: s32[]) -> f32[1,8] {
    ...   %w = f32[4,8]{1,0} parameter(0)
    ...   %j = s32[] parameter(1)
    ...   ROOT %f = f32[1,8]{1,0} fusion(%w, %j), kind=kLoop, calls=%layer
    ... }
    ... '''
    >>> module = Module(text)
    >>> kernel_bytes(module, module.instruction("f"))  # one row read, one written, the index
    68
  """
  if kernel.opcode != "fusion" or not kernel.called:
    return sum(nbytes(module.instruction(o).type) for o in kernel.operands) + nbytes(kernel.type)
  computation = kernel.called[0]
  body = module.computations[computation]
  users = _users(body)
  root = module.root(computation)
  results = ([module.instruction(o) for o in root.operands] if root.opcode == "tuple"
             else [root])
  written, updated_in_place = 0, set()
  for result in results:
    buffer = (_through_bitcasts(module, result.operands[0])
              if result.opcode == "dynamic-update-slice" else None)
    if buffer is not None and buffer.opcode == "parameter":
      updated_in_place.add(buffer.name)
      written += nbytes(module.instruction(result.operands[1]).type)
    else:
      written += nbytes(result.type)
  read = 0
  for parameter in (i for i in body if i.opcode == "parameter"):
    readers = users.get(parameter.name, [])
    if parameter.name in updated_in_place and _only_updated(parameter.name, users):
      continue  # the buffer updated in place: untouched outside the update
    if readers and all(r.opcode in ("dynamic-slice", "slice") and
                       r.operands[0] == parameter.name for r in readers):
      read += sum(nbytes(r.type) for r in readers)
    else:
      read += nbytes(module.parameter_source(parameter, kernel).type)
  return read + written


__all__ = (
    "DTYPE_NAMES",
    "NO_KERNEL_OPS",
    "Instruction",
    "Module",
    "arrays",
    "convolution_flops",
    "dot_flops",
    "dtype_bytes",
    "kernel_bytes",
    "nbytes",
)
