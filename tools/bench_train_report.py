"""The tables tools/bench_train.py prints from its children's results: our stages per dtype,
every round's step, full fine-tuning against LoRA, the packed update against the padded one,
each dtype against the first, TRL's stages, and ours against TRL.
"""

from __future__ import annotations

import argparse


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
        f"{theirs[0]['omp_wait_policy']}, torch CPU kernels "
        f"{theirs[0].get('torch_cpu_capability', '?')}); TRL's completions: "
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


def print_report(
    args: argparse.Namespace,
    ours: list[dict],
    lora: list[dict],
    packed: list[dict],
    theirs: list[dict],
) -> None:
    """Every table of one run: `theirs` (TRL's results) is empty when TRL was not timed."""
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
    if theirs:
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
