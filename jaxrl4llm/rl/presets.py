"""The named presets: each a value of AlgorithmConfig (data, never a subclass), with its paper.

``get_preset(name, **overrides)`` is the one way to build a named config; ``PRESETS`` maps
every name to its constructor (docs/algorithms.md gives each one's formula and flags).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl4llm.rl.algorithm_config import AlgorithmConfig


def grpo() -> AlgorithmConfig:
    """GRPO: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300).

    A = (r - group mean) / (group std (ddof=1) + 1e-6); per-sequence token-mean then mean over
    sequences (seq-mean-token-mean); clip 0.2; k3 KL to the reference in the loss, coef 0.04.
    """
    return AlgorithmConfig(
        name="grpo",
        mean="group",
        std="group",
        agg="seq-mean-token-mean",
        kl_in="loss",
        kl_estimator="k3",
        kl_coef=0.04,
    )


def dr_grpo() -> AlgorithmConfig:
    """Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).

    A = r - group mean (no std division); loss summed over tokens and divided by a constant
    (#sequences * max_tokens: seq-mean-token-sum-norm); clip 0.2; no KL.
    """
    return AlgorithmConfig(name="dr_grpo", mean="group", std="none", agg="seq-mean-token-sum-norm")


def reinforce() -> AlgorithmConfig:
    """Reinforce: Xiong et al. 2025, "A Minimalist Approach to LLM Reasoning" (arXiv:2504.11343).

    A = r with r = +1 correct / -1 wrong (binary_reward), no baseline; clipped importance-sampled
    surrogate (clip 0.2), token-mean; no KL. Rows a filter rejects (the Figure 4 ablations add
    group filters) keep A = 0 in the loss (rejected_rows="zero"), as the authors' code.
    """
    return AlgorithmConfig(
        name="reinforce", mean="none", std="none", binary_reward=(-1.0, 1.0), rejected_rows="zero"
    )


def reinforce_rej() -> AlgorithmConfig:
    """Reinforce-Rej: Xiong et al. 2025 (arXiv:2504.11343).

    Reinforce (A = r in {-1, +1}) with all-correct and all-wrong groups rejected; their rows
    stay in the token-mean denominator with A = 0 (rejected_rows="zero"), as the authors'
    compute_reinforce_rej_outcome_advantage (github.com/RLHFlow/Minimal-RL).
    """
    return dataclasses.replace(
        reinforce(), name="reinforce_rej", reject_all_correct=True, reject_all_wrong=True
    )


def reinforce_pp() -> AlgorithmConfig:
    """REINFORCE++: Hu 2025, "REINFORCE++" (arXiv:2501.03262).

    Token rewards r at the last token - 0.01 * k1 KL on every token; returns with gamma = 1;
    whitened over all valid tokens of the batch (ddof=1, eps=1e-6); clip 0.2; token-mean.
    """
    return AlgorithmConfig(
        name="reinforce_pp",
        advantage="reinforce_pp",
        kl_in="reward",
        kl_estimator="k1",
        kl_coef=0.01,
    )


def reinforce_pp_baseline() -> AlgorithmConfig:
    """REINFORCE++-baseline: Hu 2025 (arXiv:2501.03262).

    REINFORCE++ with the group mean of r subtracted before the returns and the batch
    whitening, and the KL to the reference as a k2 *loss* (coef 0.001) instead of k1 in the
    reward: the setting of the authors' OpenRLHF example for this estimator
    (train_reinforce_baseline_llama_ray_hybrid_engine.sh: --use_kl_loss --kl_estimator k2
    --init_kl_coef 1e-3).
    """
    return dataclasses.replace(
        reinforce_pp(),
        name="reinforce_pp_baseline",
        advantage="reinforce_pp_baseline",
        kl_in="loss",
        kl_estimator="k2",
        kl_coef=0.001,
    )


def lite_ppo() -> AlgorithmConfig:
    """Lite PPO: Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning"
    (arXiv:2508.08221).

    A = (r - group mean) / (batch std + 1e-6); token-level aggregation (token-mean); clip 0.2;
    no KL.
    """
    return AlgorithmConfig(name="lite_ppo", mean="group", std="batch", agg="token-mean")


def rloo() -> AlgorithmConfig:
    """RLOO: Ahmadian et al. 2024, "Back to Basics" (arXiv:2402.14740); Kool et al. 2019.

    A_i = r_i - mean_{j != i} r_j; clipped surrogate (clip 0.2), token-mean; no KL.
    """
    return AlgorithmConfig(name="rloo", advantage="rloo")


def raft() -> AlgorithmConfig:
    """RAFT: Dong et al. 2023, "RAFT: Reward rAnked FineTuning" (arXiv:2304.06767).

    Supervised log-likelihood (token-mean) on each group's best correct sample(s); the rest
    rejected.
    """
    return AlgorithmConfig(name="raft", advantage="positives", objective="nll", positives="best")


def raft_pp() -> AlgorithmConfig:
    """RAFT++: Xiong et al. 2025 (arXiv:2504.11343).

    Clipped importance-sampled surrogate (clip 0.2, token-mean) with A = 1 on correct samples;
    wrong samples stay in the token-mean denominator with A = 0 (rejected_rows="zero"), as the
    authors' compute_raft_outcome_advantage (github.com/RLHFlow/Minimal-RL).
    """
    return AlgorithmConfig(
        name="raft_pp",
        advantage="positives",
        objective="clipped",
        positives="correct",
        rejected_rows="zero",
    )


def gspo() -> AlgorithmConfig:
    """GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071).

    GRPO's group-normalised advantage with the sequence-level importance ratio
    s_i = (pi(y_i | x) / pi_old(y_i | x))^(1 / |y_i|), clipped per sequence to
    [1 - 3e-4, 1 + 4e-4] (the paper's ranges); per-sequence token mean (seq-mean-token-mean,
    as verl's compute_policy_loss_gspo); no KL.
    """
    return AlgorithmConfig(
        name="gspo",
        mean="group",
        std="group",
        agg="seq-mean-token-mean",
        importance="sequence",
        clip_low=3e-4,
        clip_high=4e-4,
    )


def remax() -> AlgorithmConfig:
    """ReMax: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models" (arXiv:2310.10505).

    A_i = r(x, y_i) - r(x, y_greedy): the baseline is the reward of the prompt's greedy
    completion, decoded in the same sampler call (one extra row per prompt, not trained on);
    REINFORCE's per-sequence token sum averaged over sequences (seq-mean-token-sum); no KL.
    """
    return AlgorithmConfig(name="remax", advantage="remax", agg="seq-mean-token-sum")


def dapo() -> AlgorithmConfig:
    """DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (arXiv:2503.14476).

    GRPO's group-normalised advantage; clip-higher (clip_low 0.2, clip_high 0.28); token-level
    loss (token-mean); no KL; dynamic sampling: groups whose samples are all correct or all
    wrong are resampled (up to max_resample_rounds extra rounds) and kept out of the loss.
    The soft overlong punishment is a reward option (--overlong_buffer, --overlong_penalty).
    """
    return AlgorithmConfig(
        name="dapo",
        mean="group",
        std="group",
        agg="token-mean",
        clip_low=0.2,
        clip_high=0.28,
        reject_all_correct=True,
        reject_all_wrong=True,
        dynamic_sampling=True,
    )


def ppo() -> AlgorithmConfig:
    """PPO with a critic: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"
    (arXiv:1707.06347), as the PPO baseline of the REINFORCE++ paper (Hu 2025,
    arXiv:2501.03262), run with OpenRLHF.

    Token rewards r at the last token - 0.01 * k1 KL on every token; GAE on a learned
    critic's values with gamma 1, lambda 0.95; advantages whitened over the batch's tokens
    (verl's masked_whiten); clip 0.2; token-mean. The critic (same family, scalar head) is
    trained on 0.5 * max((V - R)^2, (clip(V, V_old +- 0.2) - R)^2): OpenRLHF's defaults
    (--gamma 1 --lambd 0.95 --value_clip 0.2; verl's ppo_trainer.yaml has lam 1.0 and
    cliprange_value 0.5).
    """
    return AlgorithmConfig(
        name="ppo",
        advantage="gae",
        mean="none",
        std="none",
        agg="token-mean",
        kl_in="reward",
        kl_estimator="k1",
        kl_coef=0.01,
        gamma=1.0,
        lam=0.95,
        value_clip=0.2,
    )


PRESETS = {
    f.__name__: f
    for f in (
        grpo,
        dr_grpo,
        reinforce,
        reinforce_rej,
        reinforce_pp,
        reinforce_pp_baseline,
        lite_ppo,
        rloo,
        raft,
        raft_pp,
        gspo,
        remax,
        dapo,
        ppo,
    )
}


def get_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """The named preset, with any knob overridden (dataclasses.replace)."""
    key = name.lower().replace("-", "_")
    if key not in PRESETS:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {', '.join(sorted(PRESETS))}.")
    known = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown AlgorithmConfig knob(s) {unknown}; valid knobs: {', '.join(sorted(known))}."
        )
    return dataclasses.replace(PRESETS[key](), **overrides)
