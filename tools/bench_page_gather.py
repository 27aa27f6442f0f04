"""What reading a row's KV pages costs the paged engine's reference decode attention off TPU,
against the dense cache the compacted sampler reads, per layer and decode step.

    python tools/bench_page_gather.py                  # SmolLM2's heads, 128 rows x 8 pages
    python tools/bench_page_gather.py --rows=32 --pages=64

One layer's decode attention (one query per row over its M pages of 16 tokens) four ways:
  dense     no pages: the keys [S, K, H, L] and values [S, K, L, H] as a dense cache holds them
  engine    sampling/page_pool.py's reference: keys gathered and transposed to [S, K, H, L]
            (the layout the score matmul takes), values gathered as [S, K, L, H]
  keys_lh   keys gathered like the values ([S, K, L, H], no transpose): the score matmul then
            contracts the minor axis of both operands
  pool_hp   a pool holding keys head-dim first ([K, N, H, page]) and values as the engine's,
            each gathered by one XLA gather straight into the layout the matmuls take
            ([S, K, H, M, page] and [S, K, M, page, H]: no transpose after it); the Pallas
            kernel's pool holds keys [K, N, page, H]
Printed per variant: the best of --repeats timings of the gather alone (none for dense) and
of the whole attention, in ms; every variant's output is checked against `dense` first.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli  # noqa: E402

PAGE = 16


def _inputs(rows: int, pages: int, kv_heads: int, groups: int, head_dim: int) -> dict[str, Any]:
    """Random pages, a table of distinct random pages per row, queries, and the same keys
    and values as a dense cache."""
    rng = np.random.default_rng(0)
    num_pages = rows * pages + 1
    k_KNPH = rng.standard_normal((kv_heads, num_pages, PAGE, head_dim), np.float32)
    v_KNPH = rng.standard_normal((kv_heads, num_pages, PAGE, head_dim), np.float32)
    table_SM = rng.permutation(num_pages - 1)[: rows * pages].reshape(rows, pages)
    S, L = rows, pages * PAGE
    k_SKHL = k_KNPH[:, table_SM].transpose(1, 0, 4, 2, 3).reshape(S, kv_heads, head_dim, L)
    v_SKLH = v_KNPH[:, table_SM].transpose(1, 0, 2, 3, 4).reshape(S, kv_heads, L, head_dim)
    arrays = dict(
        k_KNPH=k_KNPH,
        v_KNPH=v_KNPH,
        k_KNHP=np.ascontiguousarray(k_KNPH.transpose(0, 1, 3, 2)),
        table_SM=table_SM.astype(np.int32),
        q_SKGH=rng.standard_normal((S, kv_heads, groups, head_dim), np.float32),
        k_SKHL=k_SKHL,
        v_SKLH=v_SKLH,
    )
    return {name: jnp.asarray(a) for name, a in arrays.items()}


def _attend(q_SKGH: jax.Array, k: jax.Array, v_SKLH: jax.Array, keys: str) -> jax.Array:
    scores = jnp.einsum(f"skgh,{keys}->skgl", q_SKGH, k)
    return jnp.einsum("skgl,sklh->skgh", jax.nn.softmax(scores, axis=-1), v_SKLH)


def _pages_gathered(pages: jax.Array, table_SM: jax.Array, offset_dims: tuple) -> jax.Array:
    """One XLA gather of the rows' pages of a [K, N, a, b] pool, laid out as `offset_dims`
    place K, a and b among the row and page axes (S first, M where the others leave room)."""
    K, _, a, b = pages.shape
    numbers = jax.lax.GatherDimensionNumbers(
        offset_dims=offset_dims, collapsed_slice_dims=(1,), start_index_map=(1,)
    )
    return jax.lax.gather(
        pages, table_SM[..., None], numbers, (K, 1, a, b), mode="promise_in_bounds"
    )


def _values(x: dict[str, Any], variant: str) -> jax.Array:
    S, M = x["table_SM"].shape
    K, _, _, H = x["v_KNPH"].shape
    if variant == "pool_hp":  # [S, K, M, page, H] straight from the gather
        return _pages_gathered(x["v_KNPH"], x["table_SM"], (1, 3, 4)).reshape(S, K, -1, H)
    return x["v_KNPH"][:, x["table_SM"]].transpose(1, 0, 2, 3, 4).reshape(S, K, M * PAGE, H)


def _keys(x: dict[str, Any], variant: str) -> jax.Array:
    """The gathered keys of `variant` (module docstring)."""
    S, M = x["table_SM"].shape
    K, _, _, H = x["k_KNPH"].shape
    if variant == "dense":
        return x["k_SKHL"]
    if variant == "engine":
        k = x["k_KNPH"][:, x["table_SM"]].transpose(1, 0, 4, 2, 3)
        return k.reshape(S, K, H, M * PAGE)
    if variant == "keys_lh":
        return x["k_KNPH"][:, x["table_SM"]].transpose(1, 0, 2, 3, 4).reshape(S, K, M * PAGE, H)
    # [S, K, H, M, page] straight from the gather
    return _pages_gathered(x["k_KNHP"], x["table_SM"], (1, 2, 4)).reshape(S, K, H, M * PAGE)


def _programs(variant: str) -> tuple[Callable, Callable]:
    """(gather alone, the whole attention) of `variant`, compiled."""
    layout = "sklh" if variant == "keys_lh" else "skhl"

    def gather(x: dict[str, Any]) -> Any:
        return (_keys(x, variant), x["v_SKLH"] if variant == "dense" else _values(x, variant))

    def attention(x: dict[str, Any]) -> jax.Array:
        k, v = gather(x)
        return _attend(x["q_SKGH"], k, v, layout)

    return jax.jit(gather), jax.jit(attention)


def _best_ms(fn: Callable, x: dict[str, Any], repeats: int) -> float:
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


VARIANTS = ("dense", "engine", "keys_lh", "pool_hp")


def run(rows: int, pages: int, kv_heads: int, groups: int, head_dim: int, repeats: int) -> dict:
    """{variant: (gather ms, attention ms)}, after checking each variant against dense."""
    x = _inputs(rows, pages, kv_heads, groups, head_dim)
    programs = {v: _programs(v) for v in VARIANTS}
    reference = np.asarray(programs["dense"][1](x))
    out = {}
    for variant, (gather, attention) in programs.items():
        np.testing.assert_allclose(np.asarray(attention(x)), reference, rtol=1e-5, atol=1e-5)
        gather_ms = 0.0 if variant == "dense" else _best_ms(gather, x, repeats)
        out[variant] = (gather_ms, _best_ms(attention, x, repeats))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--pages", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=3)  # SmolLM2-135M: 3 kv heads of 64,
    parser.add_argument("--groups", type=int, default=3)  # 9 query heads
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    a = parser.parse_args(argv)
    results = run(a.rows, a.pages, a.kv_heads, a.groups, a.head_dim, a.repeats)
    print(f"{a.rows} rows x {a.pages} pages of {PAGE}, device {jax.devices()[0].platform}")
    for variant, (gather_ms, attention_ms) in results.items():
        print(f"{variant:8s} gather_ms={gather_ms:.3f} attention_ms={attention_ms:.3f}")
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
