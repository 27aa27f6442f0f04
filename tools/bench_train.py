"""Benchmark one GRPO training step on SmolLM2-135M-Instruct (CPU or accelerator), against TRL.

    python tools/bench_train.py                       # float32 and bfloat16, 8 x 4 x 128 tokens
    python tools/bench_train.py --dtypes float32 --prompts=4 --new_tokens=32   # quicker
    python tools/bench_train.py --dtypes float32 float32:bfloat16   # f32 vs bf16 compute

One step = rollout (sampler, forced length: stop tokens ignored) -> rewards -> reference
logprobs (only with --kl_coef > 0: GRPO's KL term; off by default, as TRL's beta = 0) -> one
jitted update with per-layer remat (--no_remat to keep all activations: about 17 GiB peak RSS
instead of a few). Each dtype runs in its own process so its peak RSS is its own; a warm-up
step compiles everything first, then `--repeats` timed steps.
When `trl` is installed (the `bench` extra; --no_trl skips it), TRL's GRPOTrainer runs the same
work in its own process after ours, per dtype (`--rounds N`: ours, TRL, ours, TRL, ... each
side's fastest step kept; tools/bench_trl.py: same weights, prompts,
reward, group, forced token count, one optimizer step over the same rows, torch given XLA's
thread count); the last table is ours / TRL per dtype (target <= 0.75). On a loaded machine
pass --omp_wait_policy=PASSIVE: torch's spinning OpenMP workers otherwise slow it several-fold.
Prints seconds per stage, tokens/s and peak RSS, and the compute floor: the step's matmul
FLOPs (`step_tflop`) at the best matmul rate measured in the same process (`matmul_gflops`:
1024^3 matmuls in the compute dtype, probed before and after the steps),
i.e. the fastest this step could run on this machine (`floor_s`; `floor_share` = floor_s /
step_s). The reference and update passes run each prompt once per group (--no_share_prompts
runs it once per row, as before). `--micro_batch_tokens=N` also runs our step with the update
on packed micro-batches of N tokens (train/packing.py: a group's prompt once per row, rows
chosen by modelled FLOPs) in each round, between our padded step and TRL's, and reports both
ratios to TRL and the packed update's modelled FLOPs / the padded update's
(`update_flops_packed`; the trainer itself packs only below 1). `--lora_rank=R` also runs our
step with rank-R LoRA adapters on the frozen base (`--lora_targets`, all seven projections by
default) in each round, in its own process, and prints full fine-tuning against LoRA: step
time, update time and peak RSS, and the LoRA / full ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli


def step_tflop(
    config,
    prompts: int,
    group: int,
    prompt_len: int,
    new_tokens: int,
    *,
    remat: bool,
    share_prompts: bool,
    reference: bool,
) -> dict[str, float]:
    """Matmul TFLOPs of one step's stages (2 per multiply-add; the embedding lookup is free).

    The rollout prefills each prompt once and decodes B = prompts x group rows; teacher-forced
    passes run the prompt once per group when shared; the update is forward + backward (2x)
    + one more forward with remat.
    """
    from jaxrl4llm.models.transformer import flops_per_token

    B, P, T = prompts * group, prompt_len, new_tokens
    layer, unembed, attn = flops_per_token(config)

    prefill = prompts * P * layer + prompts * unembed + prompts * P * P / 2 * attn
    decode = B * T * (layer + unembed) + B * T * (P + T / 2) * attn
    prompt_rows = prompts if share_prompts else B
    forward = (
        prompt_rows * P * layer
        + B * T * (layer + unembed)
        + (prompt_rows * P * P / 2 + B * T * (P + T / 2)) * attn
    )
    return {
        "rollout": (prefill + decode) / 1e12,
        "reference": forward / 1e12 if reference else 0.0,
        "update": forward * (4 if remat else 3) / 1e12,
    }


def _child(args) -> dict:
    import jax

    from jaxrl4llm.data import make_source
    from jaxrl4llm.models import registry
    from jaxrl4llm.rewards import make_reward_fn
    from jaxrl4llm.sampling.context import RolloutContext
    from jaxrl4llm.train import host_memory, packing
    from jaxrl4llm.train.config import TrainConfig, param_dtype
    from jaxrl4llm.train.rollout import rollout
    from jaxrl4llm.train.step import compile_train_step, train_step
    from tools import bench_sampler
    from tools.bench_trl import step_records, xla_threads

    packed_update = args.child.startswith(PACKED)
    param_name, _, compute_name = args.child.removeprefix(PACKED).partition(":")
    dtype = param_dtype(param_name)
    # The matmul rate is probed before the steps and again after them, and the best is the
    # floor's rate: one probe can land on a slow moment (after the steps it once read 112
    # GFLOP/s in float32 where the sampler bench measured 199-210 minutes apart), and a slow
    # probe inflates floor_share.
    probe_dtype = param_dtype(compute_name or param_name)
    probe_before = bench_sampler.measure_matmul_gflops(probe_dtype)
    t0 = time.perf_counter()
    model_config, params, tokenizer = registry.load_model(args.model, dtype=dtype)
    load_s = time.perf_counter() - t0
    config = TrainConfig().replace(
        model=args.model,
        param_dtype=param_name,
        compute_dtype=compute_name or None,
        prompts_per_step=args.prompts,
        group_size=args.group,
        max_new_tokens=args.new_tokens,
        algorithm="grpo",
        learning_rate=1e-6,
        answer_mode="lenient",
        remat=args.remat,
        share_prompts=args.share_prompts,
        kl_coef=args.kl_coef,
        kl_in="loss" if args.kl_coef > 0 else None,
    )
    model_config = config.model.compute_config(model_config)  # as the trainer does
    config = lora_config(args, config)
    # The reference weights are a second copy only when the KL term needs them (LoRA: the
    # base itself, as the trainer does).
    state, policy, ref_params, lora_static = trained_state(config, model_config, params)
    source = make_source("synthetic:arithmetic", split="train")
    reward_fn = make_reward_fn("auto", answer_mode="lenient")
    # No stop tokens: every completion is exactly --new_tokens long.
    ctx = RolloutContext.create(
        model_config, tokenizer, reward_fn, None, config.data, config.rollout, stop_ids=()
    )
    rows = []
    for step in range(1 + args.repeats):  # step 0 compiles
        records = step_records(source, step, args.prompts)
        t_step = time.perf_counter()
        batch, m = rollout(ctx, config, policy(state), ref_params, records, jax.random.key(step))
        prompt_group = batch.layout.prompt_group(batch.keep_B.shape[0])
        real_prompt_tokens = int(batch.seqs.prompt_mask_BP.sum())
        prompt_columns = int(batch.seqs.prompt_tokens_BP.shape[1])
        host_memory.release_free_memory()  # as the trainer does between rollout and update
        t0 = time.perf_counter()
        static = dict(
            model_config=model_config,
            algorithm=config.update_algorithm,
            optimizer=config.optimizer,
            num_micro=1,
            temperature=config.rollout.sampling.effective_temperature,
            remat=config.model.remat,
            prompt_group=prompt_group,
            **lora_static,
        )
        flops_ratio = {}
        if packed_update:  # as the trainer does: packed on the host, prompts in the rows
            flops = packing.SlotFlops.of(model_config)
            static["packed"] = packing.pack(
                batch.seqs,
                args.micro_batch_tokens,
                flops=flops,
                share_prompts=batch.layout.share_prompts,
            )
            rows_, completion = batch.seqs.completion_tokens_BT.shape
            flops_ratio["update_flops_packed"] = packing.packed_flops(
                static["packed"], flops
            ) / flops.padded(rows_, prompt_columns, completion, prompt_group)
            batch = packing.for_update(batch)
        if step == 0:
            compile_train_step(state, batch, **static)  # as the trainer does
        state, um = train_step(state, batch, **static)
        jax.block_until_ready(um)
        update_s = time.perf_counter() - t0
        step_s = time.perf_counter() - t_step
        new_tokens = args.prompts * args.group * args.new_tokens
        trained = int(real_prompt_tokens + batch.seqs.completion_mask_BT.sum())
        rows.append(
            {
                "rollout_s": m["time/rollout_s"],
                "reward_s": m["time/reward_s"],
                "reference_s": m["time/logprobs_s"],
                "update_s": update_s,
                "step_s": step_s,
                "sample_tok_s": new_tokens / m["time/rollout_s"],
                "update_tok_s": trained / update_s,
                **flops_ratio,
            }
        )
    reward_fn.close()
    peak_rss = host_memory.peak_rss_gib()  # before the matmul probe below allocates anything
    timed = rows[1:]
    mean = {k: sum(r[k] for r in timed) / len(timed) for k in timed[0]}
    # The compute floor: this step's matmul FLOPs at the best matmul rate measured here.
    peak_gflops = max(probe_before, bench_sampler.measure_matmul_gflops(probe_dtype))
    tflop = step_tflop(
        model_config,
        args.prompts,
        args.group,
        prompt_columns,
        args.new_tokens,
        remat=config.model.remat,
        share_prompts=config.rollout.share_prompts,
        reference=config.needs_reference,
    )
    floor_s = sum(tflop.values()) * 1e3 / peak_gflops
    mean.update(
        dtype=f"lora{args.lora_rank}/{args.child}" if args.lora_child else args.child,
        compile_step_s=rows[0]["step_s"],
        load_s=load_s,
        peak_rss_gib=peak_rss,
        step_tflop=sum(tflop.values()),
        matmul_gflops=peak_gflops,
        floor_s=floor_s,
        floor_share=floor_s / mean["step_s"],
        xla_threads=xla_threads(),
        device=str(jax.devices()[0].platform),
    )
    return mean


PACKED = "packed/"  # a child spec's prefix: our step with the packed update
LORA = "lora/"  # a side's prefix: our step with --lora_rank adapters (run_child)


def lora_config(args: argparse.Namespace, config):
    """The child's TrainConfig, with --lora_rank / --lora_targets in the LoRA child."""
    if not args.lora_child:
        return config
    return config.replace(lora_rank=args.lora_rank, lora_targets=tuple(args.lora_targets))


