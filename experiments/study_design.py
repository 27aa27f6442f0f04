"""A study's design, checked before any run: arms that are the same arm, flags that do nothing.

Every arm's resolved config is applied (rl.algorithms.compute_advantages, then the loss's
aggregation) to the same few random rollout batches: binary verdicts drawn so that every
batch holds all-correct, all-wrong and mixed groups, random completion lengths, truncation
flags, log-probabilities and critic values. What an arm feeds its update is then two
per-token weight tables per batch:
  - the policy-gradient weight, A_t x d(aggregated loss)/d(token loss): the advantage
    through the rejection filters, the reward map and the loss's denominator;
  - the regulariser weight, d(aggregated loss)/d(token loss): which tokens the KL and
    entropy terms see, and with what weight (rows kept with A = 0 still count here).
Two arms are the same arm when these weights agree (rtol 1e-4: the eps added to a std) on
every batch and the rest of their configs (clipping, KL, optimiser, data, sampling, ...) is
equal; the runner refuses such a design, naming the arms. Arms whose policy weights differ
by one constant factor are reported (Adam's update barely changes with a constant gradient
scale; gradient clipping and the regularisers do), and so is each arm flag (but a flagfile or
an --algorithm preset) whose removal leaves the arm the same: it has no effect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.study_spec import Run, resolve_config
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.rl import algorithm_config, algorithms, losses

if TYPE_CHECKING:
    from jaxrl4llm.train.config import TrainConfig

NUM_BATCHES = 4
PROMPTS = 8  # groups per random batch (the arm's group size)
TOKENS = 8  # completion slots per row
RTOL, ATOL = 1e-4, 1e-7
# AlgorithmConfig fields whose whole effect is in the weights above; the other fields (clip,
# KL, entropy, sampling, ...) must be equal for two arms to be the same.
WEIGHT_FIELDS = (
    "name",
    "advantage",
    "mean",
    "std",
    "ddof",
    "eps",
    "agg",
    "max_tokens",
    "reject_all_correct",
    "reject_all_wrong",
    "rejected_rows",
    "overlong_filter",
    "positives",
    "binary_reward",
)


class DegenerateDesignError(UserError):
    """Two arms of a study feed their updates the same thing: the comparison measures noise."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What an arm's update sees: the config outside WEIGHT_FIELDS and the weights."""

    rest: Any  # (the TrainConfig with a default algorithm, seed and workdir blanked; the
    # algorithm's fields outside WEIGHT_FIELDS)
    policy: np.ndarray  # policy-gradient weights of every batch, concatenated
    regulariser: np.ndarray

    def same(self, other: Fingerprint) -> bool:
        return (
            self.rest == other.rest
            and np.allclose(self.policy, other.policy, rtol=RTOL, atol=ATOL)
            and np.allclose(self.regulariser, other.regulariser, rtol=RTOL, atol=ATOL)
        )

    def factor(self, other: Fingerprint) -> float | None:
        """c when self's policy weights are c x other's (c != 1) and all else is the same."""
        a, b = self.policy.ravel(), other.policy.ravel()
        if self.rest != other.rest or not np.any(b):
            return None
        c = float(a @ b / (b @ b))
        same_regs = np.allclose(self.regulariser, other.regulariser, rtol=RTOL, atol=ATOL)
        if same_regs and not np.isclose(c, 1.0) and np.allclose(a, c * b, rtol=RTOL, atol=ATOL):
            return c
        return None


