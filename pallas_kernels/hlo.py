"""Copies of donated buffers and rewrites of weights in XLA's optimized HLO text, and how
much of a GPU executable runs inside CUDA graphs.

A donated buffer (a KV cache) is updated in place only when XLA can alias it to an
output; otherwise the ENTRY computation copies it first, which costs its full size in
memory traffic on every call. The kernel benchmark counts these copies for the KV write,
and jaxvllm's engine AOT check for the whole engine step.
"""

from __future__ import annotations

import math
import re


def entry_computation(hlo: str) -> str:
    """The ENTRY computation of an HLO module's text (where a donated buffer gets copied)."""
    start = hlo.find("\nENTRY ")
    if start < 0:
        return hlo
    end = hlo.find("\n}", start)
    return hlo[start : end if end >= 0 else None]


def count_cache_copies(hlo: str, shape: tuple[int, ...], dtype: str | None = None) -> int:
    """`copy` instructions of the ENTRY computation whose result has `shape`'s element count
    (and `dtype`, e.g. "bf16", when given): copies of a donated KV cache or sampler state
    (should be 0). Copies inside called computations, such as a cond branch handing back
    logits of the same size, are not the donated buffers and are not counted."""
    numel = math.prod(shape)
    count = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*? copy\(", entry_computation(hlo)):
        dims = [int(x) for x in m.group(2).split(",") if x]
        if dims and math.prod(dims) == numel and dtype in (None, m.group(1)):
            count += 1
    return count


def parameter_rewrites(hlo: str) -> dict[str, int]:
    """Instructions of the ENTRY computation that rewrite a whole parameter of two or more
    axes (a copy, transpose, convert or loop fusion whose only operand is the parameter,
    with its element count), each with that count. Such is a weight re-laid out or
    converted on every call, which costs its size in memory traffic each step."""
    entry = entry_computation(hlo)
    params = {m.group(1): math.prod(int(x) for x in m.group(2).split(","))
              for m in re.finditer(r"(%[\w.\-]+) = \w+\[(\d+,[\d,]+)\]\S* parameter\(", entry)}
    found = {}
    for m in re.finditer(r"(%[\w.\-]+) = \w+\[([\d,]*)\]\S* (copy|transpose|convert|fusion)\((%[\w.\-]+)\)(.*)",
                         entry):
        name, dims, op, operand, rest = m.groups()
        numel = math.prod(int(x) for x in dims.split(",") if x)
        if operand in params and numel == params[operand] and (op != "fusion" or "kind=kLoop" in rest):
            found[f"{name} = {op}({operand})"] = numel
    return found


def graphed_thunks(thunk_sequence: str) -> tuple[int, int]:
    """(thunks inside XLA's command buffers, thunks launched one by one) in a GPU
    executable's thunk sequence as XLA dumps it (`*thunk_sequence_after_thunk_passes.txt`).
    A command buffer is a CUDA graph: the host launches it once per call, however many
    kernels it holds; every other thunk costs the host a launch per call."""
    inside = outside = 0
    for m in re.finditer(r"^( *)\d+: (k\w+)", thunk_sequence, re.M):
        if m.group(1):  # indented: a command of the command buffer above
            inside += 1
        elif m.group(2) != "kCommandBuffer":
            outside += 1
    return inside, outside
