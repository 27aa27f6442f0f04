"""What a compiled program does, read from its optimized HLO text: the collectives it runs
(with loop trip counts), the ones a loop repeats on values it never changes, and its matmul
FLOPs.

Only the compiled program shows whether the work is split the way the parameters are
(parallel.py): tests assert on these numbers, and tools/plan.py prints them.

    compiled = jax.jit(f).lower(*args).compile()
    ops = collectives(compiled.as_text())
    sum(op.total_bytes for op in ops if op.kind == "all-gather")

Where a collective sits is decided by the SPMD partitioner; later passes of some backends move
it (the CPU compiler's while-loop-invariant code motion hoists a weight's gather out of a
loop; the TPU and GPU pipelines keep such size-inflating ops inside). `partitioned_hlo`
returns the program right after partitioning, the placement every backend starts from.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import tempfile
from typing import Any, Iterable, Mapping

from jaxrl4llm.planner import hlo_text
from jaxrl4llm.planner.hlo_text import (
    DTYPE_BYTES,
    KINDS,
    Computations,
    Instruction,
    Shape,
    parse_shapes,
)

__all__ = ["DTYPE_BYTES", "KINDS", "Collective", "Shape", "collectives", "matmul_flops"]

_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\})")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the program.

    result / operands: the shapes one device holds after / before it (tuples for combined
    collectives). group_size: devices per replica group. executions: how often it runs per
    call of the program (the product of the trip counts of the loops around it).
    """

    kind: str
    name: str
    computation: str
    result: tuple[Shape, ...]
    operands: tuple[Shape, ...]
    group_size: int
    executions: int
    upcast_from: str | None = None  # the operand is a just-converted bfloat16 / float16 value
    op_name: str = ""  # the JAX op (and named scopes) it came from, if recorded

    @property
    def bytes(self) -> float:
        """Per-device payload of one execution: the gathered result of an all-gather, the
        operand of the others (what reduce-scatter / all-reduce / all-to-all consume).

        An operand converted up from a narrower float right before the collective counts at
        that width: XLA's CPU compiler (plans and tests) computes bfloat16 dots in float32
        and hoists the convert above the all-gather; the TPU and GPU compilers move the
        bfloat16 weights."""
        shapes = self.result if self.kind == "all-gather" else self.operands
        scale = DTYPE_BYTES[self.upcast_from] / 4 if self.upcast_from else 1.0
        return sum(s.bytes * (scale if s.dtype == "f32" else 1.0) for s in shapes)

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.executions

    @property
    def link_bytes(self) -> float:
        """Bytes one device sends per call over a ring (bandwidth-optimal algorithms): an
        all-reduce moves its buffer twice, the others once, each (n - 1) / n of it."""
        n = max(self.group_size, 1)
        share = (n - 1) / n if self.kind != "collective-permute" else 1.0
        return self.total_bytes * share * (2 if self.kind == "all-reduce" else 1)


def _group_size(rest: str, num_devices: int | None) -> int:
    m = _GROUPS_MESH.search(rest)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'(\w+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes)
    m = _GROUPS_IOTA.search(rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = _GROUPS_LIST.search(rest)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x])
    return num_devices or 1


def _is_sliced(name: str, instructions: list[Instruction], comps: Computations) -> bool:
    """Whether every use of value `name` is a dynamic-slice, directly or inside a fusion."""
    users = [i for i in instructions if name in i.operands]
    for user in users:
        if user.op == "dynamic-slice":
            continue
        called = hlo_text.CALLEES.search(user.rest) if user.op == "fusion" else None
        body = comps.get(called.group(2).lstrip("%"), []) if called else []
        if not any(i.op == "dynamic-slice" for i in body):
            return False
    return bool(users)


