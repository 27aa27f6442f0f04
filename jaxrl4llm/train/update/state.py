"""The train state pytree and the optimizer that updates it.

The optimizer state is laid out like the parameters from the start: `create_state` compiles
TrainState.create with output shardings that give every optimizer leaf shaped like a
parameter that parameter's sharding (scalars replicated), and `abstract_state` gives the
same layout as restore targets.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm.train.config.optimizer import SCHEDULES as SCHEDULES
from jaxrl4llm.train.config.optimizer import OptimizerConfig


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    lr = config.learning_rate
    if config.schedule == "constant" or config.decay_steps == 0:
        after = optax.constant_schedule(lr)
    elif config.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, config.decay_steps)
    else:
        after = optax.linear_schedule(lr, 0.0, config.decay_steps)
    if config.warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(lr / max(config.warmup_steps, 1), lr, config.warmup_steps)
    return optax.join_schedules([warmup, after], [config.warmup_steps])


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """AdamW with the config's schedule and clipping (values checked by
    OptimizerConfig.validate, which train.config.checks.validate runs)."""
    parts = []
    if config.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(config.max_grad_norm))
    parts.append(
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    )
    return optax.chain(*parts)


class TrainState(flax.struct.PyTreeNode):
    """Everything that changes during training; checkpointed whole."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar: completed training steps (rollouts)
    rng: jax.Array  # uint32[2] raw key data, so orbax saves it as a plain array

    @classmethod
    def create(
        cls, params: Any, optimizer: optax.GradientTransformation | OptimizerConfig, seed: int
    ) -> "TrainState":
        if isinstance(optimizer, OptimizerConfig):
            optimizer = make_optimizer(optimizer)
        return cls(
            params=params,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.key_data(jax.random.key(seed)),
        )

    def key(self) -> jax.Array:
        return jax.random.wrap_key_data(self.rng)


def like_params(tree: Any, params: Any, param_value: Any, other: Any) -> Any:
    """`tree` (e.g. an optimizer state) with every subtree shaped like `params` replaced by
    `param_value` (a tree with the params' structure) and every other leaf by `other`."""
    params_def = jax.tree.structure(params)

    def is_param_tree(x: Any) -> bool:
        # jaxlib ships no stub for its compiled PyTreeDef, so mypy sees no __eq__ on it.
        return jax.tree.structure(x) == params_def  # type: ignore[operator]

    return jax.tree.map(
        lambda x: param_value if is_param_tree(x) else other, tree, is_leaf=is_param_tree
    )


def state_shardings(
    params: Any, optimizer: OptimizerConfig | optax.GradientTransformation
) -> TrainState | None:
    """Shardings of the TrainState built from `params` (arrays or ShapeDtypeStructs carrying
    NamedShardings): optimizer leaves shaped like the params take the params' shardings,
    every other leaf is replicated. None when the params are not on a mesh."""
    leaves = jax.tree.leaves(params)
    shardings = [s for x in leaves if isinstance(s := getattr(x, "sharding", None), NamedSharding)]
    if not shardings or len(shardings) < len(leaves):
        return None
    replicated = NamedSharding(shardings[0].mesh, PartitionSpec())
    abstract = jax.eval_shape(
        functools.partial(TrainState.create, optimizer=optimizer, seed=0), params
    )
    param_shardings = jax.tree.unflatten(jax.tree.structure(params), shardings)
    # The state's tree with a sharding at every leaf: `replace` swaps all four fields.
    return abstract.replace(
        params=param_shardings,
        opt_state=like_params(abstract.opt_state, params, param_shardings, replicated),
        step=replicated,
        rng=replicated,
    )


def create_jit(params: Any, optimizer: OptimizerConfig) -> Any:
    """TrainState.create(params, optimizer=..., seed=...), jitted so the optimizer state is
    born with the sharding of `params` (arrays or abstract ones)."""
    return jax.jit(
        TrainState.create,
        static_argnames=("optimizer", "seed"),
        out_shardings=state_shardings(params, optimizer),
    )


def create_state(params: Any, optimizer: OptimizerConfig, seed: int) -> TrainState:
    """TrainState.create, compiled so the optimizer state is born with its params' sharding."""
    state: TrainState = create_jit(params, optimizer)(params, optimizer=optimizer, seed=seed)
    return state


def abstract_state(params: Any, optimizer: OptimizerConfig, seed: int) -> TrainState:
    """ShapeDtypeStructs with shardings of the state `create_state` builds (restore targets)."""
    abstract = jax.eval_shape(
        functools.partial(TrainState.create, optimizer=optimizer, seed=seed), params
    )
    shardings = state_shardings(params, optimizer)
    if shardings is None:
        return abstract
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def state_logical_axes(state: TrainState, param_axes: Any) -> TrainState:
    """Logical axes of every state leaf: the params' for params and optimizer leaves shaped
    like them, none (replicated) for the rest."""
    # The state's tree with logical axes at every leaf: `replace` swaps all four fields.
    return state.replace(
        params=param_axes,
        opt_state=like_params(state.opt_state, state.params, param_axes, ()),
        step=(),
        rng=(None,),
    )
