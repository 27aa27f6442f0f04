"""The planner's printed tables: per-program memory and time, the rollout's weight gathers,
a mixture of experts' layout and expert exchange, and from a completion length profile the
slot utilisation and the page pool's rows against fixed slots and a fixed batch."""

from __future__ import annotations

from jaxrl4llm.planner import pool, programs, slots
from jaxrl4llm.planner.topology import GB, HEADROOM
from jaxrl4llm.sampling.paged import PAGE_SIZE
from jaxrl4llm.sampling.paged_state import GROWTH_START

_SHORT = {
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-reduce": "AR",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def _fmt_gb(x: float) -> str:
    return f"{x / GB:.1f}"


def budget(result: programs.Plan) -> float:
    """Bytes a device may use: its memory less the headroom."""
    return result.topology.chip.hbm_bytes * (1 - HEADROOM)


def over_budget(result: programs.Plan) -> list[str]:
    """The programs whose total exceeds the budget, as "rollout 77.1 GB" (empty: all fit)."""
    return [f"{r.program} {_fmt_gb(r.total)} GB" for r in result.rows if r.total > budget(result)]


def not_fitting_line(result: programs.Plan) -> str:
    """The one line tools/plan.py ends with when some program does not fit."""
    return (
        f"DOES NOT FIT {result.topology.name} (budget {_fmt_gb(budget(result))} GB per device): "
        + ", ".join(over_budget(result))
    )


def _cells(r: programs.Row, budget_bytes: float) -> list[str]:
    """One program's row of the table."""
    coll = (
        " ".join(
            f"{_SHORT[k]} {v / GB:.1f}"
            for k, v in sorted(r.collectives.items())
            if k != "link" and v >= 0.05 * GB
        )
        or "-"
    )
    return [
        r.program,
        str(r.calls),
        _fmt_gb(r.args),
        _fmt_gb(r.temp),
        _fmt_gb(r.output),
        _fmt_gb(r.resident),
        _fmt_gb(r.total),
        _fmt_gb(r.estimate),
        "yes" if r.total <= budget_bytes else "NO",
        coll,
        f"{r.seconds:.2f} ({r.t_compute:.2f}/{r.t_comm:.2f}/{r.t_hbm:.2f})",
    ]


def print_table(head: list[str], lines: list[list[str]], markdown: bool) -> None:
    """A table as Markdown or as aligned columns."""
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(row[i]) for row in lines)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))


def print_plan(result: programs.Plan, markdown: bool = False) -> None:
    topo, rows = result.topology, result.rows
    budget_bytes = budget(result)
    head = [
        "program",
        "calls",
        "args GB",
        "temp GB",
        "out GB",
        "resident GB",
        "total GB",
        "estimate GB",
        "fits",
        "collectives GB/call",
        "s/call (compute/comm/hbm)",
    ]
    lines = [_cells(r, budget_bytes) for r in rows]
    print(
        f"\n{result.title}\n{topo.num_devices} x {topo.chip.name} ({_fmt_gb(topo.chip.hbm_bytes)}"
        f" GB, budget {_fmt_gb(budget_bytes)} GB with {HEADROOM:.0%} headroom), "
        f"mesh {result.mesh}\n"
    )
    print_table(head, lines, markdown)
    step = sum(r.seconds * r.calls for r in rows)
    print(
        f"\nroofline step time: {step:.1f} s; update collectives "
        f"{result.update_vs_textbook:.2f}x textbook FSDP; "
        + ("SOME PROGRAM DOES NOT FIT" if over_budget(result) else "every program fits")
    )
    print_weight_gathers(result)
    print_experts(result)


def print_experts(result: programs.Plan) -> None:
    """A mixture of experts' layout (from the params' shardings) and the bytes of its expert
    exchange (models/moe.py: the tokens' all-gather onto their experts' devices, the outputs'
    reduce-scatter back), read from each program's HLO: per device, per call and per step."""
    if not result.expert_layout:
        return
    print(f"expert layout: {result.expert_layout}")
    step: dict[str, float] = {}
    parts = []
    for r in result.rows:
        kinds = {k: v for k, v in r.exchange.items() if k != "link"}
        for k, v in kinds.items():
            step[k] = step.get(k, 0.0) + v * r.calls
        if kinds:
            cells = " + ".join(f"{_SHORT[k]} {_fmt_gb(v)}" for k, v in sorted(kinds.items()))
            parts.append(f"{r.program} {cells} GB/call x {r.calls}")
    total = " + ".join(f"{k} {_fmt_gb(v)} GB" for k, v in sorted(step.items())) or "none"
    print(
        f"expert exchange (HLO collectives of the token exchange, per device): {total} per "
        "step" + (f" ({'; '.join(parts)})" if parts else "")
    )


