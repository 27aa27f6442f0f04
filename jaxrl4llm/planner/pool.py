"""The page pool's rows, memory and rollout time from a completion length profile
(tools/plan.py --completion_mean / --completion_p99), against fixed slots and a fixed batch
in the same KV memory.

Lengths. A completion's length L is the lognormal slots.fit_lognormal fits to the profile's
mean and p99, cut at N = max_new_tokens (a row stops there); continuous (not rounded up to
whole tokens: at most a token more). With Phi the standard normal CDF, a = (ln N - mu) / sigma:

  E[L^k] = exp(k mu + k^2 sigma^2 / 2) Phi(a - k sigma) + N^k (1 - Phi(a))
  E[longest of n rows] = M(n) = int_0^N (1 - F(x)^n) dx        (F the cut CDF)

integrated by the midpoint rule on GRID points.

Memory, per device. A token's keys and values take k = 2 n K H kv / T_kv bytes (n layers, K kv
heads of H, kv the cache dtype's bytes, T_kv the tensor shards of the heads: estimate.py); a
page holds PS = paged.PAGE_SIZE tokens. A KV budget of M bytes is M // (PS k) pages per
data-parallel shard (dp shards; each holds its own rows), so:

  fixed batch, fixed slots   S = dp (pages // pages_for(P + N)): every row or slot is a
                             full-length cache row (P the prompt bucket); the batch's chunk
                             is the largest --rollout_micro_batch allows up to S
  page pool                  R = min(B, dp (pages // (u + growth r))), in steady state (groups
                             waiting, admitted as rows end). By Little's law the pages held per
                             live row are the page-steps a row holds over its life / its steps:
      u = 1 + tau / PS + Pp M(G) / (G E[L])   held: a row at position t holds 1 + t / PS
          pages (its copy of the prompt's last partial page and the pages its t tokens fill,
          a half page of rounding each on average); a row of length L is live for L steps at
          positions uniform over them, so a live row's mean position is length-biased:
          tau = E[L^2] / (2 E[L]). The prompt's Pp = P // PS full pages are held once per group
          of G, until its longest row ends: M(G) steps against the G E[L] row-steps.
      r = (N - tau) / PS + 1.5   the pages a live row could still fill up to its cap
          (pages_for(N - t) + 1, paged_state.fits), of which admission keeps `growth` free:
          paged_state.GROWTH_START; each preemption raises it, and fewer rows are admitted.

Time. Decode steps of the B rows of a training step:

  fixed batch   B / C chunks of C rows, each run to its longest row: B / C M(C); every row of
                a chunk decodes every step (no compaction on a mesh), at context P + M(C) / 2
  fixed slots   (and the pool, with R for S) a slot takes the next row when its row ends: the
                slots stay full for B E[L] / S steps less the rows in flight's mean rest tau,
                then drain for the longest rest of S rows, int_0^N (1 - Fe(x)^S) dx with
                Fe(x) = int_0^x (1 - F) / E[L] (a row in flight's rest, renewal theory); S >= B:
                M(B). The live rows sit at context P + tau. The pool admits whole groups, so
                while they wait (G - 1) / 2 of its R rows are free on average: B E[L] / (R -
                (G - 1) / 2) steps at full.

A decode step of b rows per device at context c costs the roofline of estimate.py's rollout:
max(2 Nb b / T / peak FLOP/s, (Nb s / T + b c k) / HBM bandwidth), the weights read once per
step. Prefill, the weights' gathers and the drain's fewer rows are left out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from typing import TYPE_CHECKING

import numpy as np

from jaxrl4llm.planner import slots
from jaxrl4llm.sampling import page_pool, paged, paged_state
from jaxrl4llm.sampling.page_pool import pages_for

if TYPE_CHECKING:
    from jaxrl4llm.planner.programs import Plan

GRID = 8192
_PHI = statistics.NormalDist().cdf


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Completion lengths: the lognormal (mu, sigma) cut at `cap` tokens."""

    mu: float
    sigma: float
    cap: int

    @classmethod
    def fit(cls, mean: float, p99: float, cap: int) -> Lengths:
        return cls(*slots.fit_lognormal(mean, p99), cap)

    def moment(self, k: int) -> float:
        """E[L^k] of the cut lengths (closed form: the module docstring)."""
        mu, sigma, cap = self.mu, self.sigma, self.cap
        if sigma == 0:
            return min(math.exp(mu), cap) ** k
        a = (math.log(cap) - mu) / sigma
        below = math.exp(k * mu + (k * sigma) ** 2 / 2) * _PHI(a - k * sigma)
        return below + cap**k * (1 - _PHI(a))

    @property
    def mean(self) -> float:
        return self.moment(1)

    @property
    def tau(self) -> float:
        """A live row's mean position: E[L^2] / (2 E[L])."""
        return self.moment(2) / (2 * self.moment(1))

    @functools.cached_property
    def _grid(self) -> tuple[np.ndarray, float]:
        """(F at the midpoints of GRID cells of [0, cap], the cell width)."""
        dx = self.cap / GRID
        x = (np.arange(GRID) + 0.5) * dx
        if self.sigma == 0:
            return (x >= math.exp(self.mu)).astype(float), dx
        z = (np.log(x) - self.mu) / self.sigma
        return np.array([_PHI(v) for v in z]), dx

    def longest(self, n: int) -> float:
        """M(n): the expected longest of n rows."""
        cdf, dx = self._grid
        return float(np.sum(1 - cdf**n) * dx)

    def longest_rest(self, n: int) -> float:
        """The expected longest rest of n rows in flight (Fe: the module docstring)."""
        cdf, dx = self._grid
        rest_cdf = np.minimum(np.cumsum(1 - cdf) * dx / self.mean, 1.0)
        return float(np.sum(1 - rest_cdf**n) * dx)


