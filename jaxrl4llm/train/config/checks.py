"""The checks of a whole TrainConfig (`validate`): each flag's value on its own, then the
flags that must agree (batch sizes and the mesh, packing, multi-turn, PPO's critic, partial
rollouts, data, reward), each failing with a FlagError that names the flag and the fix."""

from __future__ import annotations

import importlib.util
import math
import os

import jax
from absl import logging

from jaxrl4llm import envs, parallel, rl
from jaxrl4llm.config import options, paths
from jaxrl4llm.config.errors import DependencyError, flag_errors
from jaxrl4llm.config.options import require
from jaxrl4llm.data import prompts
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.rewards.shaping import SCALES
from jaxrl4llm.sampling import page_pool, paged, rounds
from jaxrl4llm.sampling.buckets import LONG_PROMPT_MODES
from jaxrl4llm.sampling.config import ROLLOUT_ENGINES, RolloutConfig
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.groups import DTYPES, PACKAGES, RouterConfig

PARTIAL_ONE_HOST_ONLY = (
    "--partial_rollout_tokens picks rows on the host and runs on one host only; "
    "use one host, or --partial_rollout_tokens=0."
)


def check_installed(names: tuple[str, ...]) -> None:
    """Raises DependencyError naming the install command of a tracker's missing package."""
    for name in names:
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise DependencyError(
                f"--trackers={name} needs the {module} package, which is not installed: "
                f"pip install '{extra}' (or drop {name} from --trackers)."
            )


def validate(
    config: TrainConfig,
    num_devices: int,
    data_parallel: int | None = None,
    num_hosts: int | None = None,
) -> TrainConfig:
    """`config` itself, or a FlagError naming the flag and the fix for any bad value, before
    anything is loaded or compiled: the run's one check of its whole config (train.loop.run
    calls it first, before the workdir lock). num_hosts: the run's processes (default: this
    run's; tools/plan.py passes its topology's)."""
    with flag_errors():  # a sub-config's ValueError names its flag too
        validate_all(
            config,
            num_devices,
            data_parallel,
            jax.process_count() if num_hosts is None else num_hosts,
        )
    return config


def validate_all(
    config: TrainConfig, num_devices: int, data_parallel: int | None, num_hosts: int
) -> None:
    """Every check of `config` (`validate`: `num_hosts` resolved, inside flag_errors)."""
    _validate_values(config)
    _validate_turns(config)
    _validate_reward(config)
    if config.rollout.env:
        envs.parse_env(config.rollout.env)  # FlagError naming --env and the valid names
        require(
            num_hosts == 1,
            f"--env={config.rollout.env} runs multi-turn rollouts, which run on one host "
            f"(this run has {num_hosts}): their host loop starts a program for each "
            "reply as it arrives, and the hosts of one run cannot start them in the same "
            "order. Run on one host (a mesh of its devices works) or drop --env.",
        )
    _validate_data(config)
    run, e = config.run, config.evaluation
    workdir = run.workdir
    require(
        paths.is_remote(workdir) or not os.path.exists(workdir) or os.path.isdir(workdir),
        f"--workdir={workdir} is a file, not a folder: name a new or existing folder for the "
        "run's outputs.",
    )
    require(
        e.eval_every >= 0 and e.eval_prompts >= -1 and e.eval_samples >= 1,
        "--eval_every must be >= 0, --eval_prompts >= -1 (-1 = all) and --eval_samples >= 1.",
    )
    e.sets  # raises on a malformed --eval_sets, naming the item
    prompts.expand(config.data.system_prompt)
    prompts.expand(config.data.instruction, "--instruction")
    prompts.example_turns(config.data.example)
    _validate_batches(config, num_devices, data_parallel)
    _validate_engine(config)
    _validate_packing(config, num_devices, data_parallel, num_hosts)
    rl.validate(config.algorithm, config.rollout.group_size)
    _validate_critic(config)
    _validate_partial(config, num_hosts)
    a = config.algorithm
    require(
        a.is_correction is None or config.keeps_behaviour_logprobs,
        f"--is_correction={a.is_correction} reweights by the trainer's pi_old over the "
        f"sampler's logprobs, but with {config.updates_per_step} updates per rollout and "
        "--norecompute_old_logprobs pi_old is the sampler's (ratio 1); set "
        "--recompute_old_logprobs or drop --is_correction.",
    )
    require(not (a.advantage == "remax" and num_hosts > 1), rounds.ONE_HOST_ONLY)
    _validate_rollout_inputs(a)
    config.optimizer.validate()
    config.lora.validate()
    require(
        config.model.init_adapter is None or config.lora.enabled,
        f"--init_adapter={config.model.init_adapter} starts LoRA adapters, but --lora_rank "
        "is 0: resolve the adapter's settings first (TrainConfig.with_init_adapter), "
        "or drop --init_adapter.",
    )


