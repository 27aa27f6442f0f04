"""Sampler throughput: jaxrl4llm vs transformers PyTorch `generate`, and the decode roofline.

    python tools/bench_sampler.py            # batches 8, 32, 128, float32 and bfloat16, 128 tokens
    python tools/bench_sampler.py --quick    # batch 8 and 32, bfloat16 only, 32 tokens
    python tools/bench_sampler.py --modes=greedy,t1   # also sampling at T = 1 (the RL setting)

Both sides decode greedily (mode `greedy`) or sample at temperature 1 over the whole vocabulary
(mode `t1`: no top-k / top-p on either side), the same chat prompts (SmolLM2-135M-Instruct,
left-padded), in the same dtype, with stop tokens disabled so every row produces exactly
--new_tokens tokens.
Reported per setting:
  ours tok/s, torch tok/s, ratio   new tokens / wall time of the whole generate (incl. prefill)
  decode tok/s                     ours, prefill excluded: B * (N - 1) / (t(N) - t(1))
  bw roof tok/s                    B / (bytes read per decode step / measured bandwidth), the
                                   bytes being every weight once plus the K/V of the mean
                                   context; decode % = decode tok/s / bw roof tok/s
  flop roof tok/s                  B / (matmul FLOPs per decode step / measured matmul rate):
                                   at batch 32 on 2 CPU cores decode is compute-bound, so this
                                   is the lower of the two ceilings there
  same pref                        mean number of leading tokens where ours == torch's
                                   (greedy only: sampled tokens come from different generators)
Bandwidth and FLOP rate are measured in the same run: the best of several jitted sums over a
1 GiB array, and of 1024^3 matmuls in the benchmarked dtype. Each setting is timed in
--repeats turns of (ours, ours with 1 new token, torch), best of each: on a shared machine
whose speed drifts by tens of percent over minutes, a slow spell then slows every side alike
instead of the one that happened to run in it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli
from jaxrl4llm.models import registry  # noqa: E402
from jaxrl4llm.sampling import Sampler  # noqa: E402
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig  # noqa: E402

if TYPE_CHECKING:
    import transformers
    from jax.typing import DTypeLike

    from jaxrl4llm.models.tokenizer import Tokenizer

# Decoding modes: ours, and transformers' generate arguments for the same distribution.
MODES = {
    "greedy": (GREEDY, dict(do_sample=False, temperature=None, top_p=None, top_k=None)),
    "t1": (
        SamplingConfig(temperature=1.0),
        dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0),
    ),
}

QUESTIONS = [
    "What is 17 plus 25?",
    "Name three primary colors.",
    "Explain gravity in one sentence.",
    "What is the capital of Japan?",
    "Write a haiku about autumn.",
    "How many legs does a spider have?",
    "What is 9 times 7?",
    "Give a synonym for happy.",
    "Why is the sky blue?",
    "What does a thermometer measure?",
    "Translate 'hello' into French.",
    "What is 144 divided by 12?",
    "Describe a cat in five words.",
    "What is the boiling point of water in Celsius?",
    "Name a planet with rings.",
    "What is the square root of 81?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "List two mammals that live in the sea.",
    "What is 3 cubed?",
    "What color do you get by mixing blue and yellow?",
    "How many days are in a leap year?",
    "What is the largest ocean?",
    "Write a short greeting for a birthday card.",
    "What is 1000 minus 387?",
    "What gas do humans breathe out?",
    "Name a famous bridge.",
    "What is the opposite of cold?",
    "How many minutes are in two hours?",
    "What is the chemical symbol for gold?",
    "Suggest a name for a pet fish.",
    "What is 15 percent of 200?",
]


def measure_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best read bandwidth of a jitted float32 sum over an nbytes array, in GB/s."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def measure_matmul_gflops(dtype: DTypeLike, size: int = 1024, repeats: int = 5) -> float:
    """Best FLOP rate of a jitted [size]^3 matmul in `dtype` (float32 accumulation)."""
    x = jnp.ones((size, size), dtype)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    mm(x, x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(x, x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


def xla_threads() -> int:
    """Threads of XLA's CPU runtime: one per core this process may run on (XLA sizes its
    intra-op pool by the CPU affinity mask), which torch is then given too."""
    return (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )


def param_bytes(params: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def ours_runner(smp, params, prompts, strategy=GREEDY):
    """run(n) -> (seconds, tokens [B, n]) of one `generate` of n new tokens (compile first)."""

    def run(n):
        t0 = time.perf_counter()
        out = smp.generate(params, prompts, strategy, n, jax.random.key(0))
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        assert int(np.asarray(out.lengths_B).min()) == n
        return seconds, np.asarray(out.tokens_BT)

    return run


def torch_runner(model, tokenizer, prompts, mode_kwargs=MODES["greedy"][1]):
    """run(n) -> (seconds, tokens [B, n]) of one transformers `generate` of exactly n tokens,
    with XLA's thread count; the same left-padded prompts."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1

    def run(n):
        torch.set_num_threads(xla_threads())  # the same cores as XLA's CPU thread pool
        kwargs = dict(
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=tokenizer.pad_token_id,
            **mode_kwargs,
        )
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, **kwargs)
            seconds = time.perf_counter() - t0
        return seconds, out[:, width:].numpy()

    return run


