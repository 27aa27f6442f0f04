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
    loss (token-mean); no KL; groups whose samples are all correct or all wrong are kept out
    of the loss. Dynamic sampling (resampling such groups, §3.2) is the trainer's rollout
    (--dynamic_sampling, --max_resample_rounds; --algorithm=dapo turns it on), and the soft
    overlong punishment its reward (--overlong_buffer, --overlong_penalty): a loop of your
    own draws its batches itself.
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


def cispo() -> AlgorithmConfig:
    """CISPO: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585, Sec. 3.1).

    GRPO's group-normalised advantage; the REINFORCE token loss weighted by the clipped,
    stop-gradient IS ratio, -sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi; no lower
    bound (clip_low 1: the paper bounds the weight from above only; verl's example sets
    clip_ratio_low=10, the same band); clip_high 0.2 (verl's example
    run_cispo_qwen2_5_0_5b_gsm8k.sh: the paper tunes it and states no default); token-mean
    (the paper's normalisation by the batch's token count); no KL.
    """
    return AlgorithmConfig(
        name="cispo", objective="cispo", agg="token-mean", clip_low=1.0, clip_high=0.2
    )


def sapo() -> AlgorithmConfig:
    """SAPO: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347).

    GRPO's group-normalised advantage; the hard clip replaced by the soft gate
    f(r) = sigmoid(tau (r - 1)) 4 / tau, tau_pos 1.0 for A > 0 and tau_neg 1.05 for A <= 0
    (the paper's values, verl's actor.yaml); per-sequence token mean (seq-mean-token-mean,
    as the paper's objective and verl's compute_policy_loss_sapo); no KL.
    """
    return AlgorithmConfig(
        name="sapo",
        objective="sapo",
        agg="seq-mean-token-mean",
        sapo_tau_pos=1.0,
        sapo_tau_neg=1.05,
    )


def gmpo() -> AlgorithmConfig:
    """GMPO: Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673).

    GRPO's group-normalised advantage; each sequence's loss -A_i times the geometric mean of
    its token ratios, each clipped in log space to [-0.4, 0.4] on the pessimistic side of A
    (the paper's range (e^-0.4, e^0.4), verl's examples/gmpo_trainer); the mean over
    sequences (seq-mean-token-mean; verl's compute_policy_loss_geo_mean); no KL.
    """
    return AlgorithmConfig(
        name="gmpo", objective="gmpo", agg="seq-mean-token-mean", clip_low=0.4, clip_high=0.4
    )


def clip_cov() -> AlgorithmConfig:
    """Clip-Cov: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
    Reasoning Language Models" (arXiv:2505.22617).

    GRPO's group-normalised advantage; PPO's clipped surrogate with the gradient of up to
    2e-4 of the batch's tokens detached, drawn among those with covariance in (1, 5);
    clip_low = clip_high = 1 (the ratio band [0, 2]); token-mean; no KL: the authors'
    recipe/dapo/7b_clip_cov.sh (which also runs DAPO's group filter).
    """
    return AlgorithmConfig(
        name="clip_cov",
        objective="clip_cov",
        agg="token-mean",
        clip_low=1.0,
        clip_high=1.0,
        clip_cov_ratio=2e-4,
        clip_cov_lb=1.0,
        clip_cov_ub=5.0,
    )


def kl_cov() -> AlgorithmConfig:
    """KL-Cov: Cui et al. 2025 (arXiv:2505.22617).

    GRPO's group-normalised advantage; the unclipped surrogate -A r plus |log r| (coefficient
    1) on the 2e-3 of the batch's tokens with the largest covariance; token-mean; no KL: the
    authors' recipe/dapo/7b_kl_cov.sh (k_percent 0.2 %, ppo_kl_coef 1; their 32B script
    uses 0.02 %, verl's default kl_cov_ratio 2e-4, and verl's yaml has ppo_kl_coef 0.1).
    """
    return AlgorithmConfig(
        name="kl_cov", objective="kl_cov", agg="token-mean", kl_cov_ratio=2e-3, kl_cov_coef=1.0
    )


def gpg() -> AlgorithmConfig:
    """GPG: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for
    Model Reasoning" (arXiv:2504.02546).

    A = alpha (r - group mean) with alpha = B / (B - M), M the rows of groups without reward
    spread, F_norm = 1 (the paper's setting of its best table row); the plain policy
    gradient -A log pi (no ratio, no clip); per-sequence token mean (seq-mean-token-mean, as
    the authors' grpo_trainer.py); no KL.
    """
    return AlgorithmConfig(name="gpg", advantage="gpg", objective="gpg", agg="seq-mean-token-mean")


def opo() -> AlgorithmConfig:
    """OPO: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline" (arXiv:2505.23585).

    A = r - sum_j |o_j| r_j / sum_j |o_j| (the length-weighted group mean), no std division;
    the clipped surrogate, which on policy (one update per rollout: the paper's exact
    on-policy training) is the plain policy gradient; token-mean (verl's default); no KL and
    no entropy bonus (verl's docs/algo/opo.md).
    """
    return AlgorithmConfig(name="opo", advantage="opo", agg="token-mean")


def grpo_passk() -> AlgorithmConfig:
    """GRPO for pass@k: verl's grpo_passk estimator, after Tang et al. 2025, "Optimizing
    Language Models for Inference Time Objectives using Reinforcement Learning"
    (arXiv:2503.19595).

    Only each group's best sample learns, A = (r_max - r_second) / (group std + 1e-6)
    (verl's norm_adv_by_std_in_grpo; std='none' drops the division); clipped surrogate
    (clip 0.2), token-mean (verl's defaults); no KL.
    """
    return AlgorithmConfig(name="grpo_passk", advantage="grpo_passk", agg="token-mean")


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
        cispo,
        sapo,
        gmpo,
        clip_cov,
        kl_cov,
        gpg,
        opo,
        grpo_passk,
    )
}


# Knobs of the recipes that the trainer runs, not the loss: where each lives.
TRAINER_FLAGS = {
    "dynamic_sampling": "--dynamic_sampling, the rollout's",
    "max_resample_rounds": "--max_resample_rounds, the rollout's",
    "log_kl_ref": "--log_kl_ref, the update's",
}


def get_preset(name: str, **overrides: Any) -> AlgorithmConfig:
    """The named preset, with any knob overridden (dataclasses.replace); the result is
    checked like any config (ValueError naming the knob)."""
    key = name.lower().replace("-", "_")
    if key not in PRESETS:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {', '.join(sorted(PRESETS))}.")
    known = {f.name for f in dataclasses.fields(AlgorithmConfig)}
    unknown = sorted(set(overrides) - known)
    trainer = [k for k in unknown if k in TRAINER_FLAGS]
    if trainer:
        raise ValueError(
            f"{', '.join(trainer)}: the trainer's flags ({TRAINER_FLAGS[trainer[0]]}), not knobs "
            "of the loss library; pass them to the trainer (the library never reads them)."
        )
    if unknown:
        raise ValueError(
            f"unknown AlgorithmConfig knob(s) {unknown}; valid knobs: {', '.join(sorted(known))}."
        )
    return dataclasses.replace(PRESETS[key](), **overrides)