@dataclasses.dataclass(frozen=True)
class Setup:
    """The rollout's numbers the pool model reads (per device where it says bytes)."""

    rows: int  # B: rows per training step
    group: int  # G: rows sharing a prompt's pages (1 without --share_prompts)
    prompt: int  # P: the prompt bucket
    max_new_tokens: int  # N
    shards: int  # dp: data-parallel shards, each with its own rows
    token_bytes: float  # k: one token's keys and values
    weight_bytes: float  # Nb s / T: the weights a decode step reads
    row_flops: float  # 2 Nb / T: matmul FLOPs of one row's decode step
    peak_flops: float
    hbm_bw: float

    def step_seconds(self, rows: float, context: float) -> float:
        """One decode step of `rows` rows (all shards) at `context` tokens (roofline)."""
        b = rows / self.shards
        hbm = (self.weight_bytes + b * context * self.token_bytes) / self.hbm_bw
        return max(self.row_flops * b / self.peak_flops, hbm)

    @property
    def page_bytes(self) -> float:
        return paged.PAGE_SIZE * self.token_bytes

    @property
    def row_pages(self) -> int:
        """A full-length row's pages."""
        return pages_for(self.prompt + self.max_new_tokens, paged.PAGE_SIZE)


@dataclasses.dataclass(frozen=True)
class Column:
    """The figures of one KV budget (bytes per device); seconds are decode roofline time."""

    kv_bytes: float
    slots: int  # S: the full-length rows it holds (fixed slots), all shards
    batch_rows: int  # the fixed batch's chunk: S or fewer, as --rollout_micro_batch takes
    chunks: int
    batch_steps: float
    batch_seconds: float
    slot_steps: float
    slot_seconds: float
    pages: int  # the pool's pages per shard
    held: float  # u: pages held per live row
    rest: float  # r: pages a live row could still fill
    pool_rows: int  # R: live rows the pool admits, all shards
    pool_steps: float
    pool_seconds: float
    pool_bytes: float  # per device: the pool's pages
    all_rows_bytes: float  # per device: the pool that admits all B rows at once


def batch_rows(s: Setup, rows: int) -> int:
    """The largest chunk of at most `rows` rows --rollout_micro_batch allows: it divides the
    step's rows and is a multiple of the group and the data-parallel shards (0: none)."""
    ok = (R for R in range(rows, 0, -1) if s.rows % R == 0 and R % s.group == 0)
    return next((R for R in ok if R % s.shards == 0), 0)


