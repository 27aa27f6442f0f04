"""The batch shards of one expert group stepping together (a mixture of experts on a mesh
whose `expert` axis splits both the batch and the experts, paged_mesh.py).

Each of those shards runs its own paged engine over its own rows and pool, but holds only
its part of the experts: every model call (a prefill, a decode step) exchanges the group's
tokens (models/moe.py, `_manual_experts`), so every device of the group must make the same
model calls in the same order with the same shapes. The engine's control decisions that
choose a model call are therefore taken jointly, as the largest of the devices' choices
(`joint`): the loop goes on while any device has work; the admission loop prefills when any
device needs a prefill (the others compute it too and keep nothing); a decode step runs at
the largest row and table level any device needs, and is skipped only when no device has a
live row. A device's own rows and outputs never depend on the others' (a row's samples
depend only on its key), so the tokens are those the shards draw alone; the price is the
steps a device computes for rows it does not have (counted in PagedStats like any other
computed row).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl4llm.sampling import decode


def joint(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The largest value of `x` over the devices of `axes` (a bool: any of them); `x` itself
    with no axes."""
    if not axes:
        return x
    return jax.lax.pmax(x.astype(jnp.int32), axes).astype(x.dtype)


def admit(
    s: Any,
    axes: tuple[str, ...],
    due: Callable[[Any], jax.Array],
    admit_next: Callable[[Any], Any],
    prefill: Callable[[Any], Any],
) -> Any:
    """paged.Engine.admit over the group: while any device is `due` (it has a pending group
    that fits, or groups to prefill and free rows), either every device prefills (when any
    device is due with nothing pending; only those keep the result) or the due devices
    admit their next pending group."""

    def wants_prefill(s: Any) -> jax.Array:
        return due(s) & ~(s.pend_next < s.pend_end)

    def prefill_all(s: Any) -> Any:
        keep = wants_prefill(s)
        return jax.tree.map(lambda new, old: jnp.where(keep, new, old), prefill(s), s)

    def admit_due(s: Any) -> Any:
        return jax.lax.cond(due(s), admit_next, lambda s: s, s)

    def one(s: Any) -> Any:
        with jax.named_scope(decode.PREFILL_SCOPE):
            return jax.lax.cond(joint(wants_prefill(s), axes), prefill_all, admit_due, s)

    return jax.lax.while_loop(lambda s: joint(due(s), axes), one, s)


def decode_levels(
    row_level: jax.Array, width_level: jax.Array, idle: jax.Array, axes: tuple[str, ...]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(row level, table level, idle) of the group's decode step: the largest levels any
    device needs, idle only where every device is (a device with no live row computes the
    step for rows it does not have)."""
    if not axes:
        return row_level, width_level, idle
    rows = joint(jnp.where(idle, -1, row_level), axes)
    widths = joint(jnp.where(idle, -1, width_level), axes)
    return jnp.maximum(rows, 0), jnp.maximum(widths, 0), rows < 0