def _validate_values(config: TrainConfig) -> None:
    """Each value on its own: finite numbers, known dtypes, counts >= 1."""
    r, u, run = config.rollout, config.update, config.run
    for name, value in options.flatten(config).items():  # nan / inf slip through float()
        numbers = value if isinstance(value, tuple) else (value,)
        require(
            all(math.isfinite(x) for x in numbers if isinstance(x, float)),
            f"--{name}={options.format_value(value)} is not a finite number.",
        )
    require(
        config.model.param_dtype in DTYPES,
        f"--param_dtype={config.model.param_dtype!r}: choose {DTYPES}.",
    )
    require(
        config.model.compute_dtype in (None,) + DTYPES,
        f"--compute_dtype={config.model.compute_dtype!r}: choose {DTYPES}.",
    )
    require(r.prompts_per_step >= 1, "--prompts_per_step must be >= 1.")
    require(r.group_size >= 1, "--group_size must be >= 1.")
    _validate_dynamic_sampling(r)
    require(
        r.max_new_tokens >= 1 and r.max_prompt_tokens >= 1,
        "--max_new_tokens and --max_prompt_tokens must be >= 1.",
    )
    require(u.ppo_epochs >= 1, "--ppo_epochs must be >= 1.")
    require(
        u.micro_batch_tokens >= 0,
        f"--micro_batch_tokens={u.micro_batch_tokens} must be >= 0 (0 = off).",
    )
    require(
        u.micro_batch_length_classes >= 1,
        f"--micro_batch_length_classes={u.micro_batch_length_classes} must be >= 1 "
        "(1 = every micro-batch at the mini-batch's longest completion).",
    )
    require(u.max_nonfinite_steps >= 1, "--max_nonfinite_steps must be >= 1.")
    require(run.num_steps >= 1, "--num_steps must be >= 1.")
    require(
        run.checkpoint_every >= 1,
        f"--checkpoint_every={run.checkpoint_every} must be "
        ">= 1 (the run also saves at its end and when preempted).",
    )
    require(
        run.keep_checkpoints >= 1,
        f"--keep_checkpoints={run.keep_checkpoints} must be "
        ">= 1: a run resumes from its latest checkpoint; to save less often, raise "
        "--checkpoint_every.",
    )
    require(r.long_prompts in LONG_PROMPT_MODES, "--long_prompts: choose error or drop.")
    check_installed(run.tracker_names)  # a bad name: ValueError naming the flag
    if run.tensorboard is not None:
        logging.warning(
            "--%stensorboard is deprecated and goes in the next release: use --trackers=%s.",
            "" if run.tensorboard else "no",
            ",".join(run.tracker_names),
        )
    require(
        r.decode_slots >= 0,
        f"--decode_slots={r.decode_slots} must be >= 0 (0: every "
        "row at once, finished rows compacted away).",
    )


def _validate_router(config: TrainConfig) -> None:
    """What the router options combine with (whether the model is a mixture of experts is
    checked when it loads: check_router)."""
    u = config.update
    if config.router.routing_replay:
        require(
            config.records_routing,
            "--routing_replay replays the routing the single-turn samplers record; "
            "drop --env and --partial_rollout_tokens, or --routing_replay.",
        )
    require(
        not (config.router.enabled and u.micro_batch_tokens),
        f"--micro_batch_tokens={u.micro_batch_tokens}: the packed passes carry neither the "
        "routing record nor the router's losses; drop it (0), or the router flags.",
    )


def check_router(config: TrainConfig, model: ModelConfig) -> None:
    """Router flags on a dense model: refused (FlagError), once the model's config is read."""
    set_flags = [
        f"--{name}"
        for name in ("routing_replay", "router_aux_loss_coef", "router_z_loss_coef")
        if getattr(config.router, name) != getattr(RouterConfig(), name)
    ]
    require(
        not set_flags or bool(model.moe_layers),
        f"{', '.join(set_flags)}: --model={config.model.name} is dense (no "
        "mixture-of-experts layer, no router); drop them.",
    )


