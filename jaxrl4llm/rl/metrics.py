"""Metrics with their final names and one reduction each, declared where they are computed.

A `Metric` is a value as computed on part of a batch (a micro-batch, one update, one host)
together with how parts combine: "sum", "mean" (a total and the count behind it, so means
over micro-batches, updates and hosts are exact), "min" or "max". Whoever computes a metric
names it as it will be logged ("policy/entropy"), so the trainer combines and logs any metric
without knowing it:

    merged = combine_metrics(combine_metrics(m_micro_0, m_micro_1), m_update_1)
    finalize_metrics(merged)  -> {"policy/entropy": ..., "policy/ratio_min": ...}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

REDUCTIONS = ("sum", "mean", "min", "max")


@dataclasses.dataclass(frozen=True)
class Metric:
    """total: the sum so far ("sum", "mean") or the extreme so far ("min", "max");
    count: for "mean", how many items `total` sums (tokens, rows, updates; 0 -> value 0);
    reduce: how two parts combine, one of REDUCTIONS (static under jit)."""

    total: Any
    count: Any = 1.0
    reduce: str = "mean"

    @classmethod
    def mean(cls, total: Any, count: Any = 1.0) -> "Metric":
        """A mean: `total` summed over `count` items (count 1: a value averaged per part)."""
        return cls(total, count, "mean")

    @classmethod
    def sum(cls, total: Any) -> "Metric":
        return cls(total, 1.0, "sum")

    @classmethod
    def min(cls, value: Any) -> "Metric":
        return cls(value, 1.0, "min")

    @classmethod
    def max(cls, value: Any) -> "Metric":
        return cls(value, 1.0, "max")

    def merge(self, other: "Metric") -> "Metric":
        if other.reduce != self.reduce:
            raise ValueError(f"Cannot merge a {self.reduce!r} metric with a {other.reduce!r} one.")
        xp = _xp(self.total, other.total)
        if self.reduce == "min":
            return Metric(xp.minimum(self.total, other.total), self.count, "min")
        if self.reduce == "max":
            return Metric(xp.maximum(self.total, other.total), self.count, "max")
        return Metric(self.total + other.total, self.count + other.count, self.reduce)

    @property
    def is_empty(self) -> Any:
        """True when no item was counted: a mean over 0 items, or an extreme still at its
        identity (+-inf). Its `value` (0 or +-inf) then stands in for nothing measured;
        the trainer does not log it (an update whose every row was rejected has no entropy)."""
        xp = _xp(self.total, self.count)
        if self.reduce == "mean":
            return xp.asarray(self.count) == 0
        if self.reduce in ("min", "max"):
            return ~xp.isfinite(xp.asarray(self.total))
        return xp.asarray(False)

    @property
    def value(self) -> Any:
        if self.reduce == "mean":
            return self.total / _xp(self.count).maximum(self.count, 1.0)
        return self.total

    def identity(self) -> "Metric":
        """The part that merges as a no-op (a scan's initial carry)."""
        start = {"min": jnp.inf, "max": -jnp.inf}.get(self.reduce, 0.0)
        return Metric(jnp.full_like(self.total, start), jnp.zeros_like(self.count), self.reduce)


def _xp(*xs: Any) -> Any:
    """jax.numpy for device values and tracers; numpy for host values (kept in float64)."""
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


jax.tree_util.register_dataclass(Metric, data_fields=["total", "count"], meta_fields=["reduce"])

Metrics = Mapping[str, Metric]


def combine_metrics(a: Metrics, b: Metrics) -> dict[str, Metric]:
    """Combines two parts' metrics by each one's reduction; a metric in only one part is kept."""
    out = dict(a)
    for k, m in b.items():
        out[k] = out[k].merge(m) if k in out else m
    return out


def finalize_metrics(metrics: Metrics) -> dict[str, jax.Array]:
    """{final name: value} of merged metrics (for logging). Jittable, so every name stays: a
    metric that counted nothing reads 0 (a mean) or +-inf (an extreme); check
    `Metric.is_empty` before logging it (the trainer leaves such metrics out)."""
    return {k: m.value for k, m in metrics.items()}


def identity_metrics(metrics: Metrics) -> dict[str, Metric]:
    """Metrics (or their shapes) -> parts that merge as no-ops."""
    return {
        k: Metric(
            jnp.zeros(m.total.shape, jnp.float32), jnp.zeros(m.count.shape, jnp.float32), m.reduce
        ).identity()
        for k, m in metrics.items()
    }


def reduce_metrics(metrics: Metrics, axis_name: str | None) -> dict[str, Metric]:
    """One shard's metrics -> the whole batch's (every shard of `axis_name` under shard_map):
    totals and counts summed, extremes reduced; unchanged when axis_name is None."""
    if axis_name is None:
        return dict(metrics)
    out = {}
    for k, m in metrics.items():
        if m.reduce == "min":
            out[k] = Metric(jax.lax.pmin(m.total, axis_name), m.count, "min")
        elif m.reduce == "max":
            out[k] = Metric(jax.lax.pmax(m.total, axis_name), m.count, "max")
        else:
            count = jax.lax.psum(m.count, axis_name) if m.reduce == "mean" else m.count
            out[k] = Metric(jax.lax.psum(m.total, axis_name), count, m.reduce)
    return out
