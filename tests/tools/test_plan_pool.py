"""The planner's page pool model (jaxrl4llm/planner/pool.py): the cut lognormal's moments and
longest rows against draws, the steady state of a pool and of refilled slots against a
simulation, and one KV budget's figures computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from jaxrl4llm.planner import pool, slots


def _draws(mean: float, p99: float, cap: int, size: tuple[int, ...], seed: int = 0) -> np.ndarray:
    mu, sigma = slots.fit_lognormal(mean, p99)
    return np.minimum(np.random.default_rng(seed).lognormal(mu, sigma, size), cap)


def test_the_cut_lognormals_moments_and_longest_rows_match_draws():
    mean, p99, cap = 2048, 8192, 6000
    lengths = pool.Lengths.fit(mean, p99, cap)
    x = _draws(mean, p99, cap, (2_000_000,))
    assert lengths.mean == pytest.approx(x.mean(), rel=0.005)
    assert lengths.moment(2) == pytest.approx(np.mean(x**2), rel=0.01)
    assert lengths.tau == pytest.approx(np.mean(x**2) / (2 * x.mean()), rel=0.01)
    for n in (1, 8, 256):
        longest = _draws(mean, p99, cap, (20_000, n), seed=n).max(axis=1).mean()
        assert lengths.longest(n) == pytest.approx(longest, rel=0.01)
    # Every row at the profile's single length (mean = p99), or at the cap.
    assert pool.Lengths.fit(1000, 1000, 4000).tau == pytest.approx(500)
    assert pool.Lengths.fit(1000, 1000, 600).moment(2) == pytest.approx(600**2)
    assert pool.Lengths.fit(1000, 1000, 4000).longest(64) == pytest.approx(1000, abs=1)


def _simulate(
    rows_x: np.ndarray, slots_: int, group: int, prompt_pages: int, seed: int = 0
) -> tuple[int, float]:
    """Groups admitted whole while `slots_` rows have room; each step every live row decodes
    a token. Returns (decode steps, mean pages held per live row while the queue waits),
    a row holding ceil((r + t) / 16) pages at position t (r of its prompt's tail tokens,
    1..16) and its group holding the prompt's full pages until its last row ends."""
    tails = np.random.default_rng(seed).integers(1, 17, len(rows_x) // group)
    lengths = np.maximum(1, np.round(rows_x)).astype(int).reshape(-1, group)
    pos, length = np.zeros(slots_, int), np.zeros(slots_, int)
    grp, alive = np.zeros(slots_, int), np.zeros(slots_, bool)
    queued, steps, held, live_rows = 0, 0, 0.0, 0
    while alive.any() or queued < len(lengths):
        while (~alive).sum() >= group and queued < len(lengths):
            free = np.flatnonzero(~alive)[:group]
            pos[free], length[free], grp[free] = 0, lengths[queued], queued
            alive[free] = True
            queued += 1
        if queued < len(lengths):  # the queue waits: steady state
            held += prompt_pages * len(np.unique(grp[alive]))
            held += np.sum(-(-(tails[grp[alive]] + pos[alive]) // 16))
            live_rows += alive.sum()
        pos += 1
        alive &= pos < length
        steps += 1
    return steps, held / live_rows


def test_steady_state_pages_and_steps_match_a_simulation():
    mean, p99, cap, group, P = 300, 2000, 1024, 8, 256
    lengths = pool.Lengths.fit(mean, p99, cap)
    x = _draws(mean, p99, cap, (8, 2048), seed=3)
    runs = [_simulate(row, 64, group, P // 16, seed=i) for i, row in enumerate(x)]
    steps, held = np.mean(runs, axis=0)
    s = pool.Setup(2048, group, P, cap, 1, 1.0, 0.0, 0.0, 1.0, 1.0)
    assert pool.pool_pages_per_row(s, lengths)[0] == pytest.approx(held, rel=0.03)
    assert pool.continuous_steps(lengths, 2048, 64, group) == pytest.approx(steps, rel=0.02)
    # Rows refilled one at a time run nearer full: fewer steps.
    assert pool.continuous_steps(lengths, 2048, 64) < 0.95 * steps
    # One row per slot, one slot: the rows' lengths one after another.
    assert pool.continuous_steps(lengths, 4096, 1) == pytest.approx(4096 * lengths.mean)
    assert pool.continuous_steps(lengths, 64, 64) == lengths.longest(64)


def test_a_kv_budgets_figures_by_hand():
    """Every row 1600 tokens (mean = p99), at most 3200; 320-token prompts in groups of 4,
    2 data-parallel shards, 1000 bytes per token, 10,000 pages of 16 per shard."""
    # 512 rows, 1 GB of weights and 2 GFLOP per row a decode step, 1 PFLOP/s, 1 TB/s.
    s = pool.Setup(512, 4, 320, 3200, 2, 1000.0, 1e9, 2e9, 1e15, 1e12)
    c = pool.column(s, pool.Lengths.fit(1600, 1600, 3200), 10_000 * 16 * 1000.0, growth=0.3)
    # A full-length row: ceil(3520 / 16) = 220 pages; 10,000 // 220 = 45 per shard. The
    # fixed batch's chunk divides 512 rows in whole groups over 2 shards: 64 rows.
    assert (c.pages, c.slots, c.batch_rows, c.chunks) == (10_000, 90, 64, 8)
    assert c.batch_steps == pytest.approx(8 * 1600)
    # Live rows sit at 800 on average: 1 + 800 / 16 pages, and the prompt's 20 pages over a
    # group of 4 rows that all live 1600 steps; to go (3200 - 800) / 16 + 1.5.
    assert (c.held, c.rest) == pytest.approx((56.0, 151.5))
    per_row = 56.0 + 0.3 * 151.5  # 101.45: 98 rows per shard
    assert c.pool_rows == 196
    # Refilled slots: full for 512 x 1600 / S steps less the mean rest 800, then the
    # longest of S rests uniform on [0, 1600]: 1600 S / (S + 1).
    assert c.slot_steps == pytest.approx(512 * 1600 / 90 - 800 + 1600 * 90 / 91, rel=1e-3)
    # The pool admits groups of 4: 1.5 of its rows wait for room on average.
    assert c.pool_steps == pytest.approx(512 * 1600 / 194.5 - 800 + 1600 * 196 / 197, rel=1e-3)
    # HBM-bound steps: 1 GB of weights + rows per shard x context x 1000 bytes, at 1 TB/s.
    batch_step = (1e9 + 32 * (320 + 800) * 1000) / 1e12
    live_step = (1e9 + 45 * (320 + 800) * 1000) / 1e12
    pool_step = (1e9 + 98 * (320 + 800) * 1000) / 1e12
    assert c.batch_seconds == pytest.approx(12800 * batch_step)
    assert c.slot_seconds == pytest.approx(c.slot_steps * live_step)
    assert c.pool_seconds == pytest.approx(c.pool_steps * pool_step)
    assert c.pool_bytes == 10_000 * 16 * 1000
    assert c.all_rows_bytes == pytest.approx(256 * per_row * 16 * 1000)


def test_a_budget_below_a_row_or_a_group_holds_nothing():
    s = pool.Setup(64, 8, 64, 1024, 1, 100.0, 1e9, 2e9, 1e15, 1e12)
    lengths = pool.Lengths.fit(200, 900, 1024)
    # A full-length row is 68 pages; a group at full length 4 + 8 x 65 = 524.
    small = pool.column(s, lengths, 67 * 1600.0)
    assert (small.slots, small.pool_rows) == (0, 0)
    assert math.isinf(small.batch_seconds) and math.isinf(small.pool_seconds)
    row_not_group = pool.column(s, lengths, 523 * 1600.0)
    assert (row_not_group.slots, row_not_group.batch_rows, row_not_group.pool_rows) == (7, 0, 0)
    rich = pool.column(s, lengths, 1e6 * 1600.0)
    assert (rich.slots, rich.pool_rows) == (64, 64)
    assert rich.pool_steps == rich.slot_steps == lengths.longest(64)
