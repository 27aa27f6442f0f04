"""Padding waste of a real sampled rollout: decode steps spent on finished rows, and update
positions spent past each row's end, with and without trimming to the batch's longest
completion (buckets.bucket_completion_length).

    python tools/bench_rollout.py              # SmolLM2, 8 prompts x 4, T = 1, 256 tokens
    python tools/bench_rollout.py --prompts=16 --new_tokens=512 --data=synthetic:countdown

Samples like a training run (chat prompts of --data with the default instruction, stop
tokens on, temperature --temperature) and prints, over --rollouts rollouts:
  sampler useful        decoded tokens / rows computed over the decode steps (the first
                        token of each row comes from the prefill): "full" = every row at
                        every step until the longest row ends (the loop exits when all
                        rows are done), "compacted" = the rows actually computed once
                        finished rows are compacted away (sampling/decode.py),
                        "continuous" = the rows computed by continuous batching with
                        --decode_slots slots (sampling/continuous.py; same prompts and keys)
  rows_identical        the share of rows both samplers gave the same tokens (see same_rows)
  update real frac      real tokens / (rows x columns the teacher-forced passes and the
                        update compute): trimmed (the bucket of the longest row) and
                        untrimmed (max_new_tokens, as before trimming); with --mini_batch,
                        also `update_real_minibatch`: the trainer's own mini-batches
                        (train/update/minibatches.py, rows reshuffled per epoch, each cut to the
                        bucket of its longest row) over --ppo_epochs epochs, with --micro_batch and
                        --length_classes (--micro_batch_length_classes) micro-batches sorted
                        by length, each run at its length class; `update_real_packed`: real
                        (prompt + completion) tokens / slots the packed update computes with
                        --micro_batch_tokens (train/update/packing.py: no padding but the packed
                        rows' tails, a group's prompt once per row), the whole batch as one
                        mini-batch; `update_flops_packed`: its modelled FLOPs / the padded
                        update's (packing.SlotFlops on the full model; below 1: the trainer
                        packs)
  logprob real          real tokens / token positions the rollout's teacher-forced passes
                        (reference, old logprobs, PPO's values) compute, each counted as
                        that pass runs them (see `logprob_real_fracs`): `logprob_real` padded
                        ([prompt bucket + completion bucket] rows, each group's prompt once),
                        `logprob_real_packed` with --micro_batch_tokens (train/update/packing.py),
                        `logprob_flops_packed` the packed passes' modelled FLOPs / the
                        padded passes' (below 1: the trainer packs them)
  lengths               min / mean / max completion length
  time_ratio            (--time) wall time of the compacted sampler / the uncompacted one,
                        same prompts and keys (the same samples), measured in the same run
  continuous_ratio      (--time) wall time of continuous batching / the compacted sampler
                        (compact_s, continuous_s: the times, same run)
  paged_time_ratio_*    (--time) then tools/bench_paged.py: the paged engine against the
                        other decoders with and without a KV budget, SmolLM2 cut to 4 layers,
                        both forced length mixes (its docstring); per mix, lines
                        mix=M paged_time_ratio_bound=, paged_time_ratio_rich=,
                        sampler_useful_paged=, rows and pages per decode step

--length_mix forces the completion lengths instead of sampling them: no stop tokens, and each
row stops at its own cap (generate's row_caps), drawn with a seed per rollout from
  step0     the quickstart's own step-0 completion lengths (quickstart_step0_lengths.txt
            beside this file says how they were measured), max_new_tokens 64
  tail10    a lognormal with the step-0 median and a 99th percentile 10x the step-0 one,
            rounded, max_new_tokens 1024 (the draws past it are cut there)
The lengths, hence the useful shares, then do not depend on the model's weights: --layers=1
measures them on a one-layer SmolLM2. With --time the warm-up run caps every row at one token
(the same compiled programs, a prefill each), so only the timed run decodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli

if TYPE_CHECKING:
    from jaxrl4llm.sampling.sample_output import SampleOutput

MIXES = ("natural", "step0", "tail10")
STEP0_LENGTHS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "quickstart_step0_lengths.txt"
)
STEP0_MAX_NEW_TOKENS = 64  # experiments/configs/quickstart.flags
TAIL10_MAX_NEW_TOKENS = 1024  # the lognormal's draws past it (about 0.3%) are cut there
Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def step0_lengths(path: str = STEP0_LENGTHS) -> np.ndarray:
    """The stored step-0 completion lengths (whitespace- or comma-separated ints, # comments)."""
    with open(path) as f:
        text = " ".join(line.split("#")[0] for line in f).replace(",", " ")
    return np.array([int(x) for x in text.split()], np.int64)


def mix_caps(
    mix: str, rows: int, seed: int, lengths: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """(per-row caps, the mix's max_new_tokens) of a forced --length_mix (module docstring)."""
    lengths = step0_lengths() if lengths is None else lengths
    rng = np.random.default_rng(seed)
    if mix == "step0":
        return rng.choice(lengths, size=rows), STEP0_MAX_NEW_TOKENS
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    sigma = np.log(10 * p99 / median) / Z99
    draws = np.round(median * np.exp(sigma * rng.standard_normal(rows))).astype(np.int64)
    return np.clip(draws, 1, TAIL10_MAX_NEW_TOKENS), TAIL10_MAX_NEW_TOKENS


def waste(
    lengths_B: np.ndarray,
    num_steps: int,
    slot_steps: int,
    max_new_tokens: int,
    continuous_slot_steps: int | None = None,
) -> dict[str, float]:
    """The fractions of one rollout (see the module docstring)."""
    from jaxrl4llm.sampling.buckets import bucket_completion_length

    real, rows = float(lengths_B.sum()), lengths_B.size
    bucket = bucket_completion_length(num_steps, max_new_tokens)
    # The first token comes from the prefill; each decode step computes `slots` rows.
    return {
        "sampler_useful_full": (real - rows) / (rows * (num_steps - 1)),
        "sampler_useful_compacted": (real - rows) / slot_steps,
        **(
            {}
            if continuous_slot_steps is None
            else {"sampler_useful_continuous": (real - rows) / continuous_slot_steps}
        ),
        "update_real_trimmed": real / (rows * bucket),
        "update_real_untrimmed": real / (rows * max_new_tokens),
        "bucket": bucket,
        "steps": num_steps,
        "len_min": float(lengths_B.min()),
        "len_mean": float(lengths_B.mean()),
        "len_max": float(lengths_B.max()),
    }


def _update_batch(out: Any, group: int, max_new_tokens: int, share_prompts: bool = True) -> Any:
    """The rollout `out` as the update's batch (batch.UpdateBatch), cut to the bucket of its
    longest completion as the trainer cuts it, its prompt block to the bucket of its longest
    prompt (the bench's samplers share one larger prompt bucket)."""
    import jax.numpy as jnp

    from jaxrl4llm.sampling.buckets import bucket_completion_length, bucket_prompt_length
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.train.update.batch import UpdateBatch
    from jaxrl4llm.train.update.logprobs import Sequences

    rows = out.tokens_BT.shape[0]
    out = out.trimmed(bucket_completion_length(int(out.num_steps), max_new_tokens))
    P = bucket_prompt_length(int(np.asarray(out.prompt_mask_BP).sum(axis=1).max()))
    prompt_tokens, prompt_mask = out.prompt_tokens_BP[:, -P:], out.prompt_mask_BP[:, -P:]
    return UpdateBatch(
        seqs=Sequences(prompt_tokens, prompt_mask, out.tokens_BT, out.mask_BT),
        advantages=jnp.zeros(rows),
        keep_B=jnp.ones(rows, bool),
        old_logp_BT=None,
        ref_logp_BT=None,
        layout=RowLayout(group, share_prompts),
    )


def minibatch_real_frac(
    out: SampleOutput,
    group: int,
    mini_batch: int,
    ppo_epochs: int,
    max_new_tokens: int,
    seed: int = 0,
    micro_batch: int = 0,
    length_classes: int = 1,
    share_prompts: bool = True,
) -> float:
    """Real completion tokens / positions the trainer's update computes on this rollout when
    it runs mini-batches of `mini_batch` rows for `ppo_epochs` epochs, in micro-batches of
    `micro_batch` rows run at up to `length_classes` lengths (train/update/minibatches.py). The
    rows carry the trainer's layout (`share_prompts` is its default); sorting by length moves single
    rows out of their groups either way."""
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.update.minibatches import minibatches

    rows = out.tokens_BT.shape[0]
    batch = _update_batch(out, group, max_new_tokens, share_prompts)
    config = TrainConfig().replace(
        prompts_per_step=rows // group,
        group_size=group,
        mini_batch_size=mini_batch,
        ppo_epochs=ppo_epochs,
        micro_batch_size=micro_batch,
        micro_batch_length_classes=length_classes,
        max_new_tokens=max_new_tokens,
    )
    real = columns = 0
    for mini in minibatches(batch, config, jax.random.key(seed), None):
        assert mini.tokens is not None  # no mesh: every row is on this host
        mb_real, mb_columns = mini.tokens
        real += mb_real
        columns += mb_columns
    return real / columns


def packed_update_fracs(
    out: Any, group: int, max_new_tokens: int, budget: int, model_config: Any
) -> dict[str, float]:
    """The packed update on the rollout `out`, the whole batch as one mini-batch, as the
    trainer forms it (train/update/minibatches.py, shared prompts): `update_real_packed`, real
    (prompt + completion) tokens / packed slots, and `update_flops_packed`, its modelled
    FLOPs on `model_config` / the padded update's (the trainer packs below 1)."""
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.update import packing
    from jaxrl4llm.train.update.minibatches import minibatches

    rows = out.tokens_BT.shape[0]
    batch = _update_batch(out, group, max_new_tokens)
    config = TrainConfig().replace(
        prompts_per_step=rows // group,
        group_size=group,
        micro_batch_tokens=budget,
        max_new_tokens=max_new_tokens,
    )
    ((_, _, _, choice),) = minibatches(batch, config, jax.random.key(0), None, model_config)
    assert choice is not None, "--micro_batch_tokens > 0: the mini-batch's packing choice"
    packed = choice.batch or packing.pack(
        batch.seqs, budget, flops=packing.SlotFlops.of(model_config)
    )  # the padded update was cheaper: the packing it was compared with
    real, slots = packing.real_share(packed)
    return {"update_real_packed": real / slots, "update_flops_packed": choice.flops_ratio}


def logprob_real_fracs(
    out: Any, group: int, max_new_tokens: int, budget: int, flops: Any
) -> dict[str, float]:
    """The teacher-forced passes of the rollout `out` (train/rollout/stage.py), padded and packed:
    real tokens / token positions each computes. Padded: rows of the trainer's prompt block P
    (the bucket of the longest prompt) + the bucketed longest completion T, each group's
    prompt run once (the default layout): real = one prompt per group + the completions,
    positions = groups x P + rows x T. Packed (`budget` = --micro_batch_tokens): the whole
    batch packed (packing.pack, one device, a group's prompt once per row):
    packing.real_share. The trainer runs the passes packed where `logprob_flops_packed`
    (modelled FLOPs, packing.SlotFlops `flops`: packed / padded) is below 1
    (train/rollout/stage.py)."""
    from jaxrl4llm.sampling.buckets import bucket_completion_length, bucket_prompt_length
    from jaxrl4llm.train.update import packing
    from jaxrl4llm.train.update.logprobs import Sequences

    out = out.trimmed(bucket_completion_length(int(out.num_steps), max_new_tokens))
    rows, T = out.tokens_BT.shape
    prompt_len = np.asarray(out.prompt_mask_BP).sum(axis=1)
    real = int(prompt_len[::group].sum()) + int(np.asarray(out.lengths_B).sum())
    P = bucket_prompt_length(int(prompt_len.max()))
    positions = rows // group * P + rows * T
    packed = packing.pack(
        Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT, out.mask_BT),
        budget,
        flops=flops,
    )
    packed_real, slots = packing.real_share(packed)
    return {
        "logprob_real": real / positions,
        "logprob_real_packed": packed_real / slots,
        "logprob_flops_packed": packing.packed_flops(packed, flops)
        / flops.padded(rows, P, T, group),
    }


def same_rows(a: Any, b: Any) -> float:
    """The share of rows two samplers gave the same tokens (and length). Both draw each row
    from the same key, but float32 sums over other batch shapes can tip a near-tie draw of
    a real model; the toy-model tests (tests/sampling/test_continuous.py) check equality."""
    return float(np.mean(np.all(np.asarray(a.tokens_BT) == np.asarray(b.tokens_BT), axis=1)))


def _times(seconds: dict[str, float]) -> dict[str, float]:
    """Wall times of one rollout and their ratios (module docstring)."""
    row = {"compact_s": seconds["compact"]}
    if "full" in seconds:
        row["full_s"] = seconds["full"]
        row["time_ratio"] = row["compact_s"] / row["full_s"]
    if "continuous" in seconds:
        row["continuous_s"] = seconds["continuous"]
        row["continuous_ratio"] = row["continuous_s"] / row["compact_s"]
    return row


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="keep the model's first LAYERS layers (0: all); with a forced "
        "--length_mix the useful shares do not depend on the weights",
    )
    parser.add_argument("--data", default="synthetic:arithmetic")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument(
        "--new_tokens",
        type=int,
        default=0,
        help="max_new_tokens (0: 256, or the --length_mix's own bound)",
    )
    parser.add_argument(
        "--length_mix",
        default="natural",
        choices=MIXES,
        help="natural: sample with stop tokens; step0 / tail10: no stop tokens, "
        "per-row caps drawn from that mix (module docstring)",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--mini_batch",
        type=int,
        default=0,
        help="rows per update (0: none): also report the real-token share of "
        "the trainer's mini-batches, each cut to its own longest row",
    )
    parser.add_argument("--ppo_epochs", type=int, default=1)
    parser.add_argument(
        "--micro_batch",
        type=int,
        default=0,
        help="rows per micro-batch of the --mini_batch share (0: the mini-batch)",
    )
    parser.add_argument(
        "--length_classes",
        type=int,
        default=1,
        help="--micro_batch_length_classes of the --mini_batch share",
    )
    parser.add_argument(
        "--micro_batch_tokens",
        type=int,
        default=4096,
        help="token budget of the packed update's and teacher-forced passes' micro-batches "
        "(update_real_packed, logprob_real_packed)",
    )
    parser.add_argument(
        "--decode_slots",
        type=int,
        default=0,
        help="slots of the continuous-batching sampler (0: run none)",
    )
    parser.add_argument(
        "--time",
        action="store_true",
        help="also time the compacted sampler against continuous batching "
        "(and, with the natural mix, the uncompacted one); compiles "
        "each first; then tools/bench_paged.py's comparison of the paged engine "
        "(paged_time_ratio_bound=, paged_time_ratio_rich=, sampler_useful_paged=)",
    )
    return parser.parse_args(argv)


