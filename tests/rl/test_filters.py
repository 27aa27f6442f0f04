"""Keep-masks: group rejection, overlong filtering, RAFT positives, rejected-group fraction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm import rl

# groups of 2: all-right, all-wrong, mixed
CORRECT = jnp.array([True, True, False, False, True, False])


def test_group_predicates():
    np.testing.assert_array_equal(rl.all_correct_groups(CORRECT, 2), [1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(rl.all_wrong_groups(CORRECT, 2), [0, 0, 1, 1, 0, 0])


@pytest.mark.parametrize(
    "rc,rw,want",
    [
        (False, False, [1, 1, 1, 1, 1, 1]),
        (True, False, [0, 0, 1, 1, 1, 1]),
        (False, True, [1, 1, 0, 0, 1, 1]),
        (True, True, [0, 0, 0, 0, 1, 1]),
    ],
)
def test_keep_mask_rejection_variants(rc, rw, want):
    keep = rl.keep_mask(CORRECT, 2, reject_all_correct=rc, reject_all_wrong=rw)
    np.testing.assert_array_equal(keep, want)
    assert keep.dtype == jnp.bool_


def test_overlong_filter_and_combination():
    trunc = jnp.array([False, False, False, False, True, False])
    np.testing.assert_array_equal(rl.overlong_keep_mask(trunc), [1, 1, 1, 1, 0, 1])
    keep = rl.keep_mask(
        CORRECT, 2, reject_all_correct=True, reject_all_wrong=True, truncated_B=trunc
    )
    np.testing.assert_array_equal(keep, [0, 0, 0, 0, 0, 1])


def test_rejected_group_fraction():
    keep = rl.keep_mask(CORRECT, 2, reject_all_correct=True, reject_all_wrong=True)
    assert abs(float(rl.rejected_group_fraction(keep, 2)) - 2.0 / 3.0) < 1e-6
    # A group with one surviving row is not rejected.
    assert float(rl.rejected_group_fraction(jnp.array([True, False, False, False]), 2)) == 0.5


def test_raft_positives_01_rewards():
    r = jnp.array([0.5, 0.9, 0.1, 0.2, 1.0, 1.0])
    c = jnp.array([True, True, False, False, True, True])
    np.testing.assert_array_equal(rl.raft_positives(r, c, 2, select="correct"), [1, 1, 0, 0, 1, 1])
    # best: top reward among correct, ties all kept, all-wrong group has no positive.
    np.testing.assert_array_equal(rl.raft_positives(r, c, 2, select="best"), [0, 1, 0, 0, 1, 1])


def test_raft_positives_pm1_rewards():
    r = jnp.array([1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    c = r > 0
    for sel in ("correct", "best"):
        np.testing.assert_array_equal(rl.raft_positives(r, c, 3, select=sel), [1, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="select='top'"):
        rl.raft_positives(r, c, 3, select="top")


def test_filters_jit_and_singletons():
    f = jax.jit(
        rl.keep_mask, static_argnums=1, static_argnames=("reject_all_correct", "reject_all_wrong")
    )
    np.testing.assert_array_equal(f(CORRECT, 2, reject_all_correct=True), [0, 0, 1, 1, 1, 1])
    # group_size 1: each row is its own group.
    np.testing.assert_array_equal(rl.keep_mask(CORRECT, 1, reject_all_wrong=True), CORRECT)