def continuous_steps(lengths: Lengths, rows: int, slots: int, group: int = 1) -> float:
    """Decode steps of `rows` rows in `slots` slots refilled as rows end, `group` rows at a
    time (the docstring)."""
    if slots >= rows:
        return lengths.longest(rows)
    busy = max(1.0, slots - (group - 1) / 2)
    return rows * lengths.mean / busy - lengths.tau + lengths.longest_rest(slots)


def pool_pages_per_row(s: Setup, lengths: Lengths) -> tuple[float, float]:
    """(u, r): the pages a live row holds, and those it could still fill up to its cap."""
    ps = paged.PAGE_SIZE
    prompt = s.prompt // ps * lengths.longest(s.group) / (s.group * lengths.mean)
    held = 1 + lengths.tau / ps + prompt
    return held, (s.max_new_tokens - lengths.tau) / ps + 1.5


def column(
    s: Setup, lengths: Lengths, kv_bytes: float, growth: float = paged_state.GROWTH_START
) -> Column:
    """Fixed batch, fixed slots and page pool in `kv_bytes` of KV per device."""
    B, P, N = s.rows, s.prompt, s.max_new_tokens
    pages = int(max(kv_bytes, 0) // s.page_bytes)
    S = min(B, s.shards * (pages // s.row_pages))
    batch = batch_rows(s, S)
    chunks = B // batch if batch else 0
    batch_steps = chunks * lengths.longest(batch) if batch else math.inf
    batch_step = s.step_seconds(batch, P + lengths.longest(batch) / 2) if batch else 0.0
    live = P + lengths.tau
    slot_steps = continuous_steps(lengths, B, S) if S else math.inf
    held, rest = pool_pages_per_row(s, lengths)
    per_row = held + growth * rest
    fits_group = pages >= page_pool.min_pool_pages(P, N, s.group, paged.PAGE_SIZE)
    R = min(B, s.shards * int(pages // per_row)) if fits_group else 0
    pool_steps = continuous_steps(lengths, B, R, s.group) if R else math.inf
    return Column(
        kv_bytes=kv_bytes,
        slots=S,
        batch_rows=batch,
        chunks=chunks,
        batch_steps=batch_steps,
        batch_seconds=batch_steps * batch_step if batch else math.inf,
        slot_steps=slot_steps,
        slot_seconds=slot_steps * s.step_seconds(S, live) if S else math.inf,
        pages=pages,
        held=held,
        rest=rest,
        pool_rows=R,
        pool_steps=pool_steps,
        pool_seconds=pool_steps * s.step_seconds(R, live) if R else math.inf,
        pool_bytes=pages * s.page_bytes,
        all_rows_bytes=B / s.shards * per_row * s.page_bytes,
    )


def setup(plan: Plan) -> Setup:
    """The pool model's numbers of a plan's rollout (its hand estimate's symbols)."""
    est, chip = plan.estimate, plan.topology.chip
    m, r = est.m, est.c.rollout
    return Setup(
        rows=plan.rollout.rows,
        group=r.group_size if r.share_prompts else 1,
        prompt=est.P,
        max_new_tokens=est.N,
        shards=est.dp,
        token_bytes=2 * m.num_layers * m.num_kv_heads * m.head_dim * est.kv / est.T_kv,
        weight_bytes=est.Nb * est.s / est.T,
        row_flops=2 * est.Nb / est.T,
        peak_flops=chip.peak_flops,
        hbm_bw=chip.hbm_bw,
    )


def budgets(plan: Plan, s: Setup, device_budget: float) -> dict[str, float]:
    """KV bytes per device: the flagfile's page pool (--kv_cache_tokens, by default the rows
    decoding at once at full length: page_pool.pool_pages, as the sampler sizes it) and the
    chip's (the device budget less the compiled rollout's memory but its KV)."""
    r = plan.estimate.c.rollout
    decoding = paged.shard_decode_rows(r.rollout_micro_batch, s.shards, s.group)
    local = s.rows // s.shards
    pages = page_pool.pool_pages(
        r.pool_tokens, local, s.prompt, s.max_new_tokens, s.group, decoding
    )
    flagfile = pages * s.page_bytes
    rollout = next(row for row in plan.rows if row.program == "rollout")
    return {"flagfile": flagfile, "chip": max(0.0, device_budget - rollout.total + flagfile)}