def _validate_dynamic_sampling(r: RolloutConfig) -> None:
    require(
        not (r.dynamic.dynamic_sampling and r.group_size < 2),
        "--dynamic_sampling keeps groups with both correct and wrong samples; it needs "
        f"--group_size >= 2, got {r.group_size}.",
    )


def _validate_turns(config: TrainConfig) -> None:
    """Multi-turn rollouts' limits (--max_turns, --max_total_tokens, ...)."""
    r = config.rollout
    t = r.turns
    require(t.max_turns >= 1, f"--max_turns={t.max_turns} must be >= 1 (1: single-turn).")
    require(
        t.max_total_tokens >= 0 and t.max_observation_tokens >= 0,
        f"--max_total_tokens={t.max_total_tokens} and --max_observation_tokens="
        f"{t.max_observation_tokens} must be >= 0 (--max_total_tokens=0: "
        "--max_new_tokens).",
    )
    require(
        t.max_turns == 1 or r.partial_rollout_tokens == 0,
        f"--max_turns={t.max_turns} does not combine with --partial_rollout_tokens: "
        "multi-turn trajectories finish within their step; drop one of them.",
    )


def _data_parallel(config: TrainConfig, num_devices: int) -> int:
    """data x fsdp of --mesh on `num_devices` devices (an abstract mesh: no device used)."""
    sizes = parallel.MeshSpec.parse(config.run.mesh).resolve(num_devices)
    return parallel.data_parallel_size(jax.sharding.AbstractMesh(sizes, parallel.MESH_AXES))


def _validate_batches(config: TrainConfig, num_devices: int, data_parallel: int | None) -> None:
    """Mini-, micro- and rollout micro-batches divide the batch and fill the mesh."""
    r, run = config.rollout, config.run
    B = config.batch_size
    require(
        B % config.mini_batch == 0,
        f"--mini_batch_size={config.mini_batch} does not divide the batch of "
        f"{B} rows (prompts_per_step {r.prompts_per_step} x group_size "
        f"{r.group_size}); pick a divisor of {B}.",
    )
    require(
        config.mini_batch % config.micro_batch == 0,
        f"--micro_batch_size={config.micro_batch} does not divide the mini-batch of "
        f"{config.mini_batch} rows; pick a divisor of {config.mini_batch}.",
    )
    if data_parallel is None:
        data_parallel = _data_parallel(config, num_devices)
    require(
        config.micro_batch % data_parallel == 0,
        f"The micro-batch of {config.micro_batch} rows cannot be split over the "
        f"{data_parallel} data-parallel devices of --mesh={run.mesh}; make "
        "--micro_batch_size a multiple of data*fsdp.",
    )
    R = r.rollout_micro_batch
    require(
        R == 0 or (R > 0 and B % R == 0 and R % r.group_size == 0 and R % data_parallel == 0),
        f"--rollout_micro_batch={R} must divide the batch of {B} rows and be a multiple "
        f"of --group_size={r.group_size} and of the {data_parallel} data-parallel "
        f"devices of --mesh={run.mesh} (or 0: all rows at once).",
    )