def print_weight_gathers(result: programs.Plan) -> None:
    r = result.rollout
    once, comm_once = result.rollout_seconds(per_token=False)
    per_token, comm_per_token = result.rollout_seconds(per_token=True)
    print(
        f"rollout weight gathers (HLO after SPMD partitioning): {_fmt_gb(r.weight_gathers)} GB"
        f" per device per step, once before the decode loops: rollout {once:.2f} s per step "
        f"(comm {comm_once:.2f} s); once per token ({r.weight_uses} prefill + decode steps "
        f"of {r.rows // r.slots} chunk(s), {_fmt_gb(r.weight_gathers * r.weight_uses)} GB): "
        f"rollout {per_token:.2f} s (comm {comm_per_token:.2f} s)"
    )
    print(
        "decode loop: no collective on unchanged values"
        if not r.in_loop
        else f"LOOPS REPEAT {_fmt_gb(r.in_loop)} GB of collectives on unchanged values per "
        "iteration (counted in every prefill and decode step above: an upper bound)"
    )


def print_slot_use(result: programs.Plan, mean: float, p99: float) -> None:
    r = result.rollout
    use = slots.slot_use(mean, p99, r.max_new_tokens, r.rows, r.slots)
    print(
        f"completion lengths lognormal (mean {mean:g}, p99 {p99:g} tokens, cut at "
        f"{r.max_new_tokens}: mean {use.mean_tokens:.0f}); {r.rows} rows in {r.slots} slots: "
        f"slot utilisation {use.fixed_utilisation:.2f} with a fixed batch "
        f"({use.fixed_steps:.0f} decode steps), {use.continuous_utilisation:.2f} with "
        f"continuous batching ({use.continuous_steps:.0f} decode steps; "
        f"{r.rows // r.slots * r.max_new_tokens} at the length limit)"
    )


def _pool_lines(name: str, c: pool.Column, rows: int) -> list[list[str]]:
    """One KV budget's rows of the page pool table ("-": the engine holds no row there)."""
    kv, gb = f"{name} {_fmt_gb(c.kv_bytes)}", _fmt_gb(c.kv_bytes)
    pool_gb = f"{_fmt_gb(c.pool_bytes)} ({c.pages} pages)"
    engines = [
        ("fixed batch", c.batch_rows, f"{c.batch_rows} x {c.chunks} chunks", gb),
        ("fixed slots", c.slots, str(c.slots), gb),
        ("page pool", c.pool_rows, f"{c.pool_rows}" + (" (all)" * (c.pool_rows >= rows)), pool_gb),
    ]
    steps = {
        "fixed batch": (c.batch_steps, c.batch_seconds),
        "fixed slots": (c.slot_steps, c.slot_seconds),
        "page pool": (c.pool_steps, c.pool_seconds),
    }
    return [
        [kv, engine, held, mem, f"{steps[engine][0]:.0f}", f"{steps[engine][1]:.1f}"]
        if n
        else [kv, engine, "0", mem, "-", "-"]
        for engine, n, held, mem in engines
    ]


def print_pool(result: programs.Plan, mean: float, p99: float, markdown: bool = False) -> None:
    """The page pool's rows, memory and rollout time against fixed slots and a fixed batch,
    in the flagfile's KV and in the KV the chip leaves the rollout (planner/pool.py)."""
    s = pool.setup(result)
    lengths = pool.Lengths.fit(mean, p99, s.max_new_tokens)
    columns = {
        k: pool.column(s, lengths, v) for k, v in pool.budgets(result, s, budget(result)).items()
    }
    some = next(iter(columns.values()))
    print(
        f"\npage pool (planner/pool.py): lengths lognormal (mean {mean:g}, p99 {p99:g}, cut at "
        f"{s.max_new_tokens}: mean {lengths.mean:.0f}, a live row at {lengths.tau:.0f} on "
        f"average); a live row holds {some.held:.1f} pages of {PAGE_SIZE} tokens, "
        f"admission reserves {GROWTH_START:g} x its {some.rest:.1f} to go; "
        f"{s.rows} rows per step, {s.shards} data-parallel shard(s)\n"
    )
    head = ["KV GB/device", "engine", "rows at once", "KV GB", "decode steps", "rollout s"]
    lines = [line for k, c in columns.items() for line in _pool_lines(k, c, s.rows)]
    print_table(head, lines, markdown)
    print(
        f"a pool that admits all {s.rows} rows at once (steady-state pages per row): "
        f"{_fmt_gb(some.all_rows_bytes)} GB per device"
    )
