"""What XLA did with a compiled loop: kernels per iteration, copies of big buffers, memory.

Reads the optimized HLO text (`compiled.as_text()`) and `compiled.memory_analysis()`. The while
loop's body computation is found through the `while(...)` instruction's `body=` attribute; the
instructions in it (and in computations it calls, such as command buffers) that launch work on
the device are counted: fusions, custom calls (cuBLAS / cuDNN / Pallas), copies, and the
unfused ops that remain.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

# Instructions that do not launch device work.
_FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "constant",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
}
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
ENTRY = "__entry__"  # key under which `computations` also files the entry computation
_CALLED_RE = re.compile(r"(?:body|calls|to_apply)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str
    shape: str  # e.g. "bf16[32,1,1025,55,96]{4,3,2,1,0}"
    line: str


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """Computation name → its instructions, from optimized HLO text."""
    comps: dict[str, list[Instruction]] = {}
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            # Headers start in column 0 and end with "{"; instructions are indented.
            if line and not line[0].isspace() and line.rstrip().endswith("{"):
                words = line.split()
                name = words[1] if words[0] == "ENTRY" else words[0]
                current = name.lstrip("%")
                comps[current] = []
                if words[0] == "ENTRY":
                    comps[ENTRY] = comps[current]
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTRUCTION_RE.match(line)
        if match:
            comps[current].append(Instruction(match.group(2), match.group(1), line.strip()))
    return comps


def while_bodies(comps: dict[str, list[Instruction]]) -> list[str]:
    """Names of the body computations of every while loop."""
    bodies = []
    for name, instructions in comps.items():
        if name == ENTRY:
            continue
        for ins in instructions:
            if ins.opcode == "while":
                match = re.search(r"body=%?([\w.\-]+)", ins.line)
                if match:
                    bodies.append(match.group(1))
    return bodies


def launches(comps: dict[str, list[Instruction]], name: str) -> Counter:
    """Device work in computation `name`, by opcode (custom calls by target), following calls
    into command buffers and nested calls but not into fusions (one fusion = one kernel)."""
    counts: Counter = Counter()
    for ins in comps.get(name, []):
        if ins.opcode in _FREE:
            continue
        if ins.opcode in ("call", "conditional", "async-start") or "command_buffer" in ins.line:
            for callee in _CALLED_RE.findall(ins.line):
                counts += launches(comps, callee)
            continue
        if ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.line)
            counts[f"custom-call:{target.group(1) if target else '?'}"] += 1
        elif ins.opcode in ("async-done", "async-update"):
            continue
        else:
            counts[ins.opcode] += 1
    return counts


def copies_of_shape(comps: dict[str, list[Instruction]], dims: tuple[int, ...]) -> list[str]:
    """Copy-like instructions anywhere whose result has exactly `dims` (e.g. the KV cache)."""
    wanted = "[" + ",".join(str(d) for d in dims) + "]"
    found = []
    for name, instructions in comps.items():
        if name == ENTRY:
            continue
        for ins in instructions:
            if ins.opcode in ("copy", "copy-start") and wanted in ins.shape.split("{")[0]:
                found.append(ins.line[:160])
    return found


_ARRAY_DIMS_RE = re.compile(r"\w+\[([\d,]*)\]")


def result_dims(ins: Instruction) -> list[tuple[int, ...]]:
    """Dimensions of every array in the instruction's result (one, or a tuple's elements)."""
    return [
        tuple(int(d) for d in dims.split(",") if d) for dims in _ARRAY_DIMS_RE.findall(ins.shape)
    ]


def materialized_slices(
    comps: dict[str, list[Instruction]], bodies: list[str], dims: tuple[int, ...]
) -> list[str]:
    """Device work in the loop bodies whose result holds a `dims` array (leading 1s aside), e.g.
    one slot of the KV cache: a slice of a big buffer written out at every iteration instead of
    read in place (XLA does this for a custom call's sliced operand)."""

    def squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
        while shape and shape[0] == 1:
            shape = shape[1:]
        return shape

    wanted = squeezed(tuple(dims))
    found = []
    for body in bodies:
        for ins in comps.get(body, []):
            if ins.opcode in _FREE:
                continue
            if any(squeezed(d) == wanted for d in result_dims(ins)):
                found.append(ins.line[:160])
    return found


def loop_report(
    hlo_text: str,
    memory: Any,
    *,
    big_buffer_dims: tuple[int, ...],
    slice_dims: tuple[int, ...] | None = None,
) -> dict:
    """Kernels per loop iteration, copies of a big buffer, slices of it materialized in the loop
    (`slice_dims`: the shape of one slice, e.g. a cache slot), and `memory_analysis()` bytes."""
    comps = computations(hlo_text)
    # One iteration compiles to straight-line code (XLA removes a trip-count-1 loop).
    bodies = while_bodies(comps) or [ENTRY]
    per_body = {body: dict(launches(comps, body)) for body in bodies}
    report = {
        "while_loops": len(while_bodies(comps)),
        "kernels_per_iteration": {b: sum(c.values()) for b, c in per_body.items()},
        "launches_by_kind": per_body,
        "big_buffer_copies": copies_of_shape(comps, big_buffer_dims),
    }
    if slice_dims is not None:
        report["slice_copies_per_iteration"] = materialized_slices(comps, bodies, slice_dims)
    if memory is not None:
        for field in ("argument", "output", "temp", "alias", "generated_code"):
            report[f"{field}_bytes"] = int(getattr(memory, f"{field}_size_in_bytes", 0))
    return report