def _validate_engine(config: TrainConfig) -> None:
    """--rollout_engine and --kv_cache_tokens: the page pool and what the engine runs
    (docs/architecture.md, "Rollout kinds and engines"); the router flags' needs of it."""
    _validate_router(config)
    r = config.rollout
    require(
        r.rollout_engine != "compacted",
        "--rollout_engine=compacted: the fixed-batch compacted sampler is no longer a trainer "
        "engine; every rollout kind runs on the paged engine, which gives its samples "
        '(docs/architecture.md, "Rollout kinds and engines"). Drop the flag; '
        "--rollout_micro_batch and --kv_cache_tokens bound its memory.",
    )
    require(
        r.rollout_engine in ROLLOUT_ENGINES,
        f"--rollout_engine={r.rollout_engine!r}: choose one of {', '.join(ROLLOUT_ENGINES)}.",
    )
    require(r.kv_cache_tokens >= 0, f"--kv_cache_tokens={r.kv_cache_tokens} must be >= 0.")
    require(
        not (r.decode_slots and r.kv_cache_tokens),
        f"--decode_slots={r.decode_slots} is an alias of --kv_cache_tokens (the KV of that "
        "many fixed slots); set one of them.",
    )
    if r.decode_slots:
        logging.warning(
            "--decode_slots is a deprecated alias and goes in the next release: use "
            "--kv_cache_tokens=%d (the KV %d slots held).",
            *(r.pool_tokens, r.decode_slots),
        )
    if r.env or r.turns.max_turns > 1:
        _validate_paged_turns(config)
        return
    G = r.group_size if r.share_prompts else 1
    # The --decode_slots alias may round below a group's pages; the engine raises it there.
    ps, tokens = paged.PAGE_SIZE, r.kv_cache_tokens
    need = page_pool.min_pool_pages(r.max_prompt_tokens, r.max_new_tokens, G, ps) * ps
    require(
        tokens == 0 or tokens >= need,
        f"--kv_cache_tokens={tokens} holds less than one group at full length "
        f"({need} tokens: a {r.max_prompt_tokens}-token prompt once and {G} rows of "
        f"{r.max_new_tokens} new tokens in {ps}-token pages); use --kv_cache_tokens={need} "
        "or more, or 0 (every row at full length).",
    )


def _validate_paged_turns(config: TrainConfig) -> None:
    """Multi-turn rollouts on pages (sampling/paged_turns.py): a pool (per batch shard) of
    at least one row at full length (prompt and turn budget)."""
    r = config.rollout
    # The pool the sampler gets: --decode_slots's is sized by --max_new_tokens, not the turns'.
    ps, tokens = paged.PAGE_SIZE, r.pool_tokens
    pool = f"--kv_cache_tokens={tokens}"
    if r.decode_slots:
        pool = f"--decode_slots={r.decode_slots} ({tokens} tokens of KV)"
    budget = r.turns.max_total_tokens or r.max_new_tokens
    need = math.ceil((r.max_prompt_tokens + budget) / ps) * ps
    require(
        tokens == 0 or tokens >= need,
        f"{pool} holds less than one multi-turn row at full length ({need} tokens: a "
        f"{r.max_prompt_tokens}-token prompt and a {budget}-token budget in {ps}-token "
        f"pages); use --kv_cache_tokens={need} or more, or 0 (every "
        "row at full length).",
    )


def _validate_packing(
    config: TrainConfig, num_devices: int, data_parallel: int | None, num_hosts: int
) -> None:
    """--micro_batch_tokens: every sequence fits one device's row; what packing excludes."""
    N, r = config.update.micro_batch_tokens, config.rollout
    if N == 0:
        return
    dp = data_parallel or _data_parallel(config, num_devices)
    longest = r.max_prompt_tokens + r.max_new_tokens
    require(
        N >= dp * longest,
        f"--micro_batch_tokens={N} must be 0 (off) or >= {dp * longest}: each of the "
        f"{dp} data-parallel devices of --mesh={config.run.mesh} packs rows of "
        f"N / {dp} tokens, and the longest sequence is --max_prompt_tokens="
        f"{r.max_prompt_tokens} + --max_new_tokens={r.max_new_tokens} = {longest} tokens.",
    )
    require(
        config.update.micro_batch_length_classes == 1,
        f"--micro_batch_length_classes={config.update.micro_batch_length_classes} sorts "
        f"padded micro-batches by length; with --micro_batch_tokens={N} the update packs "
        "its sequences instead: drop one.",
    )
    require(
        num_hosts == 1,
        f"--micro_batch_tokens={N} packs each mini-batch on the host, which needs all "
        f"of its rows: run on one host (this run has {num_hosts}) or set it to 0.",
    )


def _validate_rollout_inputs(a: rl.AlgorithmConfig) -> None:
    """Estimators that read what the rollout does not record."""
    require(
        a.advantage != "otb",
        "--advantage=otb needs the sampling policy's sum of squared token probabilities "
        "(sum_pi_squared_BT), which the trainer's rollout does not record; it runs through "
        "jaxrl4llm.rl.compute_advantages only. Choose another --advantage.",
    )


