"""TRL's GRPOTrainer on the work of one tools/bench_train.py step: the reference side.

The same model (our GGUF weights exported to a Hugging Face folder, as bench_sampler does for
transformers), the same prompts and reward, P prompts x G samples forced to exactly
--new_tokens tokens (max = min new tokens: EOS is suppressed, as our side samples with no stop
tokens), the same KL coefficient (default off: TRL's beta = 0, no reference model), one rollout
per optimizer step over all P x G rows in one micro-batch (our num_micro = 1), per-layer
recomputation (gradient checkpointing) when ours remats, AdamW at our defaults. torch gets the
same number of threads as XLA's CPU pool. This module imports only the standard library at its
top, so bench_train can tell whether trl is installed without importing torch.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any, Sequence

TRL_MISSING = (
    "trl is not installed: timing our side only (pip install -e '.[bench]' "
    "for the GRPOTrainer comparison)"
)


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None


def xla_threads() -> int:
    """XLA's CPU pool size (one thread per core in the affinity mask), as bench_sampler."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    count = os.cpu_count()
    assert count is not None, "os.cpu_count() cannot tell how many cores this host has"
    return count


def step_records(source: Sequence[Any], step: int, prompts: int) -> list[Any]:
    """The prompts of step `step`: the same on both sides."""
    return [source[(step * prompts + i) % len(source)] for i in range(prompts)]


def compute_dtype_name(dtype: str) -> str:
    """'PARAM[:COMPUTE]' -> the dtype the passes compute in."""
    param_name, _, compute_name = dtype.partition(":")
    return compute_name or param_name


def trl_config_kwargs(
    *,
    prompts: int,
    group: int,
    new_tokens: int,
    dtype: str,
    remat: bool,
    kl_coef: float,
    steps: int,
    output_dir: str,
    use_cpu: bool,
) -> dict[str, Any]:
    """GRPOConfig arguments for `steps` optimizer steps of our bench step's work.

    TRL counts its batch in rows (completions), not prompts: one step generates
    generation_batch_size = per_device_train_batch_size x steps_per_generation rows,
    num_generations per prompt, and takes one optimizer step per
    gradient_accumulation_steps micro-batches.
    """
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=prompts * group,  # every row in one micro-batch
        gradient_accumulation_steps=1,  # ours: num_micro = 1
        steps_per_generation=1,  # one rollout per optimizer step
        num_iterations=1,  # no old-policy pass (nor ours)
        num_generations=group,
        max_steps=steps,
        max_completion_length=new_tokens,
        generation_kwargs={"min_new_tokens": new_tokens},  # EOS suppressed: forced length
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=kl_coef,  # 0 (TRL's default): no KL term, no reference model; > 0: k3 in
        # the loss, as our GRPO
        loss_type="grpo",
        scale_rewards="group",  # our GRPO: seq-mean-token-mean, /std
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        gradient_checkpointing=remat,  # TRL's default True; ours --remat
        # bf16 compute on CPU is torch autocast, which transformers allows only with use_cpu.
        bf16=compute_dtype_name(dtype) == "bfloat16",
        fp16=False,
        use_cpu=use_cpu,
        shuffle_dataset=False,
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


def export_model(model: str, folder: str) -> None:
    """Our float32 weights and tokenizer -> a transformers folder (run in its own process, so
    neither side's peak RSS includes the other's framework)."""
    from jaxrl4llm.models import registry, weights

    config, params, tokenizer = registry.load_model(model)
    weights.export_hf(params, config, folder, tokenizer=tokenizer)


class _Timer:
    """Wraps a trainer method and adds its wall time to `seconds` (per step)."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t0


def run_trl(args: Any, dtype: str, hf_dir: str) -> dict[str, Any]:
    """Warm-up step + `args.repeats` timed GRPOTrainer steps; means and peak RSS."""
    import tempfile

    import datasets
    import torch
    import transformers
    import trl

    from jaxrl4llm.data import make_source
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.rewards import make_reward_fn
    from jaxrl4llm.train.infra import host_memory

    torch.set_num_threads(xla_threads())
    torch_dtype = torch.bfloat16 if dtype.partition(":")[0] == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    load_s = time.perf_counter() - t0

    steps = 1 + args.repeats
    source = make_source("synthetic:arithmetic", split="train")
    records = [r for step in range(steps) for r in step_records(source, step, args.prompts)]
    data = DataConfig()
    dataset = datasets.Dataset.from_list(
        [{"prompt": data.messages(r), "index": i} for i, r in enumerate(records)]
    )
    reward_fn = make_reward_fn("auto", answer_mode="lenient")
    lengths: list[int] = []

    verify_s: list[float] = []

    def reward(prompts, completions, completion_ids, index, **_):
        lengths.extend(len(c) for c in completion_ids)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        t0 = time.perf_counter()
        rewards = reward_fn(texts, [records[i] for i in index]).rewards
        verify_s.append(time.perf_counter() - t0)
        return [float(x) for x in rewards]

    step_times: list[float] = []
    stage_times: list[tuple[float, float]] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()
            generate.seconds = score.seconds = 0.0

        def on_step_end(self, *_, **__):
            step_times.append(time.perf_counter() - self.t0)
            stage_times.append((generate.seconds, score.seconds))

    with tempfile.TemporaryDirectory(prefix="bench_trl_") as out_dir:
        config = trl.GRPOConfig(
            **trl_config_kwargs(
                prompts=args.prompts,
                group=args.group,
                new_tokens=args.new_tokens,
                dtype=dtype,
                remat=args.remat,
                kl_coef=args.kl_coef,
                steps=steps,
                output_dir=out_dir,
                use_cpu=not torch.cuda.is_available(),
            )
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        generate = trainer._generate = _Timer(trainer._generate)
        score = trainer._calculate_rewards = _Timer(trainer._calculate_rewards)
        trainer.train()
    reward_fn.close()
    if len(step_times) != steps:
        raise RuntimeError(f"TRL ran {len(step_times)} optimizer steps, expected {steps}")
    timed, stages = step_times[1:], stage_times[1:]
    step_s = sum(timed) / len(timed)
    rollout_s = sum(g for g, _ in stages) / len(stages)
    reward_s = sum(r for _, r in stages) / len(stages)
    return {
        "dtype": dtype,
        "step_s": step_s,
        "rollout_s": rollout_s,
        "reward_s": reward_s,
        "update_s": step_s - rollout_s - reward_s,
        "compile_step_s": step_times[0],
        "load_s": load_s,
        "verify_s": sum(verify_s[1:]) / len(timed),
        "peak_rss_gib": host_memory.peak_rss_gib(),
        "mean_new_tokens": sum(lengths) / max(len(lengths), 1),
        "torch_threads": torch.get_num_threads(),
        "trl": trl.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
