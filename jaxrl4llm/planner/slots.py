"""Slot utilisation of the rollout from a completion length profile (tools/plan.py).

The model: completion lengths are lognormal, fitted to the profile's mean m and 99th
percentile q (ln L ~ Normal(mu, sigma^2) with exp(mu + sigma^2 / 2) = m and
exp(mu + z99 sigma) = q, z99 = 2.326: sigma = z99 - sqrt(z99^2 - 2 ln(q / m)), the root
below z99; q / m may be at most exp(z99^2 / 2) = 15.0), rounded up to whole tokens and cut at
max_new_tokens (a row stops there). R rows per training step decode in S slots:

  fixed batch   the rows run in R / S batches of S (the sampler's row chunks); a batch decodes
                until its longest row is done, so it costs S x (its longest row) slot-steps.
                (The sampler's halving compaction, off on a mesh, is not modelled.)
  continuous    a slot takes the next row as soon as its row is done (rows in order, to the
                slot free first); the slots are full until the rows run out, then drain: the
                tail is the in-flight rows' longest rest. Refill costs (prefill) are left out.

Utilisation = the rows' tokens / (S x the decode steps run). Both are averaged over `draws`
Monte Carlo draws of the R lengths from a fixed seed, so a plan prints the same figures.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics

import numpy as np

Z99 = statistics.NormalDist().inv_cdf(0.99)


def fit_lognormal(mean: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the lognormal with this mean and 99th percentile (see the docstring)."""
    if not 0 < mean <= p99:
        raise ValueError(
            f"--completion_mean={mean:g} --completion_p99={p99:g}: need 0 < mean <= p99 (tokens)."
        )
    gap = Z99**2 - 2 * math.log(p99 / mean)
    if gap < 0:
        raise ValueError(
            f"--completion_mean={mean:g} --completion_p99={p99:g}: a lognormal's "
            f"p99 is at most {math.exp(Z99**2 / 2):.1f}x its mean; raise the "
            "mean or lower the p99."
        )
    sigma = Z99 - math.sqrt(gap)
    return math.log(mean) - sigma**2 / 2, sigma


def sample_lengths(
    mean: float, p99: float, max_new_tokens: int, size: tuple[int, ...], seed: int = 0
) -> np.ndarray:
    """Whole-token lengths in [1, max_new_tokens] from the fitted lognormal."""
    mu, sigma = fit_lognormal(mean, p99)
    draws = np.random.default_rng(seed).lognormal(mu, sigma, size)
    return np.clip(np.ceil(draws), 1, max_new_tokens).astype(np.int64)


def fixed_batch_steps(lengths: np.ndarray, slots: int) -> int:
    """Decode steps of consecutive batches of `slots` rows, each run to its longest row."""
    return int(sum(lengths[i : i + slots].max() for i in range(0, len(lengths), slots)))


def continuous_steps(lengths: np.ndarray, slots: int) -> int:
    """Decode steps until every row is done when each slot takes the next row on finishing."""
    free = [0] * min(slots, len(lengths))  # the step each slot's row is done
    for length in lengths:
        heapq.heappush(free, heapq.heappop(free) + int(length))
    return max(free)


@dataclasses.dataclass(frozen=True)
class SlotUse:
    """Means over the draws: decode steps per training step and the slots' useful share."""

    mean_tokens: float  # tokens per row, after the max_new_tokens cut
    fixed_steps: float
    continuous_steps: float
    fixed_utilisation: float
    continuous_utilisation: float


def slot_use(
    mean: float,
    p99: float,
    max_new_tokens: int,
    rows: int,
    slots: int,
    draws: int = 16,
    seed: int = 0,
) -> SlotUse:
    lengths = sample_lengths(mean, p99, max_new_tokens, (draws, rows), seed)
    fixed = np.array([fixed_batch_steps(x, slots) for x in lengths], float)
    continuous = np.array([continuous_steps(x, slots) for x in lengths], float)
    tokens = lengths.sum(axis=1)
    return SlotUse(
        float(lengths.mean()),
        float(fixed.mean()),
        float(continuous.mean()),
        float(np.mean(tokens / (slots * fixed))),
        float(np.mean(tokens / (slots * continuous))),
    )
