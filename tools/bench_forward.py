"""Benchmark: forward and forward+backward of SmolLM2-135M against this machine's matmul peak.

    python tools/bench_forward.py --batch=8 --seq_len=256

Measures, in one run on one machine: the peak matmul FLOP/s of a big jnp.dot (bfloat16 and
float32 inputs, float32 accumulation), then tokens/s and achieved FLOP/s of a jitted forward
(logits -> mean target log-prob, as the trainer uses it) and of forward+backward (its
gradient w.r.t. all params), with float32 and bfloat16 params, with and without per-layer
remat. FLOPs are counted analytically (transformer.forward_flops: 2 * matmul MACs, causal
attention counted in full since it is computed in full; backward = 2 x forward, remat adds
one forward). Params are random (speed does not depend on values).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.typing import DTypeLike

from jaxrl4llm.config import cli
from jaxrl4llm.config.options import require
from jaxrl4llm.models import transformer as T
from jaxrl4llm.models.config import PRESETS

flags.DEFINE_string("model", "smollm2-135m", f"config preset: {sorted(PRESETS)}")
flags.DEFINE_integer("batch", 8, "rows per step")
flags.DEFINE_integer("seq_len", 256, "tokens per row")
flags.DEFINE_integer("matmul_size", 2048, "side of the square matmul that measures peak")
flags.DEFINE_integer("repeats", 2, "timed calls per measurement (the best one counts)")
FLAGS = flags.FLAGS


def _best_time(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def peak_matmul_flops(dtype: DTypeLike, n: int, repeats: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(dtype)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / _best_time(dot, a, b, repeats=repeats)


def _loss(params, config, tokens_BT, remat):
    mask_BT = jnp.ones(tokens_BT.shape, bool)
    positions_BT = T.positions_from_mask(mask_BT)
    logits_BTV, _ = T.forward(params, config, tokens_BT, positions_BT, mask_BT, remat=remat)
    logp_BTV = jax.nn.log_softmax(logits_BTV[:, :-1])
    target_BT = tokens_BT[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp_BTV, target_BT[..., None], axis=-1))


def main(argv):
    del argv  # cli.run refuses positional arguments
    require(FLAGS.model in PRESETS, f"--model={FLAGS.model}: choose one of {sorted(PRESETS)}.")
    require(
        min(FLAGS.batch, FLAGS.seq_len, FLAGS.matmul_size, FLAGS.repeats) >= 1,
        "--batch, --seq_len, --matmul_size and --repeats must be >= 1.",
    )
    config = PRESETS[FLAGS.model]
    B, S = FLAGS.batch, FLAGS.seq_len
    print(
        f"device: {jax.devices()[0].device_kind} x{jax.device_count()} "
        f"({jax.default_backend()}); model {FLAGS.model} "
        f"({config.num_params / 1e6:.1f}M params); batch {B} x {S} tokens"
    )
    dtypes = (("bfloat16", jnp.bfloat16), ("float32", jnp.float32))

    def measure_peaks():
        return {
            name: peak_matmul_flops(dt, FLAGS.matmul_size, FLAGS.repeats) for name, dt in dtypes
        }

    peaks = measure_peaks()

    tokens = jax.random.randint(jax.random.key(2), (B, S), 0, config.vocab_size)
    fwd_flops = T.forward_flops(config, B, S)
    forward = jax.jit(_loss, static_argnums=(1, 3))
    grad = jax.jit(jax.value_and_grad(_loss), static_argnums=(1, 3))
    rows = []
    for dtype_name in ("float32", "bfloat16"):
        params = T.init_params(config, jax.random.key(0), jnp.dtype(dtype_name))
        runs = [
            ("forward", forward, False, 1.0),
            ("fwd+bwd", grad, False, 3.0),
            ("fwd+bwd remat", grad, True, 4.0),
        ]
        for label, fn, remat, mult in runs:
            seconds = _best_time(fn, params, config, tokens, remat, repeats=FLAGS.repeats)
            flops = mult * fwd_flops / seconds
            rows.append((label, dtype_name, B * S / seconds, flops, seconds))
        del params

    # Measured again at the end, keeping the best: on a shared machine a busy moment would
    # otherwise depress the peak and flatter the ratios.
    peaks = {k: max(peaks[k], v) for k, v in measure_peaks().items()}
    for name, peak in peaks.items():
        print(
            f"peak matmul ({FLAGS.matmul_size}^3, {name} in, float32 acc, best of start/end): "
            f"{peak / 1e9:.1f} GFLOP/s"
        )
    header = ("pass", "params", "tokens/s", "GFLOP/s", "/ bf16 peak", "/ same-dtype peak", "step s")
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, dt, tps, flops, sec in rows:
        print(
            f"| {label} | {dt} | {tps:,.0f} | {flops / 1e9:.1f} | "
            f"{100 * flops / peaks['bfloat16']:.0f}% | {100 * flops / peaks[dt]:.0f}% | "
            f"{sec:.3f} |"
        )
    print(
        f"\nanalytic forward FLOPs per step: {fwd_flops / 1e9:.1f} GFLOP "
        f"({fwd_flops / (B * S) / 1e6:.0f} MFLOP/token)"
    )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    cli.run(main)
