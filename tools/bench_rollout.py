"""Padding waste of a real sampled rollout: decode steps spent on finished rows, and update
positions spent past each row's end, with and without trimming to the batch's longest
completion (buckets.bucket_completion_length).

    python tools/bench_rollout.py              # SmolLM2, 8 prompts x 4, T = 1, 256 tokens
    python tools/bench_rollout.py --prompts=16 --new_tokens=512 --data=synthetic:countdown

Samples as the trainer does (chat prompts of --data with the default instruction, stop
tokens on, temperature --temperature) and prints, over --rollouts rollouts:
  sampler useful        decoded tokens / rows computed over the decode steps (the first
                        token of each row comes from the prefill): "full" = every row at
                        every step until the longest row ends (the loop exits when all
                        rows are done), "compacted" = the rows actually computed once
                        finished rows are compacted away (sampling/decode.py),
                        "continuous" = the rows computed by continuous batching with
                        --decode_slots slots (sampling/continuous.py; the same samples)
  update real frac      real tokens / (rows x columns the teacher-forced passes and the
                        update compute): trimmed (the bucket of the longest row) and
                        untrimmed (max_new_tokens, as before trimming); with --mini_batch,
                        also `update_real_minibatch`: the trainer's own mini-batches
                        (train/minibatches.py, rows reshuffled per epoch, each cut to the bucket of
                        its longest row) over --ppo_epochs epochs, with --micro_batch and
                        --length_classes (--micro_batch_length_classes) micro-batches sorted
                        by length, each run at its length class
  lengths               min / mean / max completion length
  time_ratio            (--time) wall time of the compacted sampler / the uncompacted one,
                        same prompts and keys (the same samples), measured in the same run
  continuous_ratio      (--time) wall time of continuous batching / the compacted sampler
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl4llm.config import cli


def waste(lengths_B: np.ndarray, num_steps: int, slot_steps: int, max_new_tokens: int,
          continuous_slot_steps: int | None = None) -> dict[str, float]:
    """The fractions of one rollout (see the module docstring)."""
    from jaxrl4llm.sampling.buckets import bucket_completion_length
    real, rows = float(lengths_B.sum()), lengths_B.size
    bucket = bucket_completion_length(num_steps, max_new_tokens)
    # The first token comes from the prefill; each decode step computes `slots` rows.
    return {"sampler_useful_full": (real - rows) / (rows * (num_steps - 1)),
            "sampler_useful_compacted": (real - rows) / slot_steps,
            **({} if continuous_slot_steps is None else
               {"sampler_useful_continuous": (real - rows) / continuous_slot_steps}),
            "update_real_trimmed": real / (rows * bucket),
            "update_real_untrimmed": real / (rows * max_new_tokens),
            "bucket": bucket, "steps": num_steps,
            "len_min": float(lengths_B.min()), "len_mean": float(lengths_B.mean()),
            "len_max": float(lengths_B.max())}


def minibatch_real_frac(out, group: int, mini_batch: int, ppo_epochs: int,
                        max_new_tokens: int, seed: int = 0, micro_batch: int = 0,
                        length_classes: int = 1, share_prompts: bool = True) -> float:
    """Real completion tokens / positions the trainer's update computes on this rollout when
    it runs mini-batches of `mini_batch` rows for `ppo_epochs` epochs, in micro-batches of
    `micro_batch` rows run at up to `length_classes` lengths (train/minibatches.py). The rows carry
    the trainer's layout (`share_prompts` is its default); sorting by length moves single
    rows out of their groups either way."""
    import jax.numpy as jnp

    from jaxrl4llm.sampling.buckets import bucket_completion_length
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.logprobs import Sequences
    from jaxrl4llm.train.minibatches import minibatches
    from jaxrl4llm.train.step import UpdateBatch

    rows = out.tokens_BT.shape[0]
    out = out.trimmed(bucket_completion_length(int(out.num_steps), max_new_tokens))
    batch = UpdateBatch(seqs=Sequences(out.prompt_tokens_BP, out.prompt_mask_BP, out.tokens_BT,
                                       out.mask_BT),
                        advantages=jnp.zeros(rows), keep_B=jnp.ones(rows, bool),
                        old_logp_BT=None, ref_logp_BT=None,
                        layout=RowLayout(group, share_prompts))
    config = TrainConfig().replace(prompts_per_step=rows // group, group_size=group,
                                   mini_batch_size=mini_batch, ppo_epochs=ppo_epochs,
                                   micro_batch_size=micro_batch,
                                   micro_batch_length_classes=length_classes,
                                   max_new_tokens=max_new_tokens)
    real = columns = 0
    for _, _, (mb_real, mb_columns) in minibatches(batch, config, jax.random.key(seed), None):
        real += mb_real
        columns += mb_columns
    return real / columns


def main(argv=None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default="synthetic:arithmetic")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--mini_batch", type=int, default=0,
                        help="rows per update (0: none): also report the real-token share of "
                             "the trainer's mini-batches, each cut to its own longest row")
    parser.add_argument("--ppo_epochs", type=int, default=1)
    parser.add_argument("--micro_batch", type=int, default=0,
                        help="rows per micro-batch of the --mini_batch share (0: the mini-batch)")
    parser.add_argument("--length_classes", type=int, default=1,
                        help="--micro_batch_length_classes of the --mini_batch share")
    parser.add_argument("--decode_slots", type=int, default=64,
                        help="slots of the continuous-batching sampler")
    parser.add_argument("--time", action="store_true",
                        help="also time the compacted sampler against the uncompacted one and "
                             "continuous batching (compiles each first)")
    args = parser.parse_args(argv)

    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.models import registry
    from jaxrl4llm.sampling.frontend import Sampler
    from jaxrl4llm.sampling.layout import RowLayout
    from jaxrl4llm.sampling.strategies import SamplingConfig
    from jaxrl4llm.train.config import param_dtype

    model_config, params, tokenizer = registry.load_model(args.model,
                                                          dtype=param_dtype(args.dtype))
    # One prompt bucket for every rollout: the warm-up compiles the only programs timed.
    samplers = {"compact": Sampler(model_config, tokenizer, min_prompt_bucket=256),
                "full": Sampler(model_config, tokenizer, min_prompt_bucket=256,
                                compact=False),
                "continuous": Sampler(model_config, tokenizer, min_prompt_bucket=256,
                                      decode_slots=args.decode_slots)}
    source = make_source(args.data, split="train")
    data = DataConfig(source=args.data)
    sampling = SamplingConfig(temperature=args.temperature)
    print(f"{args.model} {args.dtype}, {args.data}, {args.prompts} prompts x {args.group}, "
          f"T={args.temperature}, max_new_tokens={args.new_tokens}, device "
          f"{jax.devices()[0].platform}")

    def run(name, r):
        records = [source[(r * args.prompts + i) % len(source)] for i in range(args.prompts)]
        t0 = time.perf_counter()
        samples = samplers[name].sample(params, [data.messages(x) for x in records], sampling,
                                        args.new_tokens, jax.random.key(r),
                                        RowLayout(args.group))
        return samples, time.perf_counter() - t0

    names = tuple(samplers) if args.time else ("compact", "continuous")
    if args.time:
        for name in names:   # compiles
            run(name, 0)
    rows = []
    for r in range(args.rollouts):
        timed = {name: run(name, r) for name in names}
        out, cont = timed["compact"][0].out, timed["continuous"][0].out
        if not np.array_equal(*(np.asarray(x.tokens_BT) for x in (out, cont))):
            raise AssertionError("continuous batching sampled other tokens than the compacted "
                                 "sampler (same prompts and keys)")
        row = waste(timed["compact"][0].host(out.lengths_B), int(out.num_steps),
                    int(out.slot_steps), args.new_tokens, int(cont.slot_steps))
        if args.mini_batch:
            row["update_real_minibatch"] = minibatch_real_frac(
                out, args.group, args.mini_batch, args.ppo_epochs, args.new_tokens, seed=r,
                micro_batch=args.micro_batch, length_classes=args.length_classes)
        if args.time:
            row["compact_s"], row["full_s"] = timed["compact"][1], timed["full"][1]
            row["time_ratio"] = row["compact_s"] / row["full_s"]
            row["continuous_s"] = timed["continuous"][1]
            row["continuous_ratio"] = row["continuous_s"] / row["compact_s"]
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
        # The sampled lengths, so other update layouts can be worked out from this rollout.
        print("lengths=" + ",".join(str(int(x)) for x in timed["compact"][0].host(
            out.lengths_B)), flush=True)
    keys = ("sampler_useful_full", "sampler_useful_compacted", "sampler_useful_continuous",
            "update_real_trimmed",
            "update_real_untrimmed") + (("update_real_minibatch",) if args.mini_batch else ()) + (
                ("time_ratio", "continuous_ratio") if args.time else ())
    print("mean over rollouts: " + ", ".join(
        f"{k} {np.mean([r[k] for r in rows]):.3f}" for k in keys))
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
