"""The optimized HLO text as data (compiled.as_text(), or right after SPMD partitioning):
its computations and instructions, shapes, the call graph, how often each computation runs
per call of the program (loops, conditionals, scopes the HLO cannot count), a dot's FLOPs.
hlo_analysis.py reads collectives and FLOPs with it."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from typing import Mapping

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
CALLEES = re.compile(
    r"\b(body|condition|calls|to_apply|branch_computations|"
    r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
OP_NAME = re.compile(r'op_name="([^"]*)"')
DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


@dataclasses.dataclass(frozen=True)
class Shape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.dims)


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    op: str
    result: str
    rest: str
    root: bool = False

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.rest.split(")")[0])


# A program's computations by name, each its instructions in order.
Computations = dict[str, list[Instruction]]


def parse_shapes(text: str) -> tuple[Shape, ...]:
    return tuple(
        Shape(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in SHAPE.findall(text)
    )


def computations(hlo: str) -> tuple[Computations, str]:
    comps: Computations = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            m = COMPUTATION.match(line)
            if m and "=" not in line.split("(")[0]:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTRUCTION.match(line)
        if m:
            comps[current].append(
                Instruction(m.group(2), m.group(4), m.group(3), m.group(5), bool(m.group(1)))
            )
    return comps, entry


def dot_flops(inst: Instruction, shapes: dict[str, str]) -> float:
    """2 x the multiply-adds of one dot instruction (0 for any other)."""
    if inst.op != "dot":
        return 0.0
    result = parse_shapes(inst.result)
    operand_shapes = parse_shapes(inst.rest.split(")")[0])
    if not operand_shapes:
        operand_shapes = parse_shapes(shapes.get(inst.operands[0], ""))
    m = DOT_DIMS.search(inst.rest)
    contracting = [int(x) for x in m.group(1).split(",") if x] if m else []
    k = math.prod(operand_shapes[0].dims[d] for d in contracting) if operand_shapes else 1
    return 2.0 * math.prod(result[0].dims) * k


def own_weight(instructions: list[Instruction]) -> tuple[float, float]:
    """A computation's own (dot FLOPs, collective result bytes), callees left out."""
    shapes = {i.name: i.result for i in instructions}
    flops = sum(dot_flops(i, shapes) for i in instructions)
    moved = sum(
        s.bytes
        for i in instructions
        if i.op.removesuffix("-start") in KINDS
        for s in parse_shapes(i.result)
    )
    return flops, moved


Call = tuple[tuple[str, ...], int | None, str]


def calls_of(comps: Computations) -> dict[str, list[Call]]:
    """Each computation's call sites: (the callees, the trip count: 1, a while loop's known
    count, or None when unknown; the calling instruction's op_name). A conditional is one
    call site of several callees, its branches, of which one runs."""
    calls: dict[str, list[Call]] = collections.defaultdict(list)
    for name, instructions in comps.items():
        for inst in instructions:
            trip: int | None = 1
            if inst.op == "while":
                m = TRIP_COUNT.search(inst.rest)
                trip = int(m.group(1)) if m else None
            m = OP_NAME.search(inst.rest)
            op_name = m.group(1) if m else ""
            branches = []
            for key, callees in CALLEES.findall(inst.rest):
                if key == "to_apply" and inst.op != "call":
                    continue  # scalar reducers: no collectives inside (a call's is its body)
                for callee in callees.strip("{}").replace("%", "").split(","):
                    callee = callee.strip()
                    if callee not in comps:
                        continue
                    if key in ("branch_computations", "true_computation", "false_computation"):
                        branches.append(callee)
                    else:
                        looped = trip if key in ("body", "condition") else 1
                        calls[name].append(((callee,), looped, op_name))
            if branches:
                calls[name].append((tuple(branches), 1, op_name))
    return calls


def executions(
    comps: Computations,
    entry: str,
    unknown_trip_count: int,
    limits: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """How often each computation runs per call of the entry computation. A while loop
    without a known trip count runs `unknown_trip_count` times, or once per iteration of an
    enclosing one (a decode loop's bound is the tokens it decodes; a loop inside it, e.g. the
    paged engine's admission, runs a few times per decode step, not that bound again).

    A conditional runs its heaviest branch (most dot FLOPs, then most collective bytes, its
    callees' included) each time it runs: the worst case of one call, not the sum of its
    branches (the paged engine's loop picks one decode step of many row levels per
    iteration). What a call site under a named scope of `limits` calls runs at most that
    many times in all (limited_runs)."""
    calls = calls_of(comps)
    own = {name: own_weight(instructions) for name, instructions in comps.items()}

    @functools.cache
    def weight(name: str) -> tuple[float, float]:
        flops, moved = own[name]
        for callees, trip, _ in calls.get(name, ()):
            heaviest = max((weight(c) for c in callees), default=(0.0, 0.0))
            flops, moved = flops + heaviest[0] * (trip or 1), moved + heaviest[1] * (trip or 1)
        return flops, moved

    counts: dict[str, int] = collections.Counter()

    def visit(name: str, times: int, unknown: int) -> None:
        counts[name] += times
        for callees, trip, op_name in calls.get(name, ()):
            callee = max(callees, key=weight)  # the first of equals
            inner = unknown if trip is not None else 1
            runs = limited_runs(times * (unknown if trip is None else trip), op_name, limits)
            visit(callee, runs, inner)

    visit(entry, 1, unknown_trip_count)
    return counts


def limited_runs(runs: int, op_name: str, limits: Mapping[str, int] | None) -> int:
    """Executions of an instruction (or of what it calls), at most limits[scope] for a named
    scope in its op_name: what the HLO cannot tell (the paged engine's prefill sits in its
    decode loop but runs once per admitted block of groups, not once per decode step)."""
    for scope, most in (limits or {}).items():
        if scope in op_name:
            runs = min(runs, most)
    return runs