def _validate_critic(config: TrainConfig) -> None:
    c = config.critic
    require(c.warmup_steps >= 0, f"--critic_warmup_steps={c.warmup_steps} must be >= 0.")
    require(
        c.learning_rate is None or c.learning_rate > 0,
        f"--critic_learning_rate={c.learning_rate} must be > 0 (or unset: 10 x --learning_rate).",
    )
    require(
        config.needs_critic
        or (c.model is None and c.learning_rate is None and c.warmup_steps == 0),
        f"--critic_model / --critic_learning_rate / --critic_warmup_steps are set but "
        f"--algorithm={config.algorithm.name} trains no critic; use --algorithm=ppo (or "
        "--advantage=gae), or drop the critic flags.",
    )


def _validate_partial(config: TrainConfig, num_hosts: int) -> None:
    """Partial rollouts: the budget, the staleness bound and what they do not combine with."""
    r, a = config.rollout, config.algorithm
    N, K = r.partial_rollout_tokens, r.max_staleness
    require(K >= 0, f"--max_staleness={K} must be >= 0 (steps a carried group may wait).")
    if not N:
        require(
            K == RolloutConfig.max_staleness,
            f"--max_staleness={K} applies only to partial rollouts: set "
            "--partial_rollout_tokens too, or drop --max_staleness.",
        )
        return
    require(
        0 < N < r.max_new_tokens,
        f"--partial_rollout_tokens={N} must be in [1, --max_new_tokens="
        f"{r.max_new_tokens}) (0 = off): a budget of --max_new_tokens or more finishes "
        "every row in one round.",
    )
    unsupported = [
        flag
        for flag, on in (
            ("--dynamic_sampling", r.dynamic.dynamic_sampling),
            ("--advantage=remax", a.advantage == "remax"),
            ("--norecompute_old_logprobs", not config.update.recompute_old_logprobs),
        )
        if on
    ]
    require(
        not unsupported,
        f"--partial_rollout_tokens={N} does not combine with {', '.join(unsupported)}: "
        "partial rollouts fill the batch with finished groups themselves and take pi_old "
        "from the recomputed logprobs; drop those, or set --partial_rollout_tokens=0.",
    )
    require(num_hosts == 1, PARTIAL_ONE_HOST_ONLY)


def _validate_data(config: TrainConfig) -> None:
    """Flags that a data source would ignore (the source itself is read, and checked, by
    the trainer before the model loads)."""
    d = config.data
    kind = (
        d.source.partition(":")[0]
        if ":" in d.source
        else ("name" if d.source.isidentifier() else "file")
    )
    require(
        d.revision is None or kind in ("hf", "name"),
        f"--data_revision={d.revision} applies to hf: sources and registered names "
        f"only, not --data={d.source}; drop it.",
    )
    own = [
        f"--{k}"
        for k, v in (("prompt_field", d.prompt_field), ("answer_field", d.answer_field))
        if v
    ]
    require(
        not own or kind not in ("synthetic", "gym", "name"),
        f"{' and '.join(own)} name columns, but --data={d.source} brings its own "
        "fields; drop them (they apply to hf:, jsonl:, parquet: and tfds: sources).",
    )


def _validate_reward(config: TrainConfig) -> None:
    """The reward flags that rewards.shaping and the verifier pool would otherwise refuse
    only when the reward function is built, after the model has loaded."""
    w, r = config.reward, config.rollout
    require(w.scale in SCALES, f"--reward_scale: choose one of {SCALES}.")
    require(
        w.format_penalty >= 0,
        f"--format_penalty={w.format_penalty} must be >= 0 (it is "
        "subtracted from the reward of a completion without a final answer).",
    )
    require(
        not (w.scale == "logic_rl" and w.format_penalty),
        f"--format_penalty={w.format_penalty} does not apply to --reward_scale=logic_rl, "
        "which has its own format reward; leave --format_penalty at 0.",
    )
    require(
        0 <= w.overlong_buffer <= r.max_new_tokens,
        f"--overlong_buffer={w.overlong_buffer} must be in [0, --max_new_tokens="
        f"{r.max_new_tokens}] (0 = no overlong punishment).",
    )
    require(
        w.overlong_penalty >= 0,
        f"--overlong_penalty={w.overlong_penalty} must be >= 0 (it is subtracted).",
    )
    require(
        w.memory_limit_mb >= 0,
        f"--memory_limit_mb={w.memory_limit_mb} must be >= 0 (0 = no limit).",
    )
    w.shaping, w.pool  # their own checks, now rather than when the reward is built
