"""AlgorithmConfig (every knob of the RL math, as data), the choices of its knobs and the
checks: a config is checked when it is built (``AlgorithmConfig(...)``, ``get_preset``,
``dataclasses.replace``), and ``validate`` adds the checks against the group size.

Every preset is a value of ``AlgorithmConfig``, never a subclass (the named presets live in
presets.py); algorithms.py's entry points read it. The estimators and losses a config names
are looked up in registry.py (the built-in ones register in estimators.py and objectives.py).

AlgorithmConfig is a pytree whose float hyperparameters are its leaves (TRACED_FIELDS) and
everything else static: pass it as a static jit argument (hashable) to specialise on every
value, or as an ordinary argument to trace the floats, so that a schedule of kl_coef, the
clip bounds, entropy_coef or the IS caps does not recompile. A traced value is not range-
checked (there is nothing concrete to check).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxrl4llm.config.options import require
from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import correction, filters, losses, registry

# The registries' names, live: a loss or estimator registered later is among them.
ADVANTAGES = registry.ADVANTAGES
OBJECTIVES = registry.POLICY_LOSSES
KL_PLACES = ("loss", "reward", None)
IMPORTANCE = ("token", "sequence")
REJECTED_ROWS = ("drop", "zero")
# The built-in estimators whose per-sequence advantage takes the KL penalty as token rewards
# (the registry's kl_in_reward="sequence" entries; a registered one declares its own).
SEQUENCE_ADVANTAGES = ("normalized", "rloo", "remax", "opo", "grpo_passk", "passk", "gpg")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """All knobs of the RL math. Hashable, so it can be a static jit argument.

    name: Algorithm preset (a config built from a preset keeps its name; every other knob
        overrides the preset where it is set).
    advantage: Advantage estimator (registry.ADVANTAGES): "normalized" (mean/std below),
        "rloo", "reinforce_pp", "reinforce_pp_baseline", "positives" (A = 1 on RAFT positives,
        other rows rejected), "remax" (A = r minus the reward of the prompt's greedy
        completion), "gae" (PPO: GAE on a learned critic's values, whitened over the batch),
        "opo" (r minus the length-weighted group mean), "grpo_passk" (verl's pass@k GRPO: the
        best row of a group learns r_max - r_second), "passk" (pass@k training's analytical
        advantage, needs passk_k), "gpg" (B / (B - M) times r minus the group mean) or "otb"
        (the optimal token baseline; needs the sampler's sum of squared probabilities).
    mean, std: Scopes of the normalized advantage's mean and std ("group", "batch", "none");
        std also switches grpo_passk's division by the group std ("none": no division).
    ddof: Std degrees of freedom (1 = torch.std, 0 = numpy); also for REINFORCE++ whitening.
    eps: Added to the std of the normalized advantage, of REINFORCE++ whitening, of
        grpo_passk and of passk.
    objective: Policy loss (registry.POLICY_LOSSES): "clipped" (PPO's clipped surrogate),
        "nll" (RAFT's log-likelihood on positives), "cispo" (clipped stop-gradient IS weight on
        a REINFORCE token loss), "sapo" (soft gate instead of the clip), "gmpo" (geometric
        mean of the token ratios, clipped in log space by clip_low / clip_high), "clip_cov"
        and "kl_cov" (high-covariance tokens detached / KL-penalised) or "gpg" (-A log pi).
    agg: Loss aggregation over tokens and sequences (see losses.AGG_MODES).
    max_tokens: The constant of "seq-mean-token-sum-norm" (none = the padded completion
        length T).
    clip_low, clip_high: Ratio clip range [1 - clip_low, 1 + clip_high] (clip_low >= 1: no
        lower bound); for gmpo the log-ratio range [-clip_low, clip_high].
    importance: Importance ratio of the clipped surrogate: "token" (PPO / GRPO, one ratio per
        token) or "sequence" (GSPO: exp of the mean token log-ratio of the sequence, clipped
        per sequence).
    dual_clip: Dual-clip constant c > 1 for negative advantages (none = off; objectives
        clipped and clip_cov).
    kl_in: Where the KL to the reference goes: "loss" (kl_coef * agg(KL) added to the loss),
        "reward" (token rewards: REINFORCE++ returns, or A_i - kl_coef * sum_{s>=t} KL_s for
        per-sequence estimators, as OpenRLHF) or none.
    kl_estimator: KL estimator: k1, k2 or k3.
    kl_coef: KL coefficient (>= 0).
    k3_clamp: Cap on the k3 KL estimate per token (10 as verl's low_var_kl and OpenRLHF; none
        = no cap).
    entropy_coef: Entropy bonus coefficient (loss -= entropy_coef * agg(H)).
    reject_all_correct, reject_all_wrong: Drop groups whose samples are all correct / all
        wrong.
    rejected_rows: Rows rejected by the group filters or by RAFT's selection: "drop" (out of
        the loss's numerator and every denominator) or "zero" (kept in the loss with advantage
        0, so they count in its denominators, KL and entropy terms, as Minimal-RL's code).
    overlong_filter: Drop samples that hit max_new_tokens without a stop token from the loss.
    positives: RAFT selection, "correct" or "best" (see filters.raft_positives).
    binary_reward: None to use the verifier's reward as is, or "wrong,right" to replace it by
        a value chosen from `correct` (e.g. -1,1 or 0,1).
    gamma: GAE discount (advantage="gae").
    lam: GAE lambda (advantage="gae"): 1 = Monte-Carlo returns minus V, 0 = one-step TD.
    value_clip: Clip of the critic's new values around its rollout values in the value loss
        (advantage="gae"; none = unclipped).
    is_correction: Correction of the sampler-trainer gap, a per-token weight on the
        policy-gradient term from the ratio pi_old / mu of the trainer's and the sampler's
        logprobs: tis (truncated IS, min(ratio, is_cap)), mis (masked IS: the ratio, 0 outside
        [is_lower, is_upper]), icepop (mis per token), geo_mask (drop a sequence whose
        geometric-mean token ratio is outside [is_lower, is_upper]); none = no correction.
    is_level: Ratio of tis and mis: per token, or per sequence (the product of its token
        ratios).
    is_cap: Truncation of the tis ratio (verl's rollout_is_threshold).
    is_lower, is_upper: Band of the ratio kept by mis, icepop and geo_mask (IcePop: 0.5, 2).
    sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for tokens with A > 0 and A <= 0
        (objective sapo; 1.0 and 1.05 as the paper and verl).
    clip_cov_ratio: Clip-Cov: fraction of the batch's valid tokens detached at most (2e-4 as
        the authors' scripts and verl).
    clip_cov_lb, clip_cov_ub: Clip-Cov: covariance band of the candidate tokens (1 and 5 as
        the authors' scripts and verl).
    kl_cov_ratio: KL-Cov: fraction of the batch's valid tokens penalised (2e-3 as the authors'
        7B script; verl's default 2e-4 is their 32B one).
    kl_cov_coef: KL-Cov: coefficient of the |log ratio| penalty (1 as the authors' scripts;
        verl's yaml has 0.1).
    passk_k: The k of advantage passk (at most group_size; none for every other estimator).
    otb_zero_tail: advantage otb: a group's unique longest row gets baseline 0 past the
        second-longest length (verl's handle_zero_tail, off by default).
    """

    name: str = "custom"
    advantage: str = "normalized"
    mean: str = "group"
    std: str = "group"
    ddof: int = 1
    eps: float = 1e-6
    objective: str = "clipped"
    agg: str = "token-mean"
    max_tokens: Optional[int] = None
    clip_low: float = 0.2
    clip_high: float = 0.2
    importance: str = "token"
    dual_clip: Optional[float] = None
    kl_in: Optional[str] = None
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    k3_clamp: Optional[float] = losses.K3_CLAMP
    entropy_coef: float = 0.0
    reject_all_correct: bool = False
    reject_all_wrong: bool = False
    rejected_rows: str = "drop"
    overlong_filter: bool = False
    positives: str = "correct"
    binary_reward: Optional[tuple[float, float]] = None
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: Optional[float] = 0.2
    is_correction: Optional[str] = None
    is_level: str = "token"
    is_cap: float = 2.0
    is_lower: float = 0.5
    is_upper: float = 2.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-3
    kl_cov_coef: float = 1.0
    passk_k: Optional[int] = None
    otb_zero_tail: bool = False

    def __post_init__(self) -> None:
        check(self)


# The float hyperparameters: pytree leaves, so they may be traced values.
TRACED_FIELDS = tuple(
    f.name for f in dataclasses.fields(AlgorithmConfig) if f.type in ("float", "Optional[float]")
)
jax.tree_util.register_dataclass(
    AlgorithmConfig,
    data_fields=list(TRACED_FIELDS),
    meta_fields=[
        f.name for f in dataclasses.fields(AlgorithmConfig) if f.name not in TRACED_FIELDS
    ],
)


def _concrete(x: Any) -> bool:
    """Whether x is a number to check now: a Python or numpy scalar, not a traced value or an
    abstract array (those are checked when they are concrete)."""
    return isinstance(x, (int, float, np.number)) and not isinstance(x, bool)


def _check(value: Any, ok: Callable[[Any], bool], message: str) -> None:
    """require(ok(value)) for a concrete number; a traced value passes (its caller's)."""
    require(not _concrete(value) or ok(value), message)


def validate(config: AlgorithmConfig, group_size: int) -> AlgorithmConfig:
    """Raise ValueError naming the knob and the fix when knobs contradict each other or the
    group size; return config. The checks run in a fixed order: the first that fails is the
    one reported."""
    G = group_size
    require(isinstance(G, int) and G >= 1, f"group_size must be a positive int, got {G!r}.")
    check(config)
    _validate_group_size(config, G)
    return config


def check(c: AlgorithmConfig) -> None:
    """The checks that need no group size (run when a config is built)."""
    _validate_choices(c)
    _validate_ranges(c)
    _validate_loss_knobs(c)
    _validate_correction(c)
    if c.binary_reward is not None:
        require(
            len(c.binary_reward) == 2,
            f"binary_reward={c.binary_reward!r} must be a pair (wrong, right), e.g. (-1.0, 1.0).",
        )
    _validate_combinations(c)
    _validate_objective(c)


def _validate_choices(c: AlgorithmConfig) -> None:
    """Each string knob is one of its choices (k3_clamp, the KL estimate's cap, is checked
    among them)."""
    require(c.advantage in ADVANTAGES, f"advantage={c.advantage!r}: choose one of {ADVANTAGES}.")
    require(c.mean in adv_lib.MEANS, f"mean={c.mean!r}: choose one of {adv_lib.MEANS}.")
    require(c.std in adv_lib.STDS, f"std={c.std!r}: choose one of {adv_lib.STDS}.")
    require(c.objective in OBJECTIVES, f"objective={c.objective!r}: choose one of {OBJECTIVES}.")
    require(c.agg in losses.AGG_MODES, f"agg={c.agg!r}: choose one of {losses.AGG_MODES}.")
    require(c.importance in IMPORTANCE, f"importance={c.importance!r}: choose one of {IMPORTANCE}.")
    require(c.kl_in in KL_PLACES, f"kl_in={c.kl_in!r}: choose one of {KL_PLACES}.")
    require(
        c.kl_estimator in losses.KL_ESTIMATORS,
        f"kl_estimator={c.kl_estimator!r}: choose one of {losses.KL_ESTIMATORS}.",
    )
    require(
        c.rejected_rows in REJECTED_ROWS,
        f"rejected_rows={c.rejected_rows!r}: choose one of {REJECTED_ROWS}.",
    )
    _check(
        c.k3_clamp,
        lambda x: x > 0,
        f"k3_clamp={c.k3_clamp!r} must be > 0 (default 10) or None (no cap).",
    )
    require(
        c.positives in filters.POSITIVE_SELECTIONS,
        f"positives={c.positives!r}: choose one of {filters.POSITIVE_SELECTIONS}.",
    )


def _finite_at_least(low: float) -> Callable[[Any], bool]:
    return lambda x: math.isfinite(x) and x >= low


def _validate_ranges(c: AlgorithmConfig) -> None:
    """Each numeric knob is in its range."""
    require(
        isinstance(c.ddof, int) and c.ddof >= 0,
        f"ddof={c.ddof!r} must be an int >= 0 (1 = torch.std, 0 = numpy default).",
    )
    _check(c.eps, lambda x: x > 0, f"eps={c.eps!r} must be > 0 (default 1e-6).")
    _check(
        c.gamma,
        lambda x: 0 <= x <= 1,
        f"gamma={c.gamma!r} must be in [0, 1] (1 = no discount, PPO's default).",
    )
    _check(
        c.lam,
        lambda x: 0 <= x <= 1,
        f"lam={c.lam!r} must be in [0, 1] (GAE lambda; verl / OpenRLHF use 0.95 or 1).",
    )
    _check(
        c.value_clip,
        lambda x: x > 0,
        f"value_clip={c.value_clip!r} must be > 0 (e.g. 0.2) or None (no clip).",
    )
    _check(
        c.clip_low,
        _finite_at_least(0.0),
        f"clip_low={c.clip_low!r} must be finite and >= 0 (>= 1: no lower bound).",
    )
    _check(
        c.clip_high, _finite_at_least(0.0), f"clip_high={c.clip_high!r} must be finite and >= 0."
    )
    _check(
        c.dual_clip,
        lambda x: x > 1,
        f"dual_clip={c.dual_clip!r} must be > 1 (typically 3.0) or None.",
    )
    require(
        c.max_tokens is None or c.max_tokens >= 1,
        f"max_tokens={c.max_tokens!r} must be >= 1 or None (= padded length).",
    )
    _check(c.kl_coef, _finite_at_least(0.0), f"kl_coef={c.kl_coef!r} must be finite and >= 0.")
    _check(c.entropy_coef, math.isfinite, f"entropy_coef={c.entropy_coef!r} must be finite.")


def _validate_loss_knobs(c: AlgorithmConfig) -> None:
    """The knobs of the 2025 losses and estimators, in their ranges."""
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        value = getattr(c, name)
        _check(value, lambda x: math.isfinite(x) and x > 0, f"{name}={value!r} must be > 0.")
    for name in ("clip_cov_ratio", "kl_cov_ratio"):
        value = getattr(c, name)
        _check(
            value,
            lambda x: 0 < x <= 1,
            f"{name}={value!r} must be in (0, 1] (a fraction of tokens).",
        )
    if _concrete(c.clip_cov_lb) and _concrete(c.clip_cov_ub):
        require(
            c.clip_cov_lb < c.clip_cov_ub,
            f"clip_cov_lb={c.clip_cov_lb!r} must be below clip_cov_ub={c.clip_cov_ub!r} "
            "(the covariance band of Clip-Cov's candidates).",
        )
    _check(
        c.kl_cov_coef,
        _finite_at_least(0.0),
        f"kl_cov_coef={c.kl_cov_coef!r} must be finite and >= 0.",
    )
    require(
        c.passk_k is None or (isinstance(c.passk_k, int) and c.passk_k >= 1),
        f"passk_k={c.passk_k!r} must be an int >= 1 (the k of pass@k) or None.",
    )


def _validate_group_size(c: AlgorithmConfig, G: int) -> None:
    """The knobs that need more than one completion per prompt."""
    if c.advantage == "normalized":
        require(
            not (c.std == "group" and G <= c.ddof),
            f"std='group' with ddof={c.ddof} needs group_size > {c.ddof}, got {G}: every "
            "group std would be undefined; use std='batch' or std='none', or sample more "
            "completions per prompt.",
        )
        require(
            not (c.mean == "group" and G == 1),
            "mean='group' with group_size=1 makes every advantage 0; use mean='batch' or "
            "'none', or sample more completions per prompt.",
        )
    need = registry.advantage_entry(c.advantage).min_group_size
    require(
        G >= need,
        f"advantage={c.advantage!r} needs group_size >= {need} (a group baseline), got {G}.",
    )
    require(
        not ((c.reject_all_correct or c.reject_all_wrong) and G == 1),
        "reject_all_correct/reject_all_wrong with group_size=1 reject every correct/wrong "
        "sample; set them to False or sample more completions per prompt.",
    )
    require(
        c.passk_k is None or c.passk_k <= G,
        f"passk_k={c.passk_k} needs group_size >= {c.passk_k} (pass@k over a group), got {G}.",
    )


def _validate_combinations(c: AlgorithmConfig) -> None:
    """Knobs that contradict each other: the KL's place, estimator and coefficient, RAFT's
    objective, and the knobs of one estimator set for another."""
    # A traced kl_coef is a rebuilt copy of a config already checked with its number.
    kl_on = _concrete(c.kl_coef) and c.kl_coef > 0
    require(
        not (kl_on and c.kl_in is None),
        f"kl_coef={c.kl_coef} but kl_in=None, so the KL would be ignored; set kl_in='loss' "
        "(or 'reward' for REINFORCE++), or kl_coef=0.",
    )
    takes = registry.advantage_entry(c.advantage).kl_in_reward
    require(
        not (c.kl_in == "reward" and takes is None),
        f"kl_in='reward' needs an advantage that takes token rewards (normalized, rloo, "
        f"reinforce_pp, reinforce_pp_baseline, ...), not advantage={c.advantage!r}; use "
        "kl_in='loss' instead.",
    )
    require(
        not (c.kl_in == "reward" and c.kl_estimator == "k3"),
        "kl_in='reward' uses kl_estimator 'k1' or 'k2' (REINFORCE++); set kl_estimator='k1' "
        "or 'k2'.",
    )
    require(
        not (c.objective == "nll" and c.advantage != "positives"),
        f"objective='nll' (RAFT) trains on positives only; set advantage='positives' "
        f"(got {c.advantage!r}).",
    )
    require(
        (c.passk_k is not None) == (c.advantage == "passk"),
        f"passk_k={c.passk_k} with advantage={c.advantage!r}: advantage='passk' needs passk_k "
        "(the k of pass@k) and no other estimator reads it.",
    )
    require(
        not (c.otb_zero_tail and c.advantage != "otb"),
        f"otb_zero_tail applies to advantage='otb' only (got {c.advantage!r}); drop it.",
    )


def _validate_objective(c: AlgorithmConfig) -> None:
    """What the policy loss declares in the registry: its aggregations, dual clip and GSPO's
    sequence ratio."""
    entry = registry.policy_loss_entry(c.objective)
    require(
        entry.aggs is None or c.agg in entry.aggs,
        f"objective={c.objective!r} is defined for agg in {entry.aggs} only (got "
        f"agg={c.agg!r}); set agg={entry.aggs[0]!r}."
        if entry.aggs
        else "",
    )
    require(
        c.dual_clip is None or entry.dual_clip,
        f"dual_clip={c.dual_clip} applies to objectives that clip the surrogate (clipped, "
        f"clip_cov), not objective={c.objective!r}; drop dual_clip.",
    )
    require(
        c.importance == "token" or entry.sequence_ratio,
        f"importance='sequence' (GSPO) applies to objective='clipped', not "
        f"objective={c.objective!r}; set importance='token'.",
    )


def _validate_correction(c: AlgorithmConfig) -> None:
    require(
        c.is_correction in correction.CORRECTIONS,
        f"is_correction={c.is_correction!r}: choose one of {correction.CORRECTIONS}.",
    )
    require(
        c.is_level in correction.IS_LEVELS,
        f"is_level={c.is_level!r}: choose one of {correction.IS_LEVELS}.",
    )
    _check(
        c.is_cap,
        lambda x: math.isfinite(x) and x > 0,
        f"is_cap={c.is_cap!r} must be finite and > 0 (the tis truncation, e.g. 2).",
    )
    if _concrete(c.is_lower) and _concrete(c.is_upper):
        require(
            0 <= c.is_lower < c.is_upper and math.isfinite(c.is_upper),
            f"is_lower={c.is_lower!r}, is_upper={c.is_upper!r}: the kept ratio band needs "
            "0 <= is_lower < is_upper < inf (IcePop: 0.5, 2).",
        )
    require(
        c.is_level == "token" or c.is_correction in correction.LEVELLED,
        f"is_level={c.is_level!r} applies to is_correction tis and mis only "
        f"(is_correction={c.is_correction!r} has its own level); set is_level=token.",
    )