def best_interleaved(runs: dict, repeats: int) -> dict:
    """{name: (best seconds, last output)} of `runs` ({name: (run, n)}), timed in turns (a, b,
    c, a, b, c, ...) so that a slow minute of a shared machine hits every side alike."""
    best = {name: (float("inf"), None) for name in runs}
    for _ in range(repeats):
        for name, (run, n) in runs.items():
            seconds, out = run(n)
            best[name] = (min(best[name][0], seconds), out)
    return best


@dataclasses.dataclass(frozen=True)
class Grid:
    """The settings benchmarked (every dtype x batch x mode) and how each is timed."""

    dtypes: list[str]
    batches: list[int]
    modes: list[str]
    new_tokens: int
    repeats: int
    with_torch: bool  # also time transformers' generate


def parse_grid(argv: Sequence[str] | None = None) -> Grid:
    parser = cli.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="bfloat16 only, 32 new tokens")
    parser.add_argument("--batches", default="8,32,128")
    parser.add_argument("--dtypes", default=None, help="default: float32,bfloat16")
    parser.add_argument("--new_tokens", type=int, default=None, help="default: 128 (32 quick)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--modes", default="greedy", help="comma-separated decoding modes: " + ", ".join(MODES)
    )
    parser.add_argument("--no_torch", action="store_true")
    args = parser.parse_args(argv)
    grid = Grid(
        dtypes=(args.dtypes or ("bfloat16" if args.quick else "float32,bfloat16")).split(","),
        new_tokens=args.new_tokens or (32 if args.quick else 128),
        repeats=args.repeats or (1 if args.quick else 2),
        batches=[int(b) for b in args.batches.split(",")],
        modes=args.modes.split(","),
        with_torch=not args.no_torch,
    )
    for mode in grid.modes:
        if mode not in MODES:
            parser.error(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return grid


def load_torch_reference(params32, config):
    """transformers' LlamaForCausalLM with our float32 weights, or None without torch."""
    try:
        import tempfile

        import torch
        import transformers

        from jaxrl4llm.models import weights

        folder = tempfile.mkdtemp(prefix="bench_sampler_")
        weights.export_hf(params32, config, folder)
        torch_model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        print(
            f"torch {torch.__version__}; threads: XLA {xla_threads()}, torch "
            f"{xla_threads()} (set before each generate)"
        )
        return torch_model
    except ImportError:
        print("torch/transformers not installed: skipping the reference")
        return None


def time_setting(
    smp: Sampler,
    params: Any,
    prompts: list[list[int]],
    mode: str,
    dtype_name: str,
    torch_model: transformers.PreTrainedModel | None,
    tokenizer: Tokenizer | None,
    grid: Grid,
) -> dict[str, tuple[float, Any]]:
    """best_interleaved's {side: (best seconds, tokens)} of ours (N new tokens and 1) and, with
    torch_model, transformers' generate, for one batch of prompts; every side warmed up first."""
    strategy, torch_kwargs = MODES[mode]
    ours_run = ours_runner(smp, params, prompts, strategy)
    runs = {"ours": (ours_run, grid.new_tokens), "ours_prefill": (ours_run, 1)}
    if torch_model is not None:
        import torch

        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
        # transformers declares `to` as @wraps(torch.nn.Module.to), which mypy reads as the
        # unbound Module.to: the dtype is taken for `self`.
        model = torch_model.to(tdtype)  # type: ignore[arg-type]
        runs["torch"] = (
            torch_runner(model, tokenizer, prompts, torch_kwargs),
            grid.new_tokens,
        )
    for run, n in runs.values():  # compile / warm up every side first
        run(n if run is ours_run else 2)
    return best_interleaved(runs, grid.repeats)


def decode_ceilings(config, batch, ctx, wbytes, itemsize, bandwidth, gflops):
    """(bandwidth roof, FLOP roof) in tokens/s of a decode step at mean context `ctx`."""
    kv_bytes = (
        2 * config.num_layers * batch * ctx * config.num_kv_heads * config.head_dim * itemsize
    )
    roofline_tps = batch / ((wbytes + kv_bytes) / (bandwidth * 1e9))
    # Matmul FLOPs per step: 2 per weight (the input embedding is a gather) + attention.
    dense = config.num_params - (
        config.vocab_size * config.hidden_size if not config.tie_word_embeddings else 0
    )
    flops = 2 * batch * dense + 4 * batch * ctx * config.num_layers * (
        config.num_heads * config.head_dim
    )
    return roofline_tps, batch / (flops / (gflops * 1e9))


def torch_columns(best, ours, batch, mode, grid):
    """(torch tok/s, mean length of the prefix both greedy decodes share; None sampling)."""
    import torch

    t_torch, ref = best["torch"]
    torch_tps = batch * grid.new_tokens / t_torch
    print(
        f"  (threads: XLA {xla_threads()}, torch {torch.get_num_threads()}; "
        f"{grid.repeats} turns of ours / ours prefill / torch)"
    )
    # Mean length of the prefix on which both greedy decodes agree (float rounding
    # differences flip near-ties, after which the continuations differ).
    if mode != "greedy":
        return torch_tps, None
    same = np.cumprod(ref == ours, axis=1).sum(axis=1)
    return torch_tps, float(np.mean(same))


def main(argv=None):
    grid = parse_grid(argv)
    path = registry.resolve("smollm2-135m-instruct")
    bandwidth = measure_bandwidth_gbs()
    gflops = {d: measure_matmul_gflops(getattr(jnp, d)) for d in grid.dtypes}
    print(
        f"devices: {jax.devices()}  cpu cores: {os.cpu_count()}  "
        f"measured read bandwidth: {bandwidth:.1f} GB/s  matmul GFLOP/s: "
        + ", ".join(f"{d} {g:.0f}" for d, g in gflops.items())
    )
    config, params32, tokenizer = registry.load_model(path)
    smp = Sampler(config, tokenizer, stop_ids=())  # no stops: exactly N tokens per row
    chats = smp.encode(QUESTIONS)
    torch_model = load_torch_reference(params32, config) if grid.with_torch else None

    rows = []
    new_tokens = grid.new_tokens
    for dtype_name in grid.dtypes:
        dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype_name]
        params = jax.tree.map(lambda x: x.astype(dtype), params32)
        itemsize = jnp.dtype(dtype).itemsize
        # Every weight is read once per step, except an untied input embedding (gathered).
        wbytes = param_bytes(params) - (
            0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * itemsize
        )
        for batch, mode in itertools.product(grid.batches, grid.modes):
            prompts = [chats[i % len(chats)] for i in range(batch)]
            best = time_setting(
                smp, params, prompts, mode, dtype_name, torch_model, tokenizer, grid
            )
            (t_full, ours), (t_prefill, _) = best["ours"], best["ours_prefill"]
            ours_tps = batch * new_tokens / t_full
            decode_tps = batch * (new_tokens - 1) / max(t_full - t_prefill, 1e-9)
            ctx = np.mean([len(p) for p in prompts]) + new_tokens / 2
            roofline_tps, flop_roof_tps = decode_ceilings(
                config, batch, ctx, wbytes, itemsize, bandwidth, gflops[dtype_name]
            )
            torch_tps = match = None
            if torch_model is not None:
                torch_tps, match = torch_columns(best, ours, batch, mode, grid)
            rows.append(
                (
                    dtype_name,
                    mode,
                    batch,
                    ours_tps,
                    torch_tps,
                    decode_tps,
                    roofline_tps,
                    flop_roof_tps,
                    match,
                )
            )
            print_row(*rows[-1], flush=True)
    print(
        "\nfinal table (new tokens = %d; threads: XLA %d, torch %d)"
        % (new_tokens, xla_threads(), xla_threads())
    )
    print_header()
    for row in rows:
        print_row(*row)


def print_header():
    print(
        f"{'dtype':>9} {'mode':>6} {'batch':>5} {'ours tok/s':>10} {'torch tok/s':>11} "
        f"{'ratio':>6} {'decode tok/s':>12} {'bw roof':>8} {'decode %':>8} {'flop roof':>9} "
        f"{'decode %':>8} {'same pref':>9}"
    )


_header_printed = False


def print_row(dtype, mode, batch, ours, torch_tps, decode, roofline, flop_roof, match, flush=False):
    global _header_printed
    if flush and not _header_printed:
        print_header()
        _header_printed = True
    t = f"{torch_tps:11.1f}" if torch_tps else f"{'-':>11}"
    r = f"{ours / torch_tps:6.2f}" if torch_tps else f"{'-':>6}"
    m = f"{match:9.1f}" if match is not None else f"{'-':>9}"
    print(
        f"{dtype:>9} {mode:>6} {batch:5d} {ours:10.1f} {t} {r} {decode:12.1f} {roofline:8.1f} "
        f"{100 * decode / roofline:7.1f}% {flop_roof:9.1f} {100 * decode / flop_roof:7.1f}% "
        f"{m}",
        flush=True,
    )


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
