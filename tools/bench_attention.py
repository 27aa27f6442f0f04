"""Time of the chunked attention kernel's forward and backward passes with its block skipping
(masks.block_visibility) against the same kernel computing every block pair, in one run.

    python tools/bench_attention.py                       # causal rows of 2048 and 4096 keys
    python tools/bench_attention.py --packed=tail10       # and bench_packed_update's rows

SmolLM2-135M's heads (9 query heads, 3 kv heads, head_dim 64), float32, random queries, keys
and values. Causal: one row per --lengths entry, every key real (the sampler's prefill and
the padded passes at long contexts). Packed (--packed=MIX): the first micro-batch that
packing.pack makes of bench_packed_update's synthetic mini-batch for that length mix (its
segment and prefix ids). Prints per case the block pairs computed of all and the seconds of
both (the fastest of --repeats after a compiling run), and their ratio.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _parse(argv: Any) -> Any:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--packed", choices=("none", "step0", "tail10"), default="none")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1 or any(n < 2 for n in args.lengths):
        parser.error(f"--repeats={args.repeats} --lengths={args.lengths}: need >= 1 and >= 2.")
    return args


def packed_rows(mix: str) -> tuple[np.ndarray, np.ndarray]:
    """(segments, prefixes) [R, L] of the first packed micro-batch of bench_packed_update's
    mini-batch for `mix` (the full SmolLM2 FLOP model chooses the plan)."""
    from jaxrl4llm.models import registry
    from jaxrl4llm.train.update import packing
    from tools import bench_packed_update

    args = bench_packed_update._parse([f"--length_mix={mix}"])
    config = registry.load_model(bench_packed_update.MODEL, dtype=jnp.float32)[0]
    seqs = bench_packed_update.synthetic_sequences(args, config.vocab_size)
    packed = packing.pack(seqs, args.micro_batch_tokens, flops=packing.SlotFlops.of(config))
    return np.asarray(packed.segments_KRL[0]), np.asarray(packed.prefixes_KRL[0])


def time_kernel(
    key_valid_BS: jax.Array, prefixes_BT: jax.Array | None, skip: bool, repeats: int
) -> float:
    """Seconds of value_and_grad of the summed chunked attention (fastest of `repeats`)."""
    from jaxrl4llm.models import attention

    B, S = key_valid_BS.shape
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, S, HEADS, HEAD_DIM)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, KV_HEADS, HEAD_DIM, S)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, KV_HEADS, S, HEAD_DIM)), jnp.float32)
    config = attention.AttentionConfig("chunked", skip_blocks=skip)

    def total(q, k, v):
        out = attention.attention(q, k, v, key_valid_BS, 0, config, query_prefix_BT=prefixes_BT)
        return out.sum()

    step = jax.jit(jax.value_and_grad(total, argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    return min(times)


def report(name: str, key_valid_BS: jax.Array, prefixes_BT: jax.Array | None, repeats: int) -> None:
    from jaxrl4llm.models import attention, masks

    segmented = masks.is_segmented(key_valid_BS)
    block = min(attention.AttentionConfig().blocks(segmented)[0], key_valid_BS.shape[1])
    ids = masks.query_segments(key_valid_BS, key_valid_BS.shape[1], 0, prefixes_BT)
    table = masks.block_visibility(key_valid_BS, ids, 0, block, block, None)
    times = [time_kernel(key_valid_BS, prefixes_BT, skip, repeats) for skip in (True, False)]
    print(
        f"{name}: blocks of {block}, {int(table.sum())} of {table.size} block pairs computed; "
        f"skipping {times[0]:.3f} s, every pair {times[1]:.3f} s, ratio {times[0] / times[1]:.3f}",
        flush=True,
    )


def main(argv: Any = None) -> int:
    args = _parse(argv)
    print(f"chunked attention forward + backward, float32, {jax.devices()[0].device_kind}")
    for S in args.lengths:
        report(f"causal, 1 row x {S} keys", jnp.ones((1, S), bool), None, args.repeats)
    if args.packed != "none":
        segments, prefixes = packed_rows(args.packed)
        R, L = segments.shape
        name = f"packed {args.packed}, {R} rows x {L}"
        report(name, jnp.asarray(segments), jnp.asarray(prefixes), args.repeats)
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
