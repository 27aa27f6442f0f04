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
and bytes / the measured read bandwidth (the larger of the two is the part's floor). Each part
is its own program, so the KV cache is copied in and out of it (not donated): the parts are an
upper bound of what they cost inside the sampler's loop.

    python tools/profile_decode.py --trace --steps=32

instead profiles the sampler itself (`sampler.generate_tokens`, no compaction, no stop tokens)
with jax.profiler, attributes every op that XLA ran inside the decode loop to a category by its
HLO (dense layer matmuls, attention over the KV cache, the unembedding, the other work over the
vocabulary (sampling), everything else), and prints each category's time per decode step with
the rate it reached: GFLOP/s for matmuls, GB/s of KV cache read for attention. Beside it, the
same matmul shapes timed alone (XLA, and torch's `F.linear` with the same threads when torch is
installed), which says whether an op in the loop runs slower than the library can run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl4llm.config import cli

if TYPE_CHECKING:
    from jax.typing import DTypeLike


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--trace",
        action="store_true",
        help="profile the sampler's decode loop op by op (see the docstring)",
    )
    parser.add_argument("--steps", type=int, default=32, help="decode steps traced (--trace)")
    args = parser.parse_args(argv)
    if args.trace:
        return trace_main(args)

    from jaxrl4llm.models import kv_cache, registry, transformer, unembedding
    from jaxrl4llm.sampling import decode, strategies
    from jaxrl4llm.train.config import param_dtype
    from tools.bench_forward import _best_time
    from tools.bench_sampler import measure_bandwidth_gbs, measure_matmul_gflops

    dtype = param_dtype(args.dtype)
    config, params, _ = registry.load_model(args.model, dtype=dtype, with_tokenizer=False)
    params = transformer.unstack_layers(params)
    B, S, V = args.batch, args.context, config.vocab_size
    cache = kv_cache.init_kv_cache(config, B, S, decode.cache_dtype_for(params))
    cache = cache.replace(mask_BS=jnp.ones((B, S), bool))
    token_B = jnp.full((B,), 100, jnp.int32)
    position_B = jnp.full((B,), S // 2, jnp.int32)
    index = jnp.int32(S // 2)
    keys_B = jax.random.split(jax.random.key(0), B)
    sampling = strategies.SamplingConfig(temperature=args.temperature)
    h_B1D = jnp.ones((B, 1, config.hidden_size), dtype)
    logits_BV = jax.random.normal(jax.random.key(1), (B, V), jnp.float32)

    def step(params, token_B, position_B, cache, index, keys_B):
        logits_BV, cache, _ = decode.decode_step(params, config, token_B, position_B, cache, index)
        return strategies.sample(logits_BV, keys_B, sampling), cache

    def layers(params, token_B, position_B, cache, index):
        return transformer.hidden_states(
            params,
            config,
            token_B[:, None],
            position_B[:, None],
            jnp.ones((B, 1), bool),
            cache,
            index,
        )

    parts: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "step": (step, (params, token_B, position_B, cache, index, keys_B)),
        "layers": (layers, (params, token_B, position_B, cache, index)),
        "unembed": (lambda p, h: unembedding.unembed(p, config, h), (params, h_B1D)),
        "sample": (lambda lg, k: strategies.sample(lg, k, sampling), (logits_BV, keys_B)),
    }
    gflops = measure_matmul_gflops(dtype)
    gbs = measure_bandwidth_gbs()
    print(
        f"{args.model} {args.dtype}, batch {B}, context {S}, T={args.temperature}; "
        f"measured: matmul {gflops:.0f} GFLOP/s, read bandwidth {gbs:.1f} GB/s"
    )
    print(
        f"{'part':>8} {'ms':>8} {'GFLOP':>8} {'MB read':>8} {'flop ms':>8} {'bw ms':>8} "
        f"{'floor %':>8} {'of step':>8}"
    )
    step_ms = None
    for name, (fn, fn_args) in parts.items():
        compiled = jax.jit(fn).lower(*fn_args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        assert cost is not None, "the backend reports no cost analysis"
        flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
        ms = 1e3 * _best_time(compiled, *fn_args, repeats=args.repeats)
        step_ms = step_ms or ms
        flop_ms, bw_ms = flops / gflops / 1e6, nbytes / gbs / 1e6
        print(
            f"{name:>8} {ms:8.2f} {flops / 1e9:8.2f} {nbytes / 1e6:8.1f} {flop_ms:8.2f} "
            f"{bw_ms:8.2f} {100 * max(flop_ms, bw_ms) / ms:7.1f}% {100 * ms / step_ms:7.1f}%",
            flush=True,
        )
    return 0


# ----------------------------------------------------------------------------- --trace

CATEGORIES = (
    "dense layers (matmuls)",
    "attention (KV cache)",
    "unembedding (matmul)",
    "vocabulary ops (sampling)",
    "other",
)
# Ops that move no data at run time (and carry no op_name metadata).
_FREE_OPS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+|\(.*?\)) (\S+?)\((.*)")


# _parse_hlo's {instruction: (shape, op, rest, computation)} and {computation: [ops]}.
_Lines = dict[str, tuple[str, str, str, str | None]]
_Bodies = dict[str, list[str]]


def _dims(shape: str) -> list[list[int]]:
    """The dimensions of each array in an HLO shape string ("f32[32,576]{1,0}", a tuple)."""
    return [[int(d) for d in x.split(",") if d] for x in re.findall(r"\[([\d,]*)\]", shape)]


def _elements(shape: str) -> int:
    """Elements of an HLO shape string (a tuple: its largest part)."""
    return max((math.prod(d) for d in _dims(shape)), default=0)


def _rank(shape: str) -> int:
    return max((len(d) for d in _dims(shape)), default=0)


def _called(rest: str, keys: str) -> list[str]:
    """The computations an instruction's operand text `rest` names under the attributes `keys`
    (a regex alternation: "calls", "body|condition", ...)."""
    return re.findall(rf"(?:{keys})=%?([\w.\-]+)", rest)


def _parse_hlo(hlo_text: str) -> tuple[dict[str, str], _Lines, _Bodies]:
    """{instruction: shape}, {instruction: (shape, op, rest, computation)} and
    {computation: [its instructions' ops]} of an HLO module's text."""
    shapes: dict[str, str] = {}
    lines: _Lines = {}
    bodies: _Bodies = {}
    current: str | None = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(1)
            bodies[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, op, rest = m.groups()
            shapes[name] = shape
            lines[name] = (shape, op, rest, current)
            if current is not None:
                bodies[current].append(op)
    return shapes, lines, bodies


def _is_matmul(op: str, callees: list[str], bodies: _Bodies) -> bool:
    """A dot, or an instruction one of whose called computations `callees` holds one."""
    return op == "dot" or any("dot" in bodies.get(f, []) for f in callees)


def _dots(computation: str, lines: _Lines, bodies: _Bodies) -> int:
    """Matmuls of a computation, those inside its fusions included."""
    return sum(
        1
        for _, op, rest, c in lines.values()
        if c == computation and _is_matmul(op, _called(rest, "calls"), bodies)
    )


def _control_flow_callees(computation: str, lines: _Lines) -> list[str]:
    """The bodies, conditions and branches of the loops and conditionals in `computation`."""
    callees = []
    for _, op, rest, c in lines.values():
        if c != computation or op not in ("while", "conditional"):
            continue
        callees += _called(rest, "body|condition|true_computation|false_computation")
        if "branch_computations=" in rest:
            branches = rest.split("branch_computations=", 1)[1].split("}", 1)[0]
            callees += re.findall(r"%([\w.\-]+)", branches)
    return callees


def _decode_loop_scope(lines: _Lines, bodies: _Bodies) -> set[str]:
    """The decode loop's body (the while body with the most matmuls) and the computations of
    the loops and conditionals inside it."""
    loops = [_called(rest, "body")[0] for _, op, rest, _ in lines.values() if op == "while"]
    if not loops:
        raise ValueError("categorize_ops: the module has no while loop to profile.")
    scope, todo = set(), [max(loops, key=lambda body: _dots(body, lines, bodies))]
    while todo:
        computation = todo.pop()
        if computation in scope:
            continue
        scope.add(computation)
        todo += _control_flow_callees(computation, lines)
    return scope


@dataclasses.dataclass(frozen=True)
class _Op:
    """What the category rules read of one instruction."""

    matmul: bool  # a dot, or a fusion holding one
    elements: int  # of its output
    rank: int  # of its output
    largest: int  # elements of its output or its largest operand


# (category, rule(op, batch * vocab)): the first rule that holds names an op's category. A
# matmul is the unembedding when its output is [B, V], a dense layer's when its rank is < 4,
# else attention; another op is vocabulary work when it reads or writes >= B * V / 2
# elements, attention when its output has rank >= 4, else other.
_RULES = (
    (CATEGORIES[2], lambda op, bv: op.matmul and op.elements == bv),
    (CATEGORIES[0], lambda op, bv: op.matmul and op.rank < 4),
    (CATEGORIES[3], lambda op, bv: not op.matmul and op.largest >= bv // 2),
    (CATEGORIES[1], lambda op, bv: op.rank >= 4),
    (CATEGORIES[4], lambda op, bv: True),
)


def _op(shape: str, op: str, rest: str, shapes: dict[str, str], bodies: _Bodies) -> _Op:
    matmul = _is_matmul(op, _called(rest, "calls")[:1], bodies)  # [:1]: what a fusion runs
    operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
    sizes = [_elements(shape)] + [_elements(shapes.get(o, "")) for o in operands]
    return _Op(matmul, _elements(shape), _rank(shape), max(sizes))


def categorize_ops(hlo_text: str, batch: int, vocab: int, loop_only: bool = True) -> dict[str, str]:
    """{instruction name: category} for the ops of `hlo_text` (a compiled module's as_text())
    that run op by op (not inside a fusion): with `loop_only`, those of the decode loop, the
    while loop whose body holds the most matmuls, and of the loops nested in it (e.g. a
    random-number loop); the prefill and the first token's sampling are left out.

    A dot (or a fusion holding one) is the unembedding when its output has batch * vocab
    elements, attention when its output has rank >= 4 (the [B, K, G, S] scores and the
    [B, K, G, H] outputs over the cache), and a dense layer matmul otherwise ([B, D] x [D, F]).
    Other ops are vocabulary work when they read or write >= batch * vocab / 2 elements,
    attention when their output has rank >= 4 (softmax, masks, cache writes), else other.
    """
    shapes, lines, bodies = _parse_hlo(hlo_text)
    if loop_only:
        scope = _decode_loop_scope(lines, bodies)
    else:
        # Ops inside a fusion or a reducer run as part of their caller: only the instructions
        # of the computations that execute op by op (the entry, while bodies, branches) count.
        scope = set(bodies) - set(re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", hlo_text))
    out = {}
    for name, (shape, op, rest, computation) in lines.items():
        if computation not in scope or op in _FREE_OPS:
            continue
        facts = _op(shape, op, rest, shapes, bodies)
        out[name] = next(c for c, rule in _RULES if rule(facts, batch * vocab))
    return out


def op_intervals(trace_dir: str) -> dict[str, list[tuple[float, float]]]:
    """{op name: [(start, end) in ms]} of the XLA ops in the newest trace under trace_dir."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz")))
    if not paths:
        raise FileNotFoundError(
            f"no *.trace.json.gz under {trace_dir}: jax.profiler wrote "
            "no trace (is the profiler plugin available?)"
        )
    with gzip.open(paths[-1]) as f:
        events = json.load(f)["traceEvents"]
    out: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X":
            start = e["ts"] / 1e3
            out.setdefault(e["name"], []).append((start, start + e.get("dur", 0.0) / 1e3))
    return out


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Wall time covered by the union of the intervals: two ops of a category that run side
    by side (XLA runs independent ops on different threads) count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _standalone_gflops(
    shapes: Iterable[tuple[int, int, int]], dtype: DTypeLike, repeats: int
) -> dict[tuple[int, int, int], tuple[float, float | None]]:
    """{(M, K, N): (XLA GFLOP/s, torch F.linear GFLOP/s or None)} of [M, K] @ [K, N] alone."""
    from tools.bench_forward import _best_time
    from tools.bench_sampler import xla_threads

    try:
        import torch

        torch.set_num_threads(xla_threads())
        have_torch = True
    except ImportError:
        have_torch = False
    out = {}
    for m, k, n in shapes:
        x = jnp.ones((m, k), dtype)
        w = jnp.full((k, n), 0.01, dtype)
        dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        xla = 2 * m * k * n / _best_time(dot, x, w, repeats=repeats) / 1e9
        ref = None
        if have_torch:
            tdtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
            tx, tw = torch.ones(m, k, dtype=tdtype), torch.full((n, k), 0.01, dtype=tdtype)
            with torch.inference_mode():
                torch.nn.functional.linear(tx, tw)
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    torch.nn.functional.linear(tx, tw)
                    best = min(best, time.perf_counter() - t0)
            ref = 2 * m * k * n / best / 1e9
        out[(m, k, n)] = (xla, ref)
    return out


def trace_main(args: argparse.Namespace) -> int:
    import tempfile

    from jaxrl4llm.models import registry
    from jaxrl4llm.sampling import decode, sampler, strategies
    from jaxrl4llm.train.config import param_dtype
    from tools.bench_forward import _best_time
    from tools.bench_sampler import measure_bandwidth_gbs, measure_matmul_gflops

    dtype = param_dtype(args.dtype)
    config, params, _ = registry.load_model(args.model, dtype=dtype, with_tokenizer=False)
    B, N, V, D = args.batch, args.steps + 1, config.vocab_size, config.hidden_size
    P = max(1, args.context - N)  # so the cache holds about --context slots
    prompt_BP = jnp.full((B, P), 100, jnp.int32)
    inputs = (
        params,
        prompt_BP,
        jnp.ones((B, P), bool),
        jnp.ones((B,), bool),
        jax.random.split(jax.random.key(0), B),
        jnp.full((1,), -1, jnp.int32),
        jnp.int32(0),
    )
    static = dict(
        model_config=config,
        max_new_tokens=N,
        compact=False,
        sampling=strategies.SamplingConfig(temperature=args.temperature),
    )
    compiled = sampler.generate_tokens.lower(*inputs, **static).compile()
    one = sampler.generate_tokens.lower(*inputs, **{**static, "max_new_tokens": 1}).compile()
    step_ms = (
        1e3
        * (
            _best_time(compiled, *inputs, repeats=args.repeats)
            - _best_time(one, *inputs, repeats=args.repeats)
        )
        / (N - 1)
    )
    with tempfile.TemporaryDirectory(prefix="profile_decode_") as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        jax.block_until_ready(compiled(*inputs))
        jax.profiler.stop_trace()
        intervals = op_intervals(trace_dir)
    hlo_text = compiled.as_text()
    assert hlo_text is not None, "a compiled CPU / GPU / TPU module has its HLO text"
    categories = categorize_ops(hlo_text, B, V)
    spans: dict[str, list[tuple[float, float]]] = {c: [] for c in CATEGORIES}
    for name, cat in categories.items():
        spans[cat] += intervals.get(name, [])
    per_step = {c: busy_ms(spans[c]) / (N - 1) for c in CATEGORIES}
    # The traced loop's wall time: from its first op's start to its last op's end.
    everything = [span for c in CATEGORIES for span in spans[c]]
    loop_ms = (max(b for _, b in everything) - min(a for a, _ in everything)) / (N - 1)
    idle_ms = loop_ms - busy_ms(everything) / (N - 1)
    gflops = measure_matmul_gflops(dtype)
    gbs = measure_bandwidth_gbs()

    L, S = config.num_layers, P + N - 1
    F, Nq, Nk = config.intermediate_size, config.num_heads, config.num_kv_heads
    Hd = config.head_dim
    layer_shapes = [
        (B, D, Nq * Hd),
        (B, D, Nk * Hd),
        (B, D, Nk * Hd),
        (B, Nq * Hd, D),
        (B, D, F),
        (B, D, F),
        (B, F, D),
    ]
    dense_flop = 2 * L * sum(m * k * n for m, k, n in layer_shapes)
    unembed_flop = 2 * B * D * V
    # Each step reads every slot of the cache (masked slots too), in the cache's dtype.
    cache_bytes = 2 * L * B * Nk * S * Hd * jnp.dtype(decode.cache_dtype_for(params)).itemsize
    print(
        f"{args.model} {args.dtype}, batch {B}, {N - 1} decode steps at contexts {P}..{S} "
        f"(cache {S} slots), T={args.temperature}; measured here: matmul {gflops:.0f} GFLOP/s, "
        f"read bandwidth {gbs:.1f} GB/s; decode step {step_ms:.1f} ms (wall, prefill "
        f"excluded); the categories' ops kept the machine busy {sum(per_step.values()):.1f} "
        "ms/step (each category's ops counted once where two ran side by side)"
    )
    rates = {
        CATEGORIES[0]: (dense_flop / 1e9, "GFLOP/s"),
        CATEGORIES[1]: (cache_bytes / 1e9, "GB/s (K/V read; every slot is attended)"),
        CATEGORIES[2]: (unembed_flop / 1e9, "GFLOP/s"),
    }
    print(f"{'category':>28} {'ms/step':>8} {'share':>6}  rate reached")
    total = sum(per_step.values()) or 1.0
    for cat in CATEGORIES:
        ms = per_step[cat]
        rate = ""
        if cat in rates and ms > 0:
            amount, unit = rates[cat]
            rate = f"{amount / (ms / 1e3):7.1f} {unit}"
        print(f"{cat:>28} {ms:8.2f} {100 * ms / total:5.1f}%  {rate}")
    print(
        f"{'no op of the loop running':>28} {idle_ms:8.2f}         "
        f"(the traced loop took {loop_ms:.1f} ms/step; this is its condition, dispatch and "
        "waits between ops)"
    )
    alone = _standalone_gflops(sorted(set(layer_shapes) | {(B, D, V)}), dtype, args.repeats)
    print(
        "the same matmuls alone ([M, K] @ [K, N], GFLOP/s): "
        + "; ".join(
            f"{m}x{k}x{n} XLA {x:.0f}" + (f" torch {t:.0f}" if t else "")
            for (m, k, n), (x, t) in alone.items()
        )
    )
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
