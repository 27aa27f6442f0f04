"""The jitted update: one optimizer step on a mini-batch, with micro-batch gradient accumulation.

The loss of a mini-batch is sum_k loss_sum_k / D, with D the denominator of the *whole*
mini-batch (rl.loss_denominator, computed before splitting). The loss is linear in the
per-micro-batch sums, so accumulating gradients over micro-batches gives exactly the
gradient of the full mini-batch (up to float summation order) for every aggregation mode.

With `length_classes` (--micro_batch_length_classes > 1; the loop sorts the mini-batch's rows
by length into the micro-batches, see `micro_batch_order`), each micro-batch runs at the
shortest of those completion lengths that holds its longest row: one branch of a lax.switch
per length, so short micro-batches skip the padded columns (the loss is unchanged: the cut
columns are off every mask).

With --micro_batch_tokens (`packed`, train/update/packing.py), `accumulate_packed` runs the
mini-batch's sequences packed into micro-batches of R rows per device instead, and reads
each sequence's logprobs back into the [M, T] layout: the same loss, term for term.

On a mesh (`sharding`), micro-batch k is rows k, k + num_micro, ... (whole prompt groups
when prompts are shared), so every micro-batch spans every device; activations are
constrained to the batch layout and gradients to the params' layout, so the compiled update
all-gathers each layer's weights inside the layer scan and reduce-scatters its gradients.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxrl4llm import parallel, rl
from jaxrl4llm.models import routing_stats
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.lora import LoraConfig
from jaxrl4llm.rl.metrics import Metric, identity_metrics
from jaxrl4llm.train.update import adapters
from jaxrl4llm.train.update.batch import UpdateBatch
from jaxrl4llm.train.update.logprobs import TokenRouting, routed_completion_logprobs
from jaxrl4llm.train.update.packing import PackedBatch, packed_logprobs, unpack
from jaxrl4llm.train.update.state import (
    OptimizerConfig,
    TrainState,
    make_optimizer,
    state_logical_axes,
)


def _micro_loss(
    params: Any,
    micro_batch: UpdateBatch,
    denominator: jax.Array,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    temperature: float,
    remat: bool,
    prompt_group: int,
    sharding: parallel.ActivationSharding | None,
    frozen: Any = None,
    lora: LoraConfig | None = None,
    dropout_key: jax.Array | None = None,
    router_coefs: tuple[float, float] = (0.0, 0.0),
    micro_share: float = 1.0,
) -> tuple[jax.Array, dict[str, Metric]]:
    # With LoRA, `params` are the adapters and the base is a constant here: its weights get
    # no gradient (none is computed; tests/train/test_lora_training.py checks the HLO).
    policy = adapters.policy(lora, frozen, params, dropout_key)
    logp_BT, entropy_BT, routing = routed_completion_logprobs(
        policy,
        model_config,
        micro_batch.seqs,
        temperature,
        remat=remat,
        prompt_group=prompt_group,
        sharding=sharding,
    )
    loss_sum, _, metric_sums = rl.policy_loss(
        algorithm,
        logp_BT,
        micro_batch.old_logp_BT,
        micro_batch.advantages,
        micro_batch.seqs.completion_mask_BT,
        micro_batch.keep_B,
        ref_logp_BT=micro_batch.ref_logp_BT,
        entropy_BT=entropy_BT,
        behaviour_logp_BT=micro_batch.behaviour_logp_BT,
    )
    loss = loss_sum / denominator
    if routing is not None:  # a mixture of experts: its routers' terms and metrics
        router_loss, router_metrics = router_terms(
            routing, model_config.moe.experts_per_token, router_coefs
        )
        loss, metric_sums = loss + micro_share * router_loss, {**metric_sums, **router_metrics}
    return loss, metric_sums


def router_terms(
    routing: TokenRouting, k: int, coefs: tuple[float, float]
) -> tuple[jax.Array, dict[str, Metric]]:
    """(aux_coef * load-balancing loss + z_coef * z-loss, the router metrics) of a pass's
    routing (models/routing_stats.py): the two losses, the experts' load (max tokens per
    expert over the mean, 1 when balanced) and, with the sampler's record, the share of
    (layer, token) pairs whose top-k set differs between the sampler and this pass's
    routers (its own top-k, replayed or not)."""
    logits, experts = routing.logits_LNE[:, None], routing.experts_LNK[:, None]
    w_1N = routing.weight_N[None]
    balance = routing_stats.load_balancing_loss(logits, k, w_1N, experts)
    z = routing_stats.router_z_loss(logits, w_1N)
    load = routing_stats.expert_load(experts, logits.shape[-1], w_1N)
    metrics = {
        "router/aux_loss": Metric.mean(balance),
        "router/z_loss": Metric.mean(z),
        "router/load_max_over_mean": Metric.mean(load.max_tokens / load.mean_tokens),
    }
    if routing.recorded_LNK is not None:
        own = jax.lax.top_k(logits, k)[1]
        # Tokens without a record (-1: a row's last token, never fed) have nothing to compare.
        recorded_1N = w_1N * (routing.recorded_LNK[0, :, 0] >= 0)[None]
        flipped = routing_stats.routing_flip_fraction(
            own, routing.recorded_LNK[:, None], recorded_1N
        )
        layers = logits.shape[0]
        tokens = layers * jnp.sum(recorded_1N)
        metrics["router/flip_frac"] = Metric.mean(flipped * tokens, tokens)
    aux_coef, z_coef = coefs
    return aux_coef * balance + z_coef * z, metrics


def mini_batch_denominator(algorithm: rl.AlgorithmConfig, batch: UpdateBatch) -> jax.Array:
    """The whole mini-batch's loss denominator D (rl.loss_denominator, at least 1e-8): every
    micro-batch divides its loss sum by it, so their losses and gradients add up exactly."""
    mask_BT, keep_B = batch.seqs.completion_mask_BT, batch.keep_B
    return jnp.maximum(rl.loss_denominator(algorithm, mask_BT, keep_B), 1e-8)


def accumulate_gradients(
    params: Any,
    batch: UpdateBatch,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    num_micro: int,
    temperature: float,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: parallel.ActivationSharding | None = None,
    length_classes: tuple[int, ...] = (),
    frozen: Any = None,
    lora: LoraConfig | None = None,
    dropout_key: jax.Array | None = None,
    router_coefs: tuple[float, float] = (0.0, 0.0),
) -> tuple[jax.Array, Any, dict]:
    """(loss, grads, metrics) of a mini-batch, scanning over `num_micro` strided micro-batches;
    metrics are rl.metrics.Metric values by final name, merged over the micro-batches.

    `prompt_group` > 1: consecutive blocks of that many rows share a prompt (see
    `completion_logprobs`); each micro-batch holds whole blocks. With `lora` (enabled),
    `params` are the adapters on the `frozen` base params, and the grads are theirs.
    """
    denominator = mini_batch_denominator(algorithm, batch)
    grad_fn = jax.value_and_grad(
        functools.partial(
            _micro_loss,
            model_config=model_config,
            algorithm=algorithm,
            temperature=temperature,
            remat=remat,
            prompt_group=prompt_group,
            sharding=sharding,
            frozen=frozen,
            lora=lora,
            dropout_key=dropout_key,
            router_coefs=router_coefs,
            micro_share=1.0 / num_micro,  # the router's losses: the micro-batches' mean
        ),
        has_aux=True,
    )
    return accumulate(
        params,
        batch,
        grad_fn,
        denominator,
        num_micro=num_micro,
        prompt_group=prompt_group,
        param_axes=adapters.param_axes(lora, model_config),
        sharding=sharding,
        length_classes=length_classes,
    )


def accumulate(
    params: Any,
    batch: UpdateBatch,
    grad_fn: Any,
    denominator: jax.Array,
    *,
    num_micro: int,
    prompt_group: int,
    param_axes: Any,
    sharding: parallel.ActivationSharding | None,
    length_classes: tuple[int, ...] = (),
) -> tuple[jax.Array, Any, dict]:
    """(loss, grads, metrics) of `grad_fn(params, micro_batch, denominator)` (value_and_grad
    with metrics as aux) summed over `num_micro` strided micro-batches, gradients laid out
    like `param_axes`: the policy's update and the critic's share it. With `length_classes`
    (ascending, see `length_classes`), a micro-batch runs cut to the first that holds its
    longest completion."""
    rows = batch.seqs.completion_tokens_BT.shape[0]
    if rows % num_micro or (rows // num_micro) % prompt_group:
        raise ValueError(
            f"A mini-batch of {rows} rows cannot be split into {num_micro} "
            f"micro-batches of whole prompt groups of {prompt_group} rows."
        )
    micro = jax.tree.map(
        lambda x: parallel.constrain(
            parallel.split_strided(x, num_micro, prompt_group), (None, "batch"), sharding
        ),
        batch,
    )
    first = jax.tree.map(lambda x: x[0], micro)

    def run_at(length, micro_batch):
        return grad_fn(params, micro_batch.trimmed(length), denominator)

    def body(carry, micro_batch):
        if length_classes:
            longest = jnp.max(micro_batch.seqs.lengths_B())  # observation tokens included
            index = jnp.minimum(
                jnp.searchsorted(jnp.asarray(length_classes, jnp.int32), longest),
                len(length_classes) - 1,
            )
            branches = [functools.partial(run_at, length) for length in length_classes]
            out = jax.lax.switch(index, branches, micro_batch)
        else:
            out = grad_fn(params, micro_batch, denominator)
        return _add_micro_batch(carry, out, param_axes, sharding), None

    carry, _ = jax.lax.scan(
        body,
        _zero_sums(params, lambda: grad_fn(params, first, denominator), param_axes, sharding),
        micro,
    )
    return _finish(carry, params)


def _zero_sums(
    params: Any, micro_grad: Any, param_axes: Any, sharding: parallel.ActivationSharding | None
) -> tuple[Any, jax.Array, dict]:
    """(gradients, loss, metrics) before the first micro-batch; `micro_grad()` is one
    micro-batch's value_and_grad (only its metrics' shapes are read)."""
    _, metric_shapes = jax.eval_shape(lambda: micro_grad()[0])
    zero_grads = parallel.constrain_tree(
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params), param_axes, sharding
    )
    return zero_grads, jnp.zeros((), jnp.float32), identity_metrics(metric_shapes)


def _add_micro_batch(
    carry: tuple, out: Any, param_axes: Any, sharding: parallel.ActivationSharding | None
) -> tuple:
    grads, loss, metrics = carry
    (micro_loss, micro_metrics), micro_grads = out
    # Laid out like the params: each micro-batch's gradient is reduce-scattered.
    micro_grads = parallel.constrain_tree(micro_grads, param_axes, sharding)
    grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, micro_grads)
    return grads, loss + micro_loss, rl.combine_metrics(metrics, micro_metrics)


def _finish(carry: tuple, params: Any) -> tuple[jax.Array, Any, dict]:
    grads, loss, metric_sums = carry
    return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metric_sums


def accumulate_packed(
    params: Any,
    batch: UpdateBatch,
    packed: PackedBatch,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    temperature: float,
    remat: bool = False,
    sharding: parallel.ActivationSharding | None = None,
    frozen: Any = None,
    lora: LoraConfig | None = None,
    dropout_key: jax.Array | None = None,
) -> tuple[jax.Array, Any, dict]:
    """(loss, grads, metrics) of a mini-batch whose sequences are packed (`packing.pack`):
    micro-batch k runs its packed rows, reads each of its sequences' completion logprobs back
    into the mini-batch's [M, T] layout and takes the padded update's loss over its own rows
    (the others off the mask), divided by the whole mini-batch's denominator: the padded
    update's loss, gradient and metrics, summed in another order. Only the `num_micro`
    micro-batches that hold rows run; each is R packed rows per data-parallel device
    (its rows constrained to the batch axes: equal token budgets per device). With `lora`
    (enabled), `params` are the adapters on the `frozen` base, as in `accumulate_gradients`
    (--lora_dropout draws its masks over the packed rows' shape)."""
    mask_MT, keep_M = batch.seqs.completion_mask_BT, batch.keep_B
    T = mask_MT.shape[1]
    denominator = mini_batch_denominator(algorithm, batch)
    param_axes = adapters.param_axes(lora, model_config)

    def micro_loss(params, k):
        policy = adapters.policy(lora, frozen, params, dropout_key)
        logp_RL, entropy_RL = packed_logprobs(
            policy, model_config, packed, k, temperature, remat=remat, sharding=sharding
        )
        mine_M = packed.micro_M == k
        logp_MT = unpack(logp_RL, packed.start_M, T)
        loss_sum, _, metrics = rl.policy_loss(
            algorithm,
            logp_MT,
            batch.old_logp_BT,
            batch.advantages,
            mask_MT & mine_M[:, None],
            keep_M,
            ref_logp_BT=batch.ref_logp_BT,
            entropy_BT=unpack(entropy_RL, packed.start_M, T),
            behaviour_logp_BT=batch.behaviour_logp_BT,
        )
        # The one metric that counts rows: only this micro-batch's.
        metrics["policy/frac_rejected"] = Metric.mean(
            jnp.sum(mine_M & ~keep_M, dtype=jnp.float32), jnp.sum(mine_M, dtype=jnp.float32)
        )
        return loss_sum / denominator, metrics

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    carry = jax.lax.fori_loop(
        0,
        packed.num_micro,
        lambda k, carry: _add_micro_batch(carry, grad_fn(params, k), param_axes, sharding),
        _zero_sums(params, lambda: grad_fn(params, jnp.int32(0)), param_axes, sharding),
    )
    return _finish(carry, params)


# The static settings of an update program (the policy's and the critic's).
UPDATE_STATICS = (
    "model_config",
    "algorithm",
    "optimizer",
    "num_micro",
    "remat",
    "prompt_group",
    "sharding",
)


@functools.partial(
    jax.jit,
    donate_argnames=("state",),
    static_argnames=UPDATE_STATICS + ("temperature", "length_classes", "lora", "router_coefs"),
)
def train_step(
    state: TrainState,
    batch: UpdateBatch,
    *,
    optimizer: OptimizerConfig,
    packed: PackedBatch | None = None,
    **options: Any,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update on a mini-batch; the old state is donated (updated in place).

    `options` are `policy_gradients`' keywords. Every static argument is a frozen config
    (hashable by value), so separate runs in one process share the compiled program. With
    `sharding`, the new state keeps the layout of the params' logical axes (the layout
    `state.create_state` gives it). An update whose loss or gradient is not finite is
    skipped: the state comes back unchanged and `optim/skipped_updates` counts it (the loop
    stops a run that keeps skipping).
    """
    loss, grads, metrics = policy_gradients(state.params, batch, packed, **options)
    new_state, update_metrics = apply_update(
        state,
        loss,
        grads,
        optimizer=optimizer,
        param_axes=adapters.param_axes(options.get("lora"), options["model_config"]),
        sharding=options.get("sharding"),
        loss_name="policy/loss",
        prefix="optim",
    )
    return new_state, dict(metrics, **update_metrics)


def policy_gradients(
    params: Any,
    batch: UpdateBatch,
    packed: PackedBatch | None,
    *,
    model_config: ModelConfig,
    algorithm: rl.AlgorithmConfig,
    num_micro: int,
    temperature: float,
    remat: bool = False,
    prompt_group: int = 1,
    sharding: parallel.ActivationSharding | None = None,
    length_classes: tuple[int, ...] = (),
    lora: LoraConfig | None = None,
    frozen: Any = None,
    dropout_key: jax.Array | None = None,
    router_coefs: tuple[float, float] = (0.0, 0.0),
) -> tuple[jax.Array, Any, dict]:
    """(loss, grads, metrics) of the policy on a mini-batch. `packed` (--micro_batch_tokens):
    its sequences packed into token-budget micro-batches (`accumulate_packed`; num_micro,
    prompt_group and length_classes unused). LoRA (`lora` enabled):
    `params` are the adapters, `frozen` the base params (not donated, not updated: no
    gradient and no optimizer state of theirs), `dropout_key` the key of --lora_dropout
    (None when it is 0). `router_coefs`: a mixture of experts' (load-balancing, z) loss
    coefficients (the padded update; router_terms)."""
    common: dict[str, Any] = dict(
        model_config=model_config,
        algorithm=algorithm,
        temperature=temperature,
        remat=remat,
        sharding=sharding,
    )
    adapter: dict[str, Any] = dict(frozen=frozen, lora=lora, dropout_key=dropout_key)
    if packed is None:
        return accumulate_gradients(
            params,
            batch,
            num_micro=num_micro,
            prompt_group=prompt_group,
            length_classes=length_classes,
            router_coefs=router_coefs,
            **adapter,
            **common,
        )
    return accumulate_packed(params, batch, packed, **adapter, **common)


def apply_update(
    state: TrainState,
    loss: jax.Array,
    grads: Any,
    *,
    optimizer: OptimizerConfig,
    param_axes: Any,
    sharding: parallel.ActivationSharding | None,
    loss_name: str,
    prefix: str,
) -> tuple[TrainState, dict[str, Metric]]:
    """The optimizer step of `train_step` (and the critic's): skipped when the loss or the
    gradient is not finite; metrics `loss_name`, PREFIX/grad_norm, /update_norm,
    /skipped_updates."""
    # A non-finite loss or gradient (a NaN reward, an overflow) skips the update: the state
    # stays as it was, optimizer count included (optax.apply_if_finite's rule, without its
    # extra optimizer state, so older checkpoints still restore). A cond, not a select over
    # old and new state: it needs no second copy of the state (temp memory +14% on CPU vs
    # +42% for jnp.where). With finite gradients and a finite learning rate (a validated
    # flag) AdamW's new state is finite.
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(operands):
        params, opt_state, grads = operands
        updates, opt_state = make_optimizer(optimizer).update(grads, opt_state, params)
        return (
            optax.apply_updates(params, updates),
            opt_state,
            optax.global_norm(updates).astype(jnp.float32),
        )

    def keep(operands):  # update_norm 0: nothing was applied
        params, opt_state, _ = operands
        return params, opt_state, jnp.zeros((), jnp.float32)

    params, opt_state, update_norm = jax.lax.cond(
        finite, apply, keep, (state.params, state.opt_state, grads)
    )
    metrics = {
        loss_name: Metric.mean(loss),
        f"{prefix}/grad_norm": Metric.mean(grad_norm),
        f"{prefix}/update_norm": Metric.mean(update_norm),
        f"{prefix}/skipped_updates": Metric.sum(1.0 - finite.astype(jnp.float32)),
    }
    new_state = state.replace(params=params, opt_state=opt_state)
    axes = state_logical_axes(new_state, param_axes)
    return parallel.constrain_tree(new_state, axes, sharding), metrics
