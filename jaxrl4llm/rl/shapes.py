"""Checks of the entry points' array arguments: rank, shape and dtype agreement, with errors
that name the argument and the shape it should have (a [B, 1] mask would otherwise broadcast
against [B, T] logprobs and scale the loss by T, silently)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def expect_shape(name: str, x: Any, shape: tuple[int, ...], meaning: str) -> None:
    """ValueError unless x (when given) has exactly `shape`; meaning: what the axes are."""
    if x is None:
        return
    got = tuple(jnp.shape(x))
    if got != tuple(shape):
        raise ValueError(f"{name} has shape {got}; expected {tuple(shape)} ({meaning}).")


def expect_float(name: str, x: Any) -> None:
    """ValueError unless x (when given) has a floating dtype (logprobs, values)."""
    if x is not None and not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"{name} has dtype {jnp.result_type(x)}; expected a float dtype.")


def expect_BT(name: str, x: Any, like: str, shape_BT: tuple[int, ...]) -> None:
    """A [B, T] float array of the same shape as `like`."""
    expect_shape(name, x, shape_BT, f"[B, T] like {like}")
    expect_float(name, x)


def batch_shape(name: str, x: Any) -> tuple[int, int]:
    """(B, T) of a [B, T] array, or ValueError naming it."""
    shape = tuple(jnp.shape(x))
    if len(shape) != 2:
        raise ValueError(f"{name} has shape {shape}; expected rank 2, [B, T].")
    return shape[0], shape[1]