def trained_state(config, model_config, params):
    """(TrainState, state -> the params the sampler reads, the reference params, train_step's
    LoRA keywords), as the trainer sets them up (train/services.py): full fine-tuning trains
    `params` (the reference a copy), LoRA trains adapters on the frozen base (the reference)."""
    import jax
    import jax.numpy as jnp

    from jaxrl4llm.train import adapters
    from jaxrl4llm.train.state import TrainState

    lora = config.lora
    if not lora.enabled:
        ref_params = jax.tree.map(jnp.copy, params) if config.needs_reference else None
        return (
            TrainState.create(params, config.optimizer, seed=0),
            lambda s: s.params,
            ref_params,
            {},
        )
    trained = adapters.trainable(lora, model_config, params, seed=0)
    state = TrainState.create(trained, config.optimizer, seed=0)
    ref_params = params if config.needs_reference else None
    return (
        state,
        lambda s: adapters.policy(lora, params, s.params),
        ref_params,
        dict(frozen=params, lora=lora),
    )


def lora_targets(value: str) -> list[str]:
    """--lora_targets: "all" or comma-separated projections -> their names."""
    from jaxrl4llm.models.lora import TARGETS

    names = list(TARGETS) if value == "all" else [t for t in value.split(",") if t]
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{value!r}: give all or some of {','.join(TARGETS)}")
    return names


