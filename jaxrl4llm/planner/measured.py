"""One compiled program measured (a row of tools/plan.py's table): memory_analysis(), the
collectives and matmul FLOPs of its HLO (hlo_analysis.py), its roofline time terms; and the
rollout's weight traffic."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl4llm.models.moe import EXCHANGE_SCOPE
from jaxrl4llm.planner import hlo_analysis
from jaxrl4llm.planner.topology import Chip


@dataclasses.dataclass
class Row:
    program: str
    calls: int  # per training step
    args: float  # bytes per device
    temp: float
    output: float
    alias: float  # outputs written into donated arguments
    resident: float  # live arrays outside the program (state, reference, batch)
    estimate: float  # hand estimate of `total`
    collectives: dict  # payload bytes per call by kind, and "link" bytes
    flops: float  # matmul FLOPs per call per device
    t_compute: float
    t_comm: float
    t_hbm: float
    # The expert exchange's share of `collectives` (models/moe.py EXCHANGE_SCOPE): bytes per call.
    exchange: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.args + self.temp + self.output - self.alias + self.resident

    @property
    def seconds(self) -> float:
        return max(self.t_compute, self.t_comm, self.t_hbm)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The rollout's rows and weight traffic. Bytes are per device, sent over a ring
    (hlo_analysis.Collective.link_bytes), read from the HLO right after SPMD partitioning."""

    rows: int  # sampled per training step
    slots: int  # rows decoded at once (a chunk)
    max_new_tokens: int
    weight_gathers: float  # the weights' gathers before the decode loops, per step
    in_loop: float  # collectives one iteration of each loop repeats on unchanged
    # values, summed over the loops (0)
    apart: bool = False  # the gathers run in a program of their own, not the rollout row's
    # (by admission: paged_mesh.decode_weights, once per step before the segments)

    @property
    def weight_uses(self) -> int:
        """Forward passes over the weights per call at the length limit: prefill + decode
        steps of every chunk, or of each set of the rows decoding at once."""
        return self.rows // self.slots * self.max_new_tokens


def link_bytes(ops: Any) -> float:
    return sum(op.link_bytes for op in ops)


def measure(
    compiled: Any, calls: int, chip: Chip, unknown_trip_count: int = 1, limits: Any = None
) -> dict:
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    counts = dict(unknown_trip_count=unknown_trip_count, limits=limits)
    ops = hlo_analysis.collectives(hlo, **counts)
    summary = hlo_analysis.summarize(ops)
    flops = hlo_analysis.matmul_flops(hlo, **counts)
    return dict(
        calls=calls,
        args=mem.argument_size_in_bytes,
        temp=mem.temp_size_in_bytes,
        output=mem.output_size_in_bytes,
        alias=mem.alias_size_in_bytes,
        collectives=summary,
        exchange=hlo_analysis.summarize(op for op in ops if EXCHANGE_SCOPE in op.op_name),
        flops=flops,
        t_compute=flops / chip.peak_flops,
        t_comm=summary.get("link", 0.0) / chip.link_bw,
    )
