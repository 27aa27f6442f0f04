"""AlgorithmConfig (every knob of the RL math, as data), the choices of its knobs and
``validate``, the one check of a config against the group size.

Every preset is a value of ``AlgorithmConfig``, never a subclass (the named presets live in
presets.py); algorithms.py's entry points read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from jaxrl4llm.config.options import require
from jaxrl4llm.rl import advantages as adv_lib
from jaxrl4llm.rl import correction, filters, losses

ADVANTAGES = (
    "normalized",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "positives",
    "remax",
    "gae",
)
OBJECTIVES = ("clipped", "nll")
KL_PLACES = ("loss", "reward", None)
IMPORTANCE = ("token", "sequence")
REJECTED_ROWS = ("drop", "zero")
# Estimators whose per-sequence advantage can take the KL penalty as token rewards.
SEQUENCE_ADVANTAGES = ("normalized", "rloo", "remax")


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    """All knobs of the RL math. Hashable, so it can be a static jit argument.

    name: Algorithm preset (a config built from a preset keeps its name; every other knob
        overrides the preset where it is set).
    advantage: "normalized" (mean/std below), "rloo", "reinforce_pp", "reinforce_pp_baseline",
        "positives" (A = 1 on RAFT positives, other rows rejected), "remax" (A = r minus the
        reward of the prompt's greedy completion, sampled beside the group) or "gae" (PPO:
        GAE on a learned critic's values, whitened over the batch; trains the critic).
    mean, std: Scopes of the normalized advantage's mean and std ("group", "batch", "none").
    ddof: Std degrees of freedom (1 = torch.std, 0 = numpy); also for REINFORCE++ whitening.
    eps: Added to the std of the normalized advantage and of REINFORCE++ whitening.
    objective: "clipped" (PPO clipped surrogate) or "nll" (RAFT log-likelihood on positives).
    agg: Loss aggregation over tokens and sequences (see losses.AGG_MODES).
    max_tokens: The constant of "seq-mean-token-sum-norm" (none = the padded completion
        length T).
    clip_low, clip_high: Ratio clip range [1 - clip_low, 1 + clip_high].
    importance: Importance ratio of the clipped surrogate: "token" (PPO / GRPO, one ratio per
        token) or "sequence" (GSPO: exp of the mean token log-ratio of the sequence, clipped
        per sequence).
    dual_clip: Dual-clip constant c > 1 for negative advantages (none = off).
    kl_in: Where the KL to the reference goes: "loss" (kl_coef * agg(KL) added to the loss),
        "reward" (token rewards: REINFORCE++ returns, or A_i - kl_coef * sum_{s>=t} KL_s for
        the normalized and rloo estimators, as OpenRLHF) or none.
    kl_estimator: KL estimator: k1, k2 or k3.
    kl_coef: KL coefficient (>= 0).
    k3_clamp: Cap on the k3 KL estimate per token (10 as verl's low_var_kl and OpenRLHF; none
        = no cap).
    log_kl_ref: Log the KL to the reference (policy/kl_ref, kl_estimator) even when no KL term
        is in the loss or reward; loads the reference model.
    entropy_coef: Entropy bonus coefficient (loss -= entropy_coef * agg(H)).
    reject_all_correct, reject_all_wrong: Drop groups whose samples are all correct / all
        wrong.
    rejected_rows: Rows rejected by the group filters or by RAFT's selection: "drop" (out of
        the loss's numerator and every denominator) or "zero" (kept in the loss with advantage
        0, so they count in its denominators, KL and entropy terms, as Minimal-RL's code).
    overlong_filter: Drop samples that hit max_new_tokens without a stop token from the loss.
    dynamic_sampling: DAPO's dynamic sampling: the trainer resamples (next prompts) until the
        batch holds prompts_per_step groups with both correct and wrong samples.
    max_resample_rounds: Cap on dynamic sampling's extra rollout rounds per step; a batch
        still short is filled with groups without spread (kept out of the loss by
        reject_all_correct / reject_all_wrong).
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
    log_kl_ref: bool = False
    entropy_coef: float = 0.0
    reject_all_correct: bool = False
    reject_all_wrong: bool = False
    rejected_rows: str = "drop"
    overlong_filter: bool = False
    dynamic_sampling: bool = False
    max_resample_rounds: int = 10
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


def validate(config: AlgorithmConfig, group_size: int) -> AlgorithmConfig:
    """Raise ValueError naming the knob and the fix when knobs contradict; return config.
    The checks run in a fixed order: the first that fails is the one reported."""
    c, G = config, group_size
    require(isinstance(G, int) and G >= 1, f"group_size must be a positive int, got {G!r}.")
    _validate_choices(c)
    _validate_ranges(c, G)
    _validate_correction(c)
    if c.binary_reward is not None:
        require(
            len(c.binary_reward) == 2,
            f"binary_reward={c.binary_reward!r} must be a pair (wrong, right), e.g. (-1.0, 1.0).",
        )
    _validate_group_size(c, G)
    _validate_combinations(c)
    return config


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
    require(
        c.k3_clamp is None or c.k3_clamp > 0,
        f"k3_clamp={c.k3_clamp!r} must be > 0 (default 10) or None (no cap).",
    )
    require(
        c.positives in filters.POSITIVE_SELECTIONS,
        f"positives={c.positives!r}: choose one of {filters.POSITIVE_SELECTIONS}.",
    )


def _validate_ranges(c: AlgorithmConfig, G: int) -> None:
    """Each numeric knob is in its range (dynamic sampling needs groups of two)."""
    require(
        isinstance(c.ddof, int) and c.ddof >= 0,
        f"ddof={c.ddof!r} must be an int >= 0 (1 = torch.std, 0 = numpy default).",
    )
    require(
        isinstance(c.max_resample_rounds, int) and c.max_resample_rounds >= 0,
        f"max_resample_rounds={c.max_resample_rounds!r} must be an int >= 0 "
        "(extra rounds per step).",
    )
    require(
        not (c.dynamic_sampling and G < 2),
        "dynamic_sampling keeps groups with both correct and wrong samples; it needs "
        f"group_size >= 2, got {G}.",
    )
    require(c.eps > 0, f"eps={c.eps!r} must be > 0 (default 1e-6).")
    require(
        0 <= c.gamma <= 1, f"gamma={c.gamma!r} must be in [0, 1] (1 = no discount, PPO's default)."
    )
    require(
        0 <= c.lam <= 1,
        f"lam={c.lam!r} must be in [0, 1] (GAE lambda; verl / OpenRLHF use 0.95 or 1).",
    )
    require(
        c.value_clip is None or c.value_clip > 0,
        f"value_clip={c.value_clip!r} must be > 0 (e.g. 0.2) or None (no clip).",
    )
    require(
        0 <= c.clip_low < 1, f"clip_low={c.clip_low!r} must be in [0, 1) so that 1 - clip_low > 0."
    )
    require(c.clip_high >= 0, f"clip_high={c.clip_high!r} must be >= 0.")
    require(
        c.dual_clip is None or c.dual_clip > 1,
        f"dual_clip={c.dual_clip!r} must be > 1 (typically 3.0) or None.",
    )
    require(
        c.max_tokens is None or c.max_tokens >= 1,
        f"max_tokens={c.max_tokens!r} must be >= 1 or None (= padded length).",
    )
    require(
        c.kl_coef >= 0 and math.isfinite(c.kl_coef),
        f"kl_coef={c.kl_coef!r} must be finite and >= 0.",
    )
    require(math.isfinite(c.entropy_coef), f"entropy_coef={c.entropy_coef!r} must be finite.")


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
    require(
        not (c.advantage in ("rloo", "reinforce_pp_baseline") and G < 2),
        f"advantage={c.advantage!r} needs group_size >= 2 (a leave-one-out / group "
        f"baseline), got {G}.",
    )
    require(
        not ((c.reject_all_correct or c.reject_all_wrong) and G == 1),
        "reject_all_correct/reject_all_wrong with group_size=1 reject every correct/wrong "
        "sample; set them to False or sample more completions per prompt.",
    )


def _validate_combinations(c: AlgorithmConfig) -> None:
    """Knobs that contradict each other: the KL's place, estimator and coefficient, and
    RAFT's objective."""
    require(
        not (c.kl_coef > 0 and c.kl_in is None),
        f"kl_coef={c.kl_coef} but kl_in=None, so the KL would be ignored; set kl_in='loss' "
        "(or 'reward' for REINFORCE++), or kl_coef=0.",
    )
    require(
        not (c.kl_in == "reward" and c.advantage == "positives"),
        "kl_in='reward' needs an advantage that takes token rewards (normalized, rloo, "
        "reinforce_pp, reinforce_pp_baseline), not advantage='positives'; use kl_in='loss' "
        "instead.",
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


def _validate_correction(c: AlgorithmConfig) -> None:
    require(
        c.is_correction in correction.CORRECTIONS,
        f"is_correction={c.is_correction!r}: choose one of {correction.CORRECTIONS}.",
    )
    require(
        c.is_level in correction.IS_LEVELS,
        f"is_level={c.is_level!r}: choose one of {correction.IS_LEVELS}.",
    )
    require(
        c.is_cap > 0 and math.isfinite(c.is_cap),
        f"is_cap={c.is_cap!r} must be finite and > 0 (the tis truncation, e.g. 2).",
    )
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
