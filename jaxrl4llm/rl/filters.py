"""Keep-masks over rows [B]: group rejection, overlong filtering, RAFT positives.

Filters read the boolean ``correct_B`` from the verifier, never the float reward (except
RAFT's "best" selection, which ranks by reward). A row with keep = False leaves the loss:
numerator, denominators and batch statistics.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxrl4llm.rl.advantages import to_groups

POSITIVE_SELECTIONS = ("correct", "best")


def _per_row(group_flag_P: jnp.ndarray, group_size: int) -> jnp.ndarray:
    return jnp.repeat(group_flag_P, group_size)


def all_correct_groups(correct_B: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """bool [B]: True where the row's whole group is correct."""
    return _per_row(to_groups(jnp.asarray(correct_B, bool), group_size).all(axis=1), group_size)


def all_wrong_groups(correct_B: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """bool [B]: True where no row of the row's group is correct."""
    return _per_row(~to_groups(jnp.asarray(correct_B, bool), group_size).any(axis=1), group_size)


def group_keep_mask(
    correct_B: jnp.ndarray,
    group_size: int,
    *,
    reject_all_correct: bool = False,
    reject_all_wrong: bool = False,
    valid_B: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """bool [B]: False for rows of rejected groups (all-correct and/or all-wrong).

    valid_B: the rows that judge their group (others, e.g. unverified, count as neither).
    """
    correct = jnp.asarray(correct_B, bool)
    valid = jnp.ones(correct.shape, bool) if valid_B is None else jnp.asarray(valid_B, bool)
    keep = jnp.ones(correct.shape, bool)
    if reject_all_correct:
        keep &= ~all_correct_groups(correct | ~valid, group_size)
    if reject_all_wrong:
        keep &= ~all_wrong_groups(correct & valid, group_size)
    return keep


def overlong_keep_mask(truncated_B: jnp.ndarray) -> jnp.ndarray:
    """bool [B]: False for samples that hit max_new_tokens without a stop token."""
    return ~jnp.asarray(truncated_B, bool)


def keep_mask(
    correct_B: jnp.ndarray,
    group_size: int,
    *,
    reject_all_correct: bool = False,
    reject_all_wrong: bool = False,
    truncated_B: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """bool [B]: group rejection AND (when truncated_B is given) overlong filtering."""
    keep = group_keep_mask(
        correct_B,
        group_size,
        reject_all_correct=reject_all_correct,
        reject_all_wrong=reject_all_wrong,
    )
    if truncated_B is not None:
        keep &= overlong_keep_mask(truncated_B)
    return keep


def rejected_group_fraction(keep_B: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """Scalar float: fraction of groups none of whose rows is kept."""
    kept_any_P = to_groups(jnp.asarray(keep_B, bool), group_size).any(axis=1)
    return 1.0 - kept_any_P.astype(jnp.float32).mean()


def raft_positives(
    rewards_B: jnp.ndarray,
    correct_B: jnp.ndarray,
    group_size: int,
    *,
    select: str = "correct",
) -> jnp.ndarray:
    """bool [B]: the samples RAFT / RAFT++ train on.

    select="correct": every correct sample (RAFT++, and RAFT with binary rewards).
    select="best": the correct samples whose reward is the highest of their group (ties all
    kept), i.e. RAFT's "best of n". With binary {0,1} or {-1,1} rewards both selections agree.
    """
    if select not in POSITIVE_SELECTIONS:
        raise ValueError(f"select={select!r} is not one of {POSITIVE_SELECTIONS}.")
    correct = jnp.asarray(correct_B, bool)
    if select == "correct":
        return correct
    r_PG = to_groups(jnp.asarray(rewards_B, jnp.float32), group_size)
    is_max_PG = r_PG >= r_PG.max(axis=1, keepdims=True)
    return is_max_PG.reshape(-1) & correct