def _load_model(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(config, params, tokenizer, the full model's config) of --model, cut to its first
    --layers layers if given (the FLOP ratios are modelled on the full model)."""
    from jaxrl4llm.models import registry
    from jaxrl4llm.train.config import param_dtype

    model_config, params, tokenizer = registry.load_model(args.model, dtype=param_dtype(args.dtype))
    full_config = model_config
    if args.layers:
        model_config = dataclasses.replace(model_config, num_layers=args.layers)
        params = {**params, "layers": jax.tree.map(lambda w: w[: args.layers], params["layers"])}
    return model_config, params, tokenizer, full_config


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.sampling.frontend import Sampler
    from jaxrl4llm.sampling.strategies import SamplingConfig
    from jaxrl4llm.train.update.packing import SlotFlops

    model_config, params, tokenizer, full_config = _load_model(args)
    full_flops = SlotFlops.of(full_config)
    forced = args.length_mix != "natural"
    rows = args.prompts * args.group
    new_tokens = args.new_tokens or (mix_caps(args.length_mix, 1, 0)[1] if forced else 256)
    # One prompt bucket for every rollout: the warm-up compiles the only programs timed.
    options: dict[str, Any] = {"min_prompt_bucket": 256, **({"stop_ids": ()} if forced else {})}
    samplers = {"compact": Sampler(model_config, tokenizer, **options)}
    if args.decode_slots:
        samplers["continuous"] = Sampler(
            model_config, tokenizer, decode_slots=args.decode_slots, **options
        )
    if args.time and not forced:
        samplers["full"] = Sampler(model_config, tokenizer, compact=False, **options)
    source = make_source(args.data, split="train")
    data = DataConfig(source=args.data)
    sampling = SamplingConfig(temperature=args.temperature)
    print(
        f"{args.model}{f' ({args.layers} layers)' if args.layers else ''} {args.dtype}, "
        f"{args.data}, {args.prompts} prompts x {args.group}, T={args.temperature}, "
        f"max_new_tokens={new_tokens}, length mix {args.length_mix}, "
        f"{args.decode_slots} slots, device {jax.devices()[0].platform}"
    )

    def run(name, r, caps):
        records = [source[(r * args.prompts + i) % len(source)] for i in range(args.prompts)]
        smp = samplers[name]
        prompts = smp.encode([data.messages(x) for x in records])
        t0 = time.perf_counter()
        out = smp.generate(
            params,
            prompts,
            sampling,
            new_tokens,
            jax.random.key(r),
            group_size=args.group,
            row_caps=caps,
        )
        jax.block_until_ready(out)
        return out, time.perf_counter() - t0

    if args.time:
        for name in samplers:  # compiles (a forced mix: one token per row, the same programs)
            run(name, 0, np.ones(rows, np.int64) if forced else None)
    results = []
    for r in range(args.rollouts):
        caps = np.minimum(mix_caps(args.length_mix, rows, r)[0], new_tokens) if forced else None
        timed = {name: run(name, r, caps) for name in samplers}
        out = timed["compact"][0]
        cont = timed["continuous"][0] if "continuous" in timed else None
        lengths = np.asarray(out.lengths_B)
        row = waste(
            lengths,
            int(out.num_steps),
            int(out.slot_steps),
            new_tokens,
            None if cont is None else int(cont.slot_steps),
        )
        if cont is not None:
            row["rows_identical"] = same_rows(out, cont)
        budget = args.micro_batch_tokens
        row.update(packed_update_fracs(out, args.group, new_tokens, budget, full_config))
        row.update(logprob_real_fracs(out, args.group, new_tokens, budget, full_flops))
        if args.mini_batch:
            row["update_real_minibatch"] = minibatch_real_frac(
                out,
                args.group,
                args.mini_batch,
                args.ppo_epochs,
                new_tokens,
                seed=r,
                micro_batch=args.micro_batch,
                length_classes=args.length_classes,
            )
        if args.time:
            row.update(_times({name: t for name, (_, t) in timed.items()}))
        results.append(row)
        print(
            " ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            ),
            flush=True,
        )
        # The sampled lengths, so other update layouts can be worked out from this rollout.
        print("lengths=" + ",".join(str(int(x)) for x in lengths), flush=True)
    _finish(args, results)
    return 0


def _finish(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """The means over the rollouts, then (--time) tools/bench_paged.py's comparison."""
    keys = [
        k
        for k in (
            "sampler_useful_full",
            "sampler_useful_compacted",
            "sampler_useful_continuous",
            "rows_identical",
            "update_real_trimmed",
            "update_real_packed",
            "update_flops_packed",
            "update_real_untrimmed",
            "update_real_minibatch",
            "logprob_real",
            "logprob_real_packed",
            "logprob_flops_packed",
            "compact_s",
            "continuous_s",
            "time_ratio",
            "continuous_ratio",
        )
        if k in results[0]
    ]
    print(
        "mean over rollouts: "
        + ", ".join(f"{k} {np.mean([r[k] for r in results]):.3f}" for k in keys)
    )
    if args.time:
        # Its own process (it imports this module's length mixes; a fresh JAX too).
        subprocess.run(
            [sys.executable, os.path.join(os.path.dirname(__file__), "bench_paged.py")], check=True
        )


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
