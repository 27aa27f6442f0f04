"""A jitted function with the static settings a run fixes bound to it: called with the
per-call arguments only, and lowered the same way on abstract inputs, so the caller that
runs it and the planner that compiles it ahead of time (tools/plan.py) cannot pass different
settings (train/programs.py holds a training step's programs); `export` gives the same
program for another platform."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Program:
    """`fn` (a `jax.jit` function) with the keyword arguments `static` bound.

    name: what the planner's report and the benchmarks call it.
    fn: the jitted function.
    static: keyword arguments every call passes (static ones, and None for absent inputs).
    """

    name: str
    fn: Any
    static: Mapping[str, Any]

    def __call__(self, *args: Any, **per_call: Any) -> Any:
        return self.fn(*args, **self._arguments(per_call))

    def lower(self, *args: Any, **per_call: Any) -> Any:
        """`fn.lower` on these arguments (jax.ShapeDtypeStruct leaves allocate nothing)."""
        return self.fn.lower(*args, **self._arguments(per_call))

    def export(self, platform: str) -> Any:
        """`lower`'s counterpart for another platform: a function of the same arguments
        giving `fn` exported for `platform` (jax.export: "tpu", "cuda", "cpu"), traced as on
        that platform inside parallel.lowering_for (planner/target.py)."""
        from jax import export  # loaded already (fn is jax.jit's); this module stays stdlib

        exporter = export.export(self.fn, platforms=[platform])
        return lambda *args, **per_call: exporter(*args, **self._arguments(per_call))

    def _arguments(self, per_call: Mapping[str, Any]) -> dict[str, Any]:
        both = set(per_call) & set(self.static)
        if both:
            raise TypeError(
                f"{self.name}: {', '.join(sorted(both))} bound already (static settings of "
                "the program); pass only per-call arguments."
            )
        return {**self.static, **per_call}