def _upcast_source(
    operand_names: list[str], instructions: list[Instruction], comps: Computations
) -> str | None:
    """ "bf16" / "f16" when every operand is produced by a convert (or a fusion of data
    movement and converts) that passes the value through that narrower float, else None."""
    narrow = set()
    by_name = {i.name: i for i in instructions}
    for name in operand_names:
        producer = by_name.get(name)
        if producer is None:
            return None
        body = [producer]
        if producer.op == "fusion":
            called = hlo_text.CALLEES.search(producer.rest)
            body = comps.get(called.group(2).lstrip("%"), []) if called else []
        moves = {
            "parameter",
            "convert",
            "bitcast",
            "reshape",
            "copy",
            "transpose",
            "slice",
            "dynamic-slice",
            "constant",
            "broadcast",
            "subtract",
            "add",
            "multiply",
        }
        if {i.op for i in body} - moves:
            return None
        inner = {i.name: i for i in body}
        types = set()
        for conv in (i for i in body if i.op == "convert"):
            types.add(parse_shapes(conv.result)[0].dtype)
            source = conv.operands
            if source and source[0] in inner:
                types.add(parse_shapes(inner[source[0]].result)[0].dtype)
        found = types & {"bf16", "f16"}
        if len(found) != 1:
            return None
        narrow |= found
    return narrow.pop() if len(narrow) == 1 else None


def _sliced_elements(
    inst: Instruction,
    num: int,
    instructions: list[Instruction],
    comps: Computations,
) -> list[bool]:
    """For each (tuple) element of an all-reduce: whether its result is only sliced, i.e.
    the all-reduce + dynamic-slice pair that the TPU and GPU compilers turn into one
    reduce-scatter (XLA's ReduceScatterCreator pass; the CPU compiler, which plans and
    tests run on, keeps the pair)."""
    if num == 1 and not inst.result.startswith("("):
        return [_is_sliced(inst.name, instructions, comps)]
    flags = [False] * num
    for i in instructions:
        m = re.match(rf"%?{re.escape(inst.name)}\), index=(\d+)", i.rest)
        if i.op == "get-tuple-element" and m:
            flags[int(m.group(1))] = _is_sliced(i.name, instructions, comps)
    return flags


def collectives(
    hlo: str,
    *,
    unknown_trip_count: int = 1,
    num_devices: int | None = None,
    limits: Mapping[str, int] | None = None,
) -> list[Collective]:
    """Every collective of an optimized HLO module (compiled.as_text()), with how often it runs.

    A while loop without a known trip count (a decode loop that stops early) counts as
    `unknown_trip_count` iterations (pass its bound for a worst case), one nested in such a
    loop as one iteration per outer iteration; `limits` caps the executions of the
    instructions under a named scope (hlo_text.limited_runs). An all-reduce whose
    result is only sliced counts as the reduce-scatter it becomes on TPU / GPU.
    """
    comps, entry = hlo_text.computations(hlo)
    runs = hlo_text.executions(comps, entry, unknown_trip_count, limits)
    out = []
    for comp, instructions in comps.items():
        for inst in instructions:
            kind = inst.op.removesuffix("-start")
            if kind not in KINDS or not runs.get(comp):
                continue
            operands = parse_shapes(inst.rest.split("),")[0])
            if not operands:  # operands printed by name only: look their shapes up
                shapes = {i.name: i.result for i in instructions}
                operands = tuple(s for n in inst.operands for s in parse_shapes(shapes.get(n, "")))
            result = parse_shapes(inst.result)
            if inst.op.endswith("-start") and kind == "all-gather":
                result = result[len(operands) :]  # async: (operands, results) tuple
            group = _group_size(inst.rest, num_devices)
            upcast = _upcast_source(inst.operands, instructions, comps)
            m = hlo_text.OP_NAME.search(inst.rest)
            op_name = m.group(1) if m else ""
            times = hlo_text.limited_runs(runs[comp], op_name, limits)
            if kind != "all-reduce" or inst.op.endswith("-start"):
                out.append(
                    Collective(
                        kind, inst.name, comp, result, operands, group, times, upcast, op_name
                    )
                )
                continue
            sliced = _sliced_elements(inst, len(operands), instructions, comps)
            for flag, name in ((True, "reduce-scatter"), (False, "all-reduce")):
                picked = [k for k, f in enumerate(sliced) if f == flag]
                if picked:
                    out.append(
                        Collective(
                            name,
                            inst.name,
                            comp,
                            tuple(result[k] for k in picked),
                            tuple(operands[k] for k in picked),
                            group,
                            times,
                            upcast,
                            op_name,
                        )
                    )
    return out


def partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compiles a `jax.jit(...).lower(...)` result and returns (the compiled program, its HLO
    text right after SPMD partitioning): where the partitioner put each collective, before
    backend passes move any (see the module docstring). Costs one compile, as `.compile()`."""
    with tempfile.TemporaryDirectory() as folder:
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": folder,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_hlo_as_text": True,
            }
        )
        dumps = sorted(
            f
            for f in os.listdir(folder)
            if f.endswith("after_spmd-partitioning.txt") or ".after_spmd-partitioning." in f
        )
        if not dumps:
            raise ValueError(
                "partitioned_hlo: the compiler dumped no HLO after SPMD "
                "partitioning; the program must be compiled for a mesh of "
                "several devices."
            )
        with open(os.path.join(folder, dumps[-1])) as f:
            return compiled, f.read()


def _loop_invariant(body: list[Instruction]) -> set[str]:
    """Values of a while body that are the same in every iteration: carried elements the body
    returns unchanged, constants, and whatever is computed from those alone."""
    param = next((i.name for i in body if i.op == "parameter"), None)
    root = next((i for i in body if i.root), None)
    by_name = {i.name: i for i in body}
    passed = set()
    if root is not None and root.op == "tuple":
        for k, name in enumerate(root.operands):
            source = by_name.get(name)
            m = _TUPLE_INDEX.search(source.rest) if source is not None else None
            if (
                source is not None
                and source.op == "get-tuple-element"
                and source.operands == [param]
                and m
                and int(m.group(1)) == k
            ):
                passed.add(k)
    invariant: set[str] = set()
    for inst in body:  # HLO text lists every value after its operands
        if inst.op == "get-tuple-element" and inst.operands == [param]:
            m = _TUPLE_INDEX.search(inst.rest)
            if m and int(m.group(1)) in passed:
                invariant.add(inst.name)
        elif inst.op not in (
            "parameter",
            "rng",
            "rng-bit-generator",
            "rng-get-and-update-state",
        ) and (all(name in invariant for name in inst.operands)):
            invariant.add(inst.name)
    return invariant


def loop_invariant_collectives(hlo: str, *, unknown_trip_count: int = 1) -> list[Collective]:
    """The collectives inside while-loop bodies whose operands the loop never changes (e.g. a
    weight's FSDP shards gathered in every decode step): the same transfer each iteration,
    which belongs before the loop. Pass `partitioned_hlo`'s text: the final HLO of the CPU
    compiler has them hoisted already. Counted as `collectives` counts them."""
    comps, _ = hlo_text.computations(hlo)
    bodies = {
        callee.lstrip("%")
        for instructions in comps.values()
        for inst in instructions
        if inst.op == "while"
        for key, callee in hlo_text.CALLEES.findall(inst.rest)
        if key == "body"
    }
    flagged = set()
    for name in bodies & set(comps):
        invariant = _loop_invariant(comps[name])
        flagged |= {
            (name, i.name)
            for i in comps[name]
            if i.op.removesuffix("-start") in KINDS
            and i.operands
            and all(o in invariant for o in i.operands)
        }
    return [
        op
        for op in collectives(hlo, unknown_trip_count=unknown_trip_count)
        if (op.computation, op.name) in flagged
    ]


def summarize(ops: Iterable[Collective]) -> dict[str, float]:
    """Total per-device payload bytes per kind (plus "link" bytes over a ring, all kinds)."""
    total: dict[str, float] = collections.defaultdict(float)
    for op in ops:
        total[op.kind] += op.total_bytes
        total["link"] += op.link_bytes
    return dict(total)


def matmul_flops(
    hlo: str, *, unknown_trip_count: int = 1, limits: Mapping[str, int] | None = None
) -> float:
    """2 x multiply-adds of every dot in the program, loops counted, a conditional's heaviest
    branch only, `limits` as collectives' (per device)."""
    comps, entry = hlo_text.computations(hlo)
    runs = hlo_text.executions(comps, entry, unknown_trip_count, limits)
    # Dots inside fusions run when their fusion does: count fusion bodies like callees.
    total = 0.0
    for comp, instructions in comps.items():
        if not runs.get(comp):
            continue
        shapes = {i.name: i.result for i in instructions}
        for inst in instructions:
            m = hlo_text.OP_NAME.search(inst.rest)
            times = hlo_text.limited_runs(runs[comp], m.group(1) if m else "", limits)
            total += hlo_text.dot_flops(inst, shapes) * times
    return total