def random_batches(group_size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """NUM_BATCHES rollout batches of PROMPTS groups: group g of a batch has a number of
    correct samples cycling through 0..group_size, so each batch has all-wrong, all-correct
    and mixed groups; the rest is random (seeded)."""
    rng = np.random.default_rng(seed)
    B = PROMPTS * group_size
    batches = []
    for i in range(NUM_BATCHES):
        counts = (np.arange(PROMPTS) + i) % (group_size + 1)
        correct = np.concatenate([rng.permutation(np.arange(group_size) < k) for k in counts])
        lengths = rng.integers(1, TOKENS + 1, B)
        batches.append(
            {
                "correct_B": correct,
                "rewards_B": correct.astype(np.float32),
                "mask_BT": (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32),
                "truncated_B": lengths == TOKENS,
                "logp_BT": -rng.exponential(1.0, (B, TOKENS)).astype(np.float32),
                "ref_logp_BT": -rng.exponential(1.0, (B, TOKENS)).astype(np.float32),
                "values_BT": rng.normal(0.0, 0.5, (B, TOKENS)).astype(np.float32),
                "baseline_B": rng.random(B).astype(np.float32),
                "baseline_correct_B": rng.random(B) < 0.5,
            }
        )
    return batches


def update_weights(
    algorithm: algorithm_config.AlgorithmConfig, group_size: int, batch: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(policy-gradient weights [B, T], regulariser weights [B, T]) of one batch."""
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    extra = {k: b[k] for k in b if k not in ("rewards_B", "correct_B", "mask_BT")}
    adv, _, keep, _ = algorithms.compute_advantages_and_returns(
        algorithm, b["rewards_B"], b["correct_B"], b["mask_BT"], group_size, **extra
    )

    def aggregated(loss_BT):
        total, denominator = losses.aggregate(
            loss_BT, b["mask_BT"], keep, algorithm.agg, algorithm.max_tokens
        )
        return total / jnp.maximum(denominator, 1e-12)

    token = jax.grad(aggregated)(jnp.zeros(b["mask_BT"].shape, jnp.float32))
    policy = losses.broadcast_advantages(adv, token.shape) * token
    return np.asarray(policy), np.asarray(token)


def fingerprint(config: TrainConfig, batches: Sequence[dict[str, np.ndarray]]) -> Fingerprint:
    """`config`: a resolved TrainConfig."""
    alg = config.algorithm
    group_size = config.rollout.group_size
    # The algorithm's other fields as data: with WEIGHT_FIELDS at their defaults they need
    # not make a valid config (RAFT's objective='nll' with advantage='normalized').
    rest = (
        dataclasses.replace(
            config,
            algorithm=algorithm_config.AlgorithmConfig(),
            run=dataclasses.replace(config.run, seed=0, workdir=""),
        ),
        {
            f.name: getattr(alg, f.name)
            for f in dataclasses.fields(alg)
            if f.name not in WEIGHT_FIELDS
        },
    )
    tables = [update_weights(alg, group_size, batch) for batch in batches]
    return Fingerprint(
        rest,
        np.concatenate([p.ravel() for p, _ in tables]),
        np.concatenate([r.ravel() for _, r in tables]),
    )


@dataclasses.dataclass(frozen=True)
class DesignCheck:
    identical: list[tuple[str, str]]  # pairs of arms that are the same arm
    proportional: list[tuple[str, str, float]]  # (a, b, c): a's policy weights = c x b's
    no_effect: list[tuple[str, str]]  # (arm, flag): removing the flag changes nothing

    def warnings(self) -> list[str]:
        out = [
            f"arms {a} and {b}: policy-gradient weights differ only by the factor {c:.3g} "
            "(Adam's update is nearly invariant to it; gradient clipping and the KL / "
            "entropy terms are not): expect a small difference"
            for a, b, c in self.proportional
        ]
        out += [
            f"arm {arm}: {flag} has no effect (same advantages, loss weights and settings "
            "without it)"
            for arm, flag in self.no_effect
        ]
        return out


def check_design(runs: Sequence[Run], where: str) -> DesignCheck:
    """Checks the arms of `runs` (one run per arm is enough: seeds do not change the design);
    raises DegenerateDesignError naming every pair of identical arms."""
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run.arm, run)
    train_flags = {arm: list(run.argv[3:]) for arm, run in first.items()}
    configs = {arm: resolve_config(f, f"{where}: arm {arm}") for arm, f in train_flags.items()}
    cache: dict[int, list] = {}

    def batches_for(config: TrainConfig) -> list[dict[str, np.ndarray]]:
        G = config.rollout.group_size
        return cache.setdefault(G, random_batches(G))

    prints = {arm: fingerprint(c, batches_for(c)) for arm, c in configs.items()}
    names = list(prints)
    identical, proportional = [], []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if prints[a].same(prints[b]):
                identical.append((a, b))
            elif (c := prints[a].factor(prints[b])) is not None:
                proportional.append((a, b, c))
    if identical:
        pairs = "; ".join(f"{a} = {b}" for a, b in identical)
        raise DegenerateDesignError(
            f"{where}: arms that are the same arm ({pairs}): on {NUM_BATCHES} random reward "
            "batches they give the same advantages and loss weights, and their other "
            "settings are equal, so comparing them measures seed noise only. Remove one of "
            "each pair, or change what it does (experiments/study_design.py says what is "
            "compared)."
        )
    no_effect = [
        (arm, flag)
        for arm, run in first.items()
        for flag in flags_without_effect(run, prints[arm], batches_for, where)
    ]
    return DesignCheck(identical, proportional, no_effect)


def flags_without_effect(
    run: Run,
    arm_print: Fingerprint,
    batches_for: Callable[[TrainConfig], list[dict[str, np.ndarray]]],
    where: str,
) -> list[str]:
    """The arm flags of `run` whose removal leaves its fingerprint the same."""
    out = []
    # A flagfile or a preset is where the arm starts from, named on purpose.
    for flag in (f for f in run.arm_flags if not f.startswith(("--flagfile=", "--algorithm="))):
        flags = list(run.argv[3:])
        del flags[len(flags) - 1 - flags[::-1].index(flag)]  # the arm's, after the scale's
        try:
            config = resolve_config(flags, f"{where}: arm {run.arm} without {flag}")
        except ValueError:
            continue  # the flag is needed for the config to be valid at all
        if fingerprint(config, batches_for(config)).same(arm_print):
            out.append(flag)
    return out
