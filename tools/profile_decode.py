"""Where one decode step's time goes: XLA's cost analysis and timings of its parts.

    python tools/profile_decode.py                    # SmolLM2, batch 32, float32, context 192
    python tools/profile_decode.py --batch=8 --dtype=bfloat16

Compiles, for one [B] decode step at a cache of --context slots (as the sampler runs it:
per-layer weight buffers, float32 cache on CPU):
  step      decode_step + sampling (the sampler loop body without its bookkeeping)
  layers    the decoder stack with the cache, no unembedding
  unembed   final hidden states -> [B, V] float32 logits
  sample    sampling one token from [B, V] logits (--temperature; 0 = greedy)
and prints, per part, XLA's cost analysis (FLOPs, bytes accessed), the best of --repeats
timings, and what the machine allows for it in the same run: FLOPs / the measured matmul rate
and bytes / the measured read bandwidth (the larger of the two is the part's floor).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    from jaxrl4llm.models import registry, transformer
    from jaxrl4llm.sampling import decode, sampler, strategies
    from jaxrl4llm.train.config import param_dtype
    from tools.bench_forward import _best_time
    from tools.bench_sampler import measure_bandwidth_gbs, measure_matmul_gflops

    dtype = param_dtype(args.dtype)
    config, params, _ = registry.load_model(args.model, dtype=dtype, with_tokenizer=False)
    params = transformer.unstack_layers(params)
    B, S, V = args.batch, args.context, config.vocab_size
    cache = transformer.init_kv_cache(config, B, S, sampler._cache_dtype(params))
    cache = cache.replace(mask_BS=jnp.ones((B, S), bool))
    token_B = jnp.full((B,), 100, jnp.int32)
    position_B = jnp.full((B,), S // 2, jnp.int32)
    index = jnp.int32(S // 2)
    keys_B = jax.random.split(jax.random.key(0), B)
    sampling = strategies.SamplingConfig(temperature=args.temperature)
    h_B1D = jnp.ones((B, 1, config.hidden_size), dtype)
    logits_BV = jax.random.normal(jax.random.key(1), (B, V), jnp.float32)

    def step(params, token_B, position_B, cache, index, keys_B):
        logits_BV, cache = decode.decode_step(params, config, token_B, position_B, cache, index)
        return strategies.sample(logits_BV, keys_B, sampling), cache

    def layers(params, token_B, position_B, cache, index):
        return transformer.hidden_states(params, config, token_B[:, None], position_B[:, None],
                                         jnp.ones((B, 1), bool), cache, index)

    parts = {
        "step": (step, (params, token_B, position_B, cache, index, keys_B)),
        "layers": (layers, (params, token_B, position_B, cache, index)),
        "unembed": (lambda p, h: transformer.unembed(p, config, h), (params, h_B1D)),
        "sample": (lambda lg, k: strategies.sample(lg, k, sampling), (logits_BV, keys_B)),
    }
    gflops = measure_matmul_gflops(dtype)
    gbs = measure_bandwidth_gbs()
    print(f"{args.model} {args.dtype}, batch {B}, context {S}, T={args.temperature}; "
          f"measured: matmul {gflops:.0f} GFLOP/s, read bandwidth {gbs:.1f} GB/s")
    print(f"{'part':>8} {'ms':>8} {'GFLOP':>8} {'MB read':>8} {'flop ms':>8} {'bw ms':>8} "
          f"{'floor %':>8} {'of step':>8}")
    step_ms = None
    for name, (fn, fn_args) in parts.items():
        compiled = jax.jit(fn).lower(*fn_args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
        ms = 1e3 * _best_time(compiled, *fn_args, repeats=args.repeats)
        step_ms = step_ms or ms
        flop_ms, bw_ms = flops / gflops / 1e6, nbytes / gbs / 1e6
        print(f"{name:>8} {ms:8.2f} {flops / 1e9:8.2f} {nbytes / 1e6:8.1f} {flop_ms:8.2f} "
              f"{bw_ms:8.2f} {100 * max(flop_ms, bw_ms) / ms:7.1f}% {100 * ms / step_ms:7.1f}%",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