def dtype_list(values: list[str]) -> list[str]:
    """`--dtypes float32 bfloat16` and `--dtypes=float32,bfloat16` -> ["float32", "bfloat16"]."""
    return [d for v in values for d in v.split(",") if d]


def child_flags(args: argparse.Namespace) -> list[str]:
    """Every option but --dtypes / --child, spelled out for a child process."""
    flags = [
        f"--{k}={v}"
        for k, v in vars(args).items()
        if k
        not in (
            "dtypes",
            "child",
            "remat",
            "share_prompts",
            "trl",
            "rounds",
            "debug",
            "lora_child",
            "lora_targets",
        )
        and v is not None
    ]
    return (
        flags
        + ([] if args.remat else ["--no_remat"])
        + ([] if args.share_prompts else ["--no_share_prompts"])
        + ["--debug"] * args.debug
        + [f"--lora_targets={','.join(args.lora_targets)}"]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        help="space- or comma-separated PARAM[:COMPUTE] dtypes, e.g. float32 "
        "float32:bfloat16 (float32 master weights, bfloat16 compute)",
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run ours and TRL in turns this many times per dtype (each a fresh "
        "process pair) and keep each side's fastest step: the machine's "
        "slow minutes then hit both sides alike",
    )
    parser.add_argument(
        "--kl_coef",
        type=float,
        default=0.0,
        help="GRPO's KL coefficient (0.04 in the paper): > 0 adds the reference "
        "pass; 0 (default) matches TRL's default beta = 0",
    )
    parser.add_argument(
        "--no_remat",
        dest="remat",
        action="store_false",
        help="keep every layer's activations (much more memory)",
    )
    parser.add_argument(
        "--no_share_prompts",
        dest="share_prompts",
        action="store_false",
        help="run every row's prompt (not once per group) in the reference and update passes",
    )
    parser.add_argument(
        "--no_trl",
        dest="trl",
        action="store_false",
        help="do not time TRL's GRPOTrainer even if trl is installed",
    )
    parser.add_argument(
        "--omp_wait_policy",
        choices=("PASSIVE", "ACTIVE"),
        default=None,
        help="OMP_WAIT_POLICY for the child processes (default: torch's own). "
        "On a loaded machine torch's spinning OpenMP workers slow it "
        "several-fold; PASSIVE keeps its thread count but lets them sleep",
    )
    parser.add_argument(
        "--micro_batch_tokens",
        type=int,
        default=0,
        help="also run our step with the update on packed micro-batches of this many "
        "tokens (0: only the padded update)",
    )
    parser.add_argument(
        "--lora_rank",
        type=int,
        default=0,
        help="also run our step with LoRA adapters of this rank on the frozen base, in "
        "its own process, and compare it with full fine-tuning (0: off)",
    )
    parser.add_argument(
        "--lora_targets",
        type=lora_targets,
        default="all",
        help="projections the LoRA run adapts: all, or some of q,k,v,o,gate,up,down",
    )
    parser.add_argument("--lora_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--hf_dir", default=None, help=argparse.SUPPRESS)
    return parser


def run_child(args: argparse.Namespace, child: str) -> dict | None:
    """Runs this script as `--child=CHILD` (its own process: its own peak RSS); a CHILD of
    LORA + dtype runs our step with --lora_rank adapters (`--child=dtype --lora_child`)."""
    lora = child.startswith(LORA)
    cmd = [sys.executable, os.path.abspath(__file__), f"--child={child.removeprefix(LORA)}"]
    cmd += child_flags(args) + ["--lora_child"] * lora
    env = dict(os.environ)
    if args.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        print(
            f"--child={child} failed (exit {out.returncode}):\n{out.stderr[-4000:]}",
            file=sys.stderr,
        )
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def fastest(results: list[dict | None]) -> dict | None:
    """The result with the shortest step of one side's rounds (None if any round failed),
    with `rounds` = how many were run and `step_s_rounds` = every round's step."""
    if not results or any(r is None for r in results):
        return None
    best = min(results, key=lambda r: r["step_s"])
    return {**best, "rounds": len(results), "step_s_rounds": [r["step_s"] for r in results]}


def load_average() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_table(cols: tuple[str, ...], rows: list[dict]) -> None:
    width = {
        c: max([13, len(c)] + [len(r[c]) for r in rows if isinstance(r[c], str)]) for c in cols
    }
    print(" | ".join(f"{c:>{width[c]}s}" for c in cols))
    for r in rows:
        print(
            " | ".join(
                f"{r[c]:>{width[c]}s}" if isinstance(r[c], str) else f"{r[c]:>{width[c]}.2f}"
                for c in cols
            )
        )


def print_comparison(ours: list[dict], theirs: list[dict]) -> None:
    """Ours against TRL per dtype, and our step against its same-run compute floor."""
    print(
        f"ours vs TRL {theirs[0]['trl']} GRPOTrainer (torch {theirs[0]['torch']}, threads: "
        f"XLA {ours[0]['xla_threads']}, torch {theirs[0]['torch_threads']}, OMP_WAIT_POLICY "
        f"{theirs[0]['omp_wait_policy']}); TRL's completions: "
        f"{theirs[0]['mean_new_tokens']:.1f} tokens on average"
    )
    rows = [
        {
            "dtype": o["dtype"],
            "ours_step_s": o["step_s"],
            "trl_step_s": t["step_s"],
            "ratio": o["step_s"] / t["step_s"],
            # The reward's cost depends on the sampled texts (which differ between the sides).
            "ratio_no_reward": (o["step_s"] - o["reward_s"]) / (t["step_s"] - t["reward_s"]),
            "ours_rss_gib": o["peak_rss_gib"],
            "trl_rss_gib": t["peak_rss_gib"],
            "rss_ratio": o["peak_rss_gib"] / t["peak_rss_gib"],
            "floor_share": o["floor_share"],
        }
        for o, t in zip(ours, theirs)
    ]
    print_table(tuple(rows[0]), rows)
    print(
        "ratio = ours / TRL step time (target <= 0.75), ratio_no_reward the same without the "
        "reward's time; rss_ratio = ours / TRL peak RSS (target <= 0.5); floor_share = our "
        "compute floor / our step (target >= 0.70)"
    )


def print_lora_comparison(full: list[dict], lora: list[dict]) -> None:
    """Full fine-tuning against LoRA per dtype (the same rounds: about the same load)."""
    rows = []
    for f, a in zip(full, lora):
        row = {"dtype": f["dtype"], "lora": a["dtype"].partition("/")[0]}
        for key, name in (
            ("step_s", "step_s"),
            ("update_s", "update_s"),
            ("peak_rss_gib", "rss_gib"),
        ):
            row.update(
                {f"full_{name}": f[key], f"lora_{name}": a[key], f"{name}_ratio": a[key] / f[key]}
            )
        rows.append(row)
    print("full fine-tuning vs LoRA (ratio = LoRA / full)")
    print_table(tuple(rows[0]), rows)


def run_rounds(args: argparse.Namespace, dtype: str, with_trl: bool) -> dict | None:
    """Each side's fastest of --rounds rounds in turns (ours, ours packed with
    --micro_batch_tokens, TRL), so the sides see about the same load; None if a run failed."""
    sides = {"ours": dtype}
    if args.lora_rank:
        sides["lora"] = LORA + dtype
    if args.micro_batch_tokens:
        sides["packed"] = PACKED + dtype
    if with_trl:
        sides["trl"] = f"trl/{dtype}"
    rounds: dict[str, list] = {side: [] for side in sides}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"{dtype}: round {i + 1} of {args.rounds} ({load_average()})", flush=True)
        for side, child in sides.items():
            rounds[side].append(run_child(args, child))
            if rounds[side][-1] is None:
                return None
    return {side: fastest(results) for side, results in rounds.items()}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1:
        parser.error(f"--rounds={args.rounds} --repeats={args.repeats}: both must be >= 1.")
    if args.child:
        from tools import bench_trl

        if args.child == "export":
            bench_trl.export_model(args.model, args.hf_dir)
            result = {"hf_dir": args.hf_dir}
        elif args.child.startswith("trl/"):
            result = bench_trl.run_trl(args, args.child[len("trl/") :], args.hf_dir)
        else:
            result = _child(args)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    from tools import bench_trl

    with_trl = args.trl and bench_trl.trl_available()
    if args.trl and not with_trl:
        print(bench_trl.TRL_MISSING)
    print(f"before: {load_average()}", flush=True)
    ours, packed, theirs, lora = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_train_hf_") as hf_dir:
        args.hf_dir = hf_dir
        if with_trl and run_child(args, "export") is None:
            return 1
        for dtype in dtype_list(args.dtypes):
            best = run_rounds(args, dtype, with_trl)
            if best is None:
                return 1
            ours.append(best["ours"])
            if "packed" in best:
                packed.append(best["packed"])
            if "lora" in best:
                lora.append(best["lora"])
            if with_trl:
                theirs.append(best["trl"])
    print(f"after: {load_average()}")
    print(
        f"GRPO step: {args.prompts} prompts x {args.group} samples x {args.new_tokens} new "
        f"tokens (forced), KL coef {args.kl_coef}, {args.model}, device {ours[0]['device']}"
    )
    print_table(
        (
            "dtype",
            "rollout_s",
            "reward_s",
            "reference_s",
            "update_s",
            "step_s",
            "sample_tok_s",
            "update_tok_s",
            "peak_rss_gib",
            "compile_step_s",
            "step_tflop",
            "matmul_gflops",
            "floor_s",
            "floor_share",
        ),
        ours + lora + packed,
    )
    if args.rounds > 1:
        for side, results in (("ours", ours), ("ours", lora), ("ours", packed), ("TRL", theirs)):
            for r in results:
                print(
                    f"{side} {r['dtype']}: steps of the {r['rounds']} rounds "
                    + ", ".join(f"{x:.2f}" for x in r["step_s_rounds"])
                    + " s (the fastest is kept)"
                )
    if lora:
        print_lora_comparison(ours, lora)
    for r, p in zip(ours, packed):  # same run, same machine load
        print(
            f"{p['dtype']} / {r['dtype']}: step {p['step_s'] / r['step_s']:.2f}x, update "
            f"{p['update_s'] / r['update_s']:.2f}x the time; modelled update FLOPs "
            f"{p['update_flops_packed']:.3f}x"
        )
    for r in ours[1:]:
        print(
            f"{r['dtype']} / {ours[0]['dtype']}: step "
            f"{r['step_s'] / ours[0]['step_s']:.2f}x, update "
            f"{r['update_s'] / ours[0]['update_s']:.2f}x, rollout "
            f"{r['rollout_s'] / ours[0]['rollout_s']:.2f}x the time"
        )
    if with_trl:
        print(
            "TRL GRPOTrainer (rollout_s: its _generate; reward_s: its _calculate_rewards, of "
            "which verify_s in our reward function; update_s: step - rollout - reward)"
        )
        print_table(
            (
                "dtype",
                "rollout_s",
                "reward_s",
                "verify_s",
                "update_s",
                "step_s",
                "peak_rss_gib",
                "compile_step_s",
            ),
            theirs,
        )
        print_comparison(ours, theirs)
        if packed:  # today's ratio above, the packed update's here
            print_comparison(packed, theirs)
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
