"""Our side of tools/bench_train.py: one GRPO step on the trainer's own functions, in a child
process (`--child=PARAM[:COMPUTE]`), timed per stage, with its compute floor.

A warm-up step compiles everything, then `--repeats` timed steps run; the result is their
mean, the peak RSS, and the step's matmul FLOPs at the best matmul rate measured in the same
process (probed before and after the steps). A child spec prefixed with PACKED runs the update
on packed micro-batches of --micro_batch_tokens tokens; --lora_child trains rank --lora_rank
adapters on the frozen base. Heavy imports (jax, the library) happen inside the functions, so
bench_train's parent process and `--help` stay light.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay inside the functions at run time
    from jaxrl4llm.models.config import ModelConfig
    from jaxrl4llm.train.config import TrainConfig

PACKED = "packed/"  # a child spec's prefix: our step with the packed update


def step_tflop(
    config: ModelConfig,
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


def run_ours(args: argparse.Namespace) -> dict:
    """One child's timed steps of our side (see the module docstring): the mean row and the
    run's figures, as bench_train prints them."""
    import jax

    from jaxrl4llm.data import make_source
    from jaxrl4llm.models import registry
    from jaxrl4llm.rewards import make_reward_fn
    from jaxrl4llm.sampling.context import RolloutContext
    from jaxrl4llm.train.config import TrainConfig, param_dtype
    from jaxrl4llm.train.infra import host_memory
    from jaxrl4llm.train.programs import StepPrograms
    from jaxrl4llm.train.rollout.stage import rollout
    from jaxrl4llm.train.update import packing
    from jaxrl4llm.train.updater import compile_ahead
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
    model_config = config.model.compute_config(model_config)  # --compute_dtype
    config = lora_config(args, config)
    programs = StepPrograms(config, model_config, None)  # the trainer's programs, no mesh
    # The reference weights are a second copy only when the KL term needs them (LoRA: the
    # base itself, like train/services.py).
    state, policy, ref_params, frozen = trained_state(config, model_config, params)
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
        batch, m = rollout(
            ctx,
            config,
            policy(state),
            ref_params,
            records,
            jax.random.key(step),
            programs=programs,
        )
        prompt_group = programs.update_group(batch)
        real_prompt_tokens = int(batch.seqs.prompt_mask_BP.sum())
        prompt_columns = int(batch.seqs.prompt_tokens_BP.shape[1])
        host_memory.release_free_memory()  # the sampler's freed buffers, before the update
        t0 = time.perf_counter()
        inputs = dict(frozen=frozen, dropout_key=None, packed=None)
        flops_ratio = {}
        if packed_update:  # packed on the host, the prompts in the rows (one host)
            flops = packing.SlotFlops.of(model_config)
            inputs["packed"] = packing.pack(
                batch.seqs,
                args.micro_batch_tokens,
                flops=flops,
                share_prompts=batch.layout.share_prompts,
            )
            rows_, completion = batch.seqs.completion_tokens_BT.shape
            flops_ratio["update_flops_packed"] = packing.packed_flops(
                inputs["packed"], flops
            ) / flops.padded(rows_, prompt_columns, completion, prompt_group)
            batch = packing.for_update(batch)
        update = programs.policy_update(prompt_group, ())
        if step == 0:
            compile_ahead(update, state, batch, **inputs)  # the updater's compile-then-free
        state, um = update(state, batch, **inputs)
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


def lora_config(args: argparse.Namespace, config: TrainConfig) -> TrainConfig:
    """The child's TrainConfig, with --lora_rank / --lora_targets in the LoRA child."""
    if not args.lora_child:
        return config
    return config.replace(lora_rank=args.lora_rank, lora_targets=tuple(args.lora_targets))


def trained_state(config, model_config, params):
    """(TrainState, state -> the params the sampler reads, the reference params, the frozen
    base or None), set up like train/services.py: full fine-tuning trains `params` (the
    reference a copy), LoRA trains adapters on the frozen base (the reference)."""
    import jax
    import jax.numpy as jnp

    from jaxrl4llm.train.update import adapters
    from jaxrl4llm.train.update.state import TrainState

    lora = config.lora
    if not lora.enabled:
        ref_params = jax.tree.map(jnp.copy, params) if config.needs_reference else None
        return (
            TrainState.create(params, config.optimizer, seed=0),
            lambda s: s.params,
            ref_params,
            None,
        )
    trained = adapters.trainable(lora, model_config, params, seed=0)
    state = TrainState.create(trained, config.optimizer, seed=0)
    ref_params = params if config.needs_reference else None
    return (
        state,
        lambda s: adapters.policy(lora, params, s.params),
        ref_params,
        params,
    )
