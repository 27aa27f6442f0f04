"""The registries of advantage estimators and policy losses, by name.

``AlgorithmConfig.advantage`` names an estimator and ``AlgorithmConfig.objective`` a policy
loss; ``compute_advantages`` and ``policy_loss`` look them up here, the presets name them, and
``validate`` checks a config against what each entry declares. The built-in ones register
themselves with the same two decorators a user calls (estimators.py, objectives.py):

    @rl.register_policy_loss("my_loss")
    def my_loss(config, x: rl.PolicyInputs):
        return -x.advantages_BT * x.logp_BT, {}            # (loss [B, T], aux)

    rl.get_preset("grpo", objective="my_loss")           # and --objective=my_loss

An estimator returns (advantages [B] or [B, T], the critic's returns [B, T] or None); a loss
returns (per-token loss [B, T], aux: bool [B, T] indicators logged as "policy/<key>_frac",
"clipped_low"/"clipped_high" as the clip fractions). The entry points apply rejected rows,
the KL and entropy terms, the sampler-trainer correction and the aggregation around them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """What a policy loss reads of one (micro-)batch; every array is float32 [B, T]."""

    logp_BT: jnp.ndarray  # pi_theta of the sampled tokens, with gradient
    old_logp_BT: jnp.ndarray  # pi_old (stop-gradient; GSPO: the sequence ratio's)
    advantages_BT: jnp.ndarray  # stop-gradient, [B] advantages broadcast over T
    mask_BT: jnp.ndarray  # 1 on the valid tokens of the rows in the loss, else 0
    key: jax.Array | None  # a PRNG key for losses that draw (Clip-Cov)
    axis_name: str | None  # the batch axis of shard_map for batch-wide statistics


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read of one rollout batch. signal_B: the rows in its
    statistics (after the group filters); valid_B: the rows with a reward."""

    rewards_B: jnp.ndarray
    correct_B: jnp.ndarray
    mask_BT: jnp.ndarray
    group_size: int
    signal_B: jnp.ndarray
    valid_B: jnp.ndarray
    kl_BT: jnp.ndarray | None = None
    baseline_B: jnp.ndarray | None = None
    baseline_correct_B: jnp.ndarray | None = None
    values_BT: jnp.ndarray | None = None
    logp_BT: jnp.ndarray | None = None
    sum_pi_squared_BT: jnp.ndarray | None = None
    axis_name: str | None = None


PolicyLossFn = Callable[[Any, PolicyInputs], tuple[jnp.ndarray, dict[str, jnp.ndarray]]]
AdvantageFn = Callable[[Any, AdvantageInputs], tuple[jnp.ndarray, "jnp.ndarray | None"]]


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss. sequence_level: one loss per sequence, the same on each of
    its tokens (the IS correction then weighs it by the row's geometric-mean weight);
    aggs: the aggregations it is defined for (None: all four); dual_clip: it applies
    config.dual_clip; sequence_ratio: it takes GSPO's sequence ratio (importance='sequence')."""

    fn: PolicyLossFn
    sequence_level: bool = False
    aggs: tuple[str, ...] | None = None
    dual_clip: bool = False
    sequence_ratio: bool = False


@dataclasses.dataclass(frozen=True)
class Advantage:
    """A registered estimator. kl_in_reward: how kl_in='reward' reaches it ("sequence": its
    [B] advantage takes the KL as token rewards, A_it = A_i - kl_coef sum_{s>=t} KL_s; "own":
    it reads AdvantageInputs.kl_BT itself; None: it refuses the KL in the reward);
    min_group_size: the smallest group it is defined for."""

    fn: AdvantageFn
    kl_in_reward: str | None = "sequence"
    min_group_size: int = 1


_POLICY_LOSSES: dict[str, PolicyLoss] = {}
_ADVANTAGES: dict[str, Advantage] = {}


def _register(table: dict, kind: str, name: str, entry: Any) -> None:
    old = table.get(name)
    if old is not None and old.fn is not entry.fn:
        raise ValueError(f"{kind} {name!r} is already registered ({old.fn.__qualname__}).")
    table[name] = entry


def register_policy_loss(
    name: str,
    *,
    sequence_level: bool = False,
    aggs: tuple[str, ...] | None = None,
    dual_clip: bool = False,
    sequence_ratio: bool = False,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: registers fn(config, PolicyInputs) -> (loss_BT, aux) as objective `name`."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        entry = PolicyLoss(fn, sequence_level, aggs, dual_clip, sequence_ratio)
        _register(_POLICY_LOSSES, "policy loss", name, entry)
        return fn

    return decorator


def register_advantage(
    name: str, *, kl_in_reward: str | None = "sequence", min_group_size: int = 1
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: registers fn(config, AdvantageInputs) -> (advantages, returns_BT or None)
    as advantage `name`."""
    if kl_in_reward not in ("sequence", "own", None):
        raise ValueError(f"kl_in_reward={kl_in_reward!r}: choose 'sequence', 'own' or None.")

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        _register(_ADVANTAGES, "advantage", name, Advantage(fn, kl_in_reward, min_group_size))
        return fn

    return decorator


def policy_loss_entry(name: str) -> PolicyLoss:
    if name not in _POLICY_LOSSES:
        raise ValueError(f"objective={name!r}: choose one of {tuple(_POLICY_LOSSES)}.")
    return _POLICY_LOSSES[name]


def advantage_entry(name: str) -> Advantage:
    if name not in _ADVANTAGES:
        raise ValueError(f"advantage={name!r}: choose one of {tuple(_ADVANTAGES)}.")
    return _ADVANTAGES[name]


class Names(tuple):
    """The names of a registry as a live tuple: it serves as a flag's choices, and a name
    registered later (a user's own loss) is among them. Compared and hashed by identity."""

    _table: Mapping[str, Any]

    def __new__(cls, table: Mapping[str, Any]) -> Names:
        names = super().__new__(cls)
        names._table = table
        return names

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._table))

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __getitem__(self, index: Any) -> Any:
        return tuple(self._table)[index]

    def __repr__(self) -> str:
        return repr(tuple(self._table))

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


POLICY_LOSSES = Names(_POLICY_LOSSES)
ADVANTAGES = Names(_ADVANTAGES)
